package load

import (
	"bytes"
	"encoding/json"
	"math"
	"regexp"
	"strings"
	"testing"
	"time"
)

var word4 = regexp.MustCompile(`^[a-z]{4}$`)

func genConfig(api API, w Workload) Config {
	cfg := Config{URL: "http://127.0.0.1:1", Model: "base", API: api, Workload: w, Seed: 42,
		Stages: []Stage{{Rate: 1, Duration: time.Second}}}
	return cfg.withDefaults()
}

func decode(t *testing.T, b []byte) fakeReq {
	t.Helper()
	var r fakeReq
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("body %s: %v", b, err)
	}
	return r
}

// checkTokens asserts s is exactly n four-letter words separated by single
// spaces, so the simulator counts n tokens.
func checkTokens(t *testing.T, s string, n int) {
	t.Helper()
	ws := strings.Split(s, " ")
	if len(ws) != n {
		t.Fatalf("%d words, want %d: %.80q", len(ws), n, s)
	}
	for _, w := range ws {
		if !word4.MatchString(w) {
			t.Fatalf("word %q is not four lowercase letters", w)
		}
	}
}

func bodies(cfg Config, n int) [][]byte {
	g := newGenerator(cfg)
	var out [][]byte
	for range n {
		r, ok := g.next()
		if !ok {
			break
		}
		out = append(out, r.body)
		g.done(r, "")
	}
	return out
}

func TestSameSeedSameBodies(t *testing.T) {
	workloads := map[string]Workload{
		"shared-prefix": {Kind: WorkloadSharedPrefix, Groups: 3, UsersPerGroup: 4, SystemLen: 20, QuestionLen: 5, Output: Range{Min: 4, Max: 9}},
		"multi-turn":    {Kind: WorkloadMultiTurn, Sessions: 3, Turns: 2, QuestionLen: 6, SystemLen: 4, Output: Fixed(3)},
		"random":        {Kind: WorkloadRandom, Input: Range{Min: 5, Max: 50}, Output: Range{Min: 1, Max: 8}},
	}
	for name, w := range workloads {
		for _, api := range []API{APICompletions, APIChat} {
			t.Run(name+"/"+string(api), func(t *testing.T) {
				cfg := genConfig(api, w)
				cfg.LoRA = []LoRASplit{{Adapter: "a", Fraction: 0.3}}
				a, b := bodies(cfg, 40), bodies(cfg, 40)
				if len(a) != 40 || len(b) != 40 {
					t.Fatalf("generated %d and %d bodies", len(a), len(b))
				}
				for i := range a {
					if !bytes.Equal(a[i], b[i]) {
						t.Fatalf("body %d differs:\n%s\n%s", i, a[i], b[i])
					}
				}
				cfg.Seed++
				c := bodies(cfg, 40)
				same := 0
				for i := range a {
					if bytes.Equal(a[i], c[i]) {
						same++
					}
				}
				if same == len(a) {
					t.Error("a different seed produced the same bodies")
				}
			})
		}
	}
}

func TestRequestBodyFields(t *testing.T) {
	cfg := genConfig(APICompletions, Workload{Kind: WorkloadRandom, Input: Fixed(12), Output: Fixed(7)})
	r := decode(t, bodies(cfg, 1)[0])
	if r.Model != "base" || r.MaxTokens != 7 || r.MinTokens != 7 || !r.IgnoreEOS || !r.Stream {
		t.Errorf("body %+v", r)
	}
	checkTokens(t, r.Prompt, 12)
	var raw map[string]any
	_ = json.Unmarshal(bodies(cfg, 1)[0], &raw)
	if so, _ := raw["stream_options"].(map[string]any); so["include_usage"] != true {
		t.Errorf("stream_options %v: want include_usage", raw["stream_options"])
	}
}

func TestRandomLengthsStayInRange(t *testing.T) {
	cfg := genConfig(APIChat, Workload{Kind: WorkloadRandom, Input: Range{Min: 3, Max: 9}, Output: Range{Min: 2, Max: 5}})
	seenIn, seenOut := map[int]bool{}, map[int]bool{}
	prefixes := map[string]bool{}
	for _, b := range bodies(cfg, 400) {
		r := decode(t, b)
		if len(r.Messages) != 1 || r.Messages[0].Role != "user" {
			t.Fatalf("messages %+v", r.Messages)
		}
		n := len(strings.Fields(r.Messages[0].Content))
		checkTokens(t, r.Messages[0].Content, n)
		if n < 3 || n > 9 || r.MaxTokens < 2 || r.MaxTokens > 5 {
			t.Fatalf("input %d output %d out of range", n, r.MaxTokens)
		}
		seenIn[n], seenOut[r.MaxTokens] = true, true
		prefixes[r.Messages[0].Content[:14]] = true // first three words
	}
	if len(seenIn) != 7 || len(seenOut) != 4 {
		t.Errorf("lengths seen: input %v output %v; want every value of the ranges", seenIn, seenOut)
	}
	if len(prefixes) < 395 {
		t.Errorf("only %d distinct 3-word prefixes in 400 random prompts", len(prefixes))
	}
}

func TestSharedPrefixGroups(t *testing.T) {
	w := Workload{Kind: WorkloadSharedPrefix, Groups: 4, UsersPerGroup: 3, SystemLen: 32, QuestionLen: 8, Output: Fixed(4)}
	for _, api := range []API{APICompletions, APIChat} {
		t.Run(string(api), func(t *testing.T) {
			cfg := genConfig(api, w)
			g := newGenerator(cfg)
			for i := range g.systems {
				checkTokens(t, g.systems[i], 32)
				for j := range i {
					if strings.SplitN(g.systems[i], " ", 2)[0] == strings.SplitN(g.systems[j], " ", 2)[0] {
						t.Errorf("groups %d and %d share their first token", i, j)
					}
				}
			}
			perGroup := make([]int, 4)
			questions := map[string]bool{}
			for range 300 {
				req, _ := g.next()
				r := decode(t, req.body)
				var system, question string
				if api == APIChat {
					if len(r.Messages) != 2 || r.Messages[0].Role != "system" || r.Messages[1].Role != "user" {
						t.Fatalf("messages %+v", r.Messages)
					}
					system, question = r.Messages[0].Content, r.Messages[1].Content
				} else {
					var ok bool
					system, question, ok = strings.Cut(r.Prompt, "\n")
					if !ok {
						t.Fatalf("prompt %q has no system/question split", r.Prompt)
					}
				}
				grp := -1
				for i, s := range g.systems {
					if system == s {
						grp = i
					}
				}
				if grp < 0 {
					t.Fatalf("system prompt %.40q is not one of the groups'", system)
				}
				perGroup[grp]++
				checkTokens(t, question, 8)
				found := false
				for _, q := range g.questions[grp] {
					found = found || q == question
				}
				if !found {
					t.Fatalf("question %q is not one of group %d's users'", question, grp)
				}
				questions[question] = true
			}
			for i, n := range perGroup {
				if n < 40 {
					t.Errorf("group %d got %d of 300 requests", i, n)
				}
			}
			if len(questions) != 12 {
				t.Errorf("%d distinct questions, want groups x users = 12", len(questions))
			}
		})
	}
}

func TestMultiTurnSessions(t *testing.T) {
	cfg := genConfig(APIChat, Workload{Kind: WorkloadMultiTurn, Sessions: 2, Turns: 3, QuestionLen: 4, SystemLen: 0, Output: Fixed(2)})
	g := newGenerator(cfg)
	ids := []string{}
	for turn := 1; turn <= 3; turn++ {
		var reqs []*request
		for range 2 {
			r, ok := g.next()
			if !ok {
				t.Fatalf("turn %d: no idle session", turn)
			}
			reqs = append(reqs, r)
			msgs := decode(t, r.body).Messages
			if len(msgs) != 2*turn-1 || msgs[len(msgs)-1].Role != "user" {
				t.Fatalf("turn %d: %d messages %+v", turn, len(msgs), msgs)
			}
			if turn > 1 && msgs[len(msgs)-2].Content != "answer "+r.sessionID {
				t.Errorf("turn %d does not carry the previous answer: %+v", turn, msgs)
			}
			if turn == 1 {
				ids = append(ids, r.sessionID)
			} else if r.sessionID != ids[len(reqs)-1] {
				t.Errorf("turn %d request %d: session %s, want %s", turn, len(reqs)-1, r.sessionID, ids[len(reqs)-1])
			}
		}
		if _, ok := g.next(); ok {
			t.Fatal("a busy session was handed out again")
		}
		for _, r := range reqs {
			g.done(r, "answer "+r.sessionID)
		}
	}
	// All turns used: the next request starts a new session.
	r, ok := g.next()
	if !ok || r.sessionID == ids[0] || r.sessionID == ids[1] || len(decode(t, r.body).Messages) != 1 {
		t.Errorf("after %d turns: session %q (old %v), want a fresh one", 3, r.sessionID, ids)
	}
	// A failed turn still leaves an assistant message of the requested length.
	g.done(r, "")
	next, _ := g.next()
	next2, _ := g.next()
	for _, rr := range []*request{next, next2} {
		if rr.sessionID == r.sessionID {
			msgs := decode(t, rr.body).Messages
			checkTokens(t, msgs[1].Content, 2)
		}
	}
}

func TestLoRASplitFractions(t *testing.T) {
	cfg := genConfig(APICompletions, Workload{Kind: WorkloadRandom, Input: Fixed(1), Output: Fixed(1)})
	cfg.LoRA = []LoRASplit{{Adapter: "sql-lora", Fraction: 0.2}, {Adapter: "other", Fraction: 0.1}}
	g := newGenerator(cfg)
	counts := map[string]int{}
	const n = 20000
	for range n {
		r, _ := g.next()
		if decode(t, r.body).Model != r.model {
			t.Fatal("body model differs from the recorded model")
		}
		counts[r.model]++
	}
	for name, want := range map[string]float64{"sql-lora": 0.2, "other": 0.1, "base": 0.7} {
		got := float64(counts[name]) / n
		if math.Abs(got-want) > 0.015 {
			t.Errorf("%s: fraction %.3f, want %.2f", name, got, want)
		}
	}
}

func TestShortLongMix(t *testing.T) {
	cfg := genConfig(APIChat, Workload{Kind: WorkloadShortLong, Input: Range{Min: 20, Max: 40}, Groups: 3,
		SystemLen: 500, QuestionLen: 30, LongFraction: 0.1, Output: Fixed(8)})
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	docs := map[string]int{}
	long := 0
	const n = 4000
	for _, b := range bodies(cfg, n) {
		r := decode(t, b)
		switch len(r.Messages) {
		case 2:
			long++
			checkTokens(t, r.Messages[0].Content, 500)
			checkTokens(t, r.Messages[1].Content, 30)
			docs[r.Messages[0].Content]++
		case 1:
			if k := len(strings.Fields(r.Messages[0].Content)); k < 20 || k > 40 {
				t.Fatalf("short prompt of %d tokens, want 20-40", k)
			}
		default:
			t.Fatalf("%d messages", len(r.Messages))
		}
	}
	if f := float64(long) / n; f < 0.08 || f > 0.12 {
		t.Errorf("long share %.3f, want about 0.1", f)
	}
	if len(docs) != 3 {
		t.Errorf("%d distinct long documents, want 3", len(docs))
	}
	bad := cfg
	bad.Workload.LongFraction = 1.5
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "long fraction") {
		t.Errorf("long fraction 1.5: %v", err)
	}
}

func TestBurstyArrivalsKeepTheMeanRate(t *testing.T) {
	start := time.Unix(0, 0)
	b := newBursts(newRand(7, streamArrival), start)
	const rate, n = 20.0, 200000
	t0, at := start, start
	var inBurst int
	for range n {
		at = b.next(at, rate)
		if b.burst {
			inBurst++
		}
	}
	mean := float64(n) / at.Sub(t0).Seconds()
	if math.Abs(mean/rate-1) > 0.05 {
		t.Errorf("mean rate %.2f/s, want %.0f within 5%%", mean, rate)
	}
	// A quarter of the time at 2.5x the rate: 62.5 % of the arrivals.
	if f := float64(inBurst) / n; math.Abs(f-0.625) > 0.05 {
		t.Errorf("%.3f of the arrivals in bursts, want about 0.625", f)
	}
}
