package sched

import (
	"maps"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/registry"
)

// fixedSource is a MetricsSource with a constant snapshot.
type fixedSource struct{ s *metrics.Snapshot }

func (f fixedSource) Load() *metrics.Snapshot { return f.s }

var now = time.Unix(1_700_000_000, 0)

// m describes one test endpoint: scraped values (fresh unless stale or
// none; stale is failing, last good 5 s ago; silent, when set, is how long
// ago the last good scrape was, not failing; MaxAge is 1 s), plus the
// picker's in-flight counters.
type m struct {
	waiting, running int
	kv               float64
	inflight, tokens int64
	stale, none      bool
	silent           time.Duration
	maxLoras         int
	runningLoRAs     []string
	waitingLoRAs     []string
	numBlocks        int
}

func mkEps(specs ...m) []*Endpoint {
	out := make([]*Endpoint, len(specs))
	for i, sp := range specs {
		e := &Endpoint{Pool: "p", Address: string(rune('a' + i)), Load: new(Load)}
		e.Load.InFlightRequests.Store(sp.inflight)
		e.Load.InFlightTokens.Store(sp.tokens)
		if !sp.none {
			s := &metrics.Snapshot{MaxAge: time.Second, LastSuccess: now.Add(-100 * time.Millisecond)}
			if sp.stale {
				s.LastSuccess = now.Add(-5 * time.Second)
				s.Failing = true
			}
			if sp.silent > 0 {
				s.LastSuccess = now.Add(-sp.silent)
			}
			s.Waiting, s.Running, s.KVUsage = sp.waiting, sp.running, sp.kv
			s.MaxLoras, s.RunningAdapters, s.WaitingAdapters, s.NumBlocks = sp.maxLoras, sp.runningLoRAs, sp.waitingLoRAs, sp.numBlocks
			e.Metrics = fixedSource{s}
		}
		out[i] = e
	}
	return out
}

func inDelta(t *testing.T, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > 1e-9 {
			t.Errorf("score[%d] = %.4f, want %.4f (all %v)", i, got[i], want[i], got)
		}
	}
}

func TestScorers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc string
		s    Scorer
		req  Request
		eps  []m
		want []float64
	}{
		{desc: "queue: spread wider than span", s: queueScorer{}, eps: []m{{waiting: 0}, {waiting: 2}, {waiting: 8}}, want: []float64{1, 0.75, 0}},
		{desc: "queue: one extra request costs a quarter", s: queueScorer{}, eps: []m{{waiting: 0}, {waiting: 1}}, want: []float64{1, 0.75}},
		{desc: "queue: in flight beyond the scrape counts", s: queueScorer{},
			// a: 0 waiting, 2 running, 5 in flight -> 3 unseen; b: 1 waiting.
			eps: []m{{running: 2, inflight: 5}, {waiting: 1}}, want: []float64{0.5, 1}},
		{desc: "queue: no metrics falls back to in flight", s: queueScorer{}, eps: []m{{none: true, inflight: 2}, {waiting: 0}}, want: []float64{0.5, 1}},
		{desc: "queue: all equal", s: queueScorer{}, eps: []m{{waiting: 3}, {waiting: 3}}, want: []float64{1, 1}},
		{desc: "running: normalised, unknown gets the mean", s: runningScorer{}, eps: []m{{running: 0}, {running: 8}, {running: 32}, {stale: true}},
			want: []float64{1, 0.75, 0, 1.75 / 3}},
		{desc: "running: nothing known is neutral", s: runningScorer{}, eps: []m{{none: true}, {stale: true}}, want: []float64{1, 1}},
		{desc: "kv: flat below the knee, linear above, unknown gets the mean", s: kvCacheScorer{}, eps: []m{{kv: 0.2}, {kv: 0.9}, {kv: 0.7}, {none: true}},
			want: []float64{1, 0.25, 0.75, 2.0 / 3}},
		{desc: "in-flight tokens: span 16384", s: inFlightTokensScorer{}, eps: []m{{tokens: 0}, {tokens: 8192}, {tokens: 4096}},
			want: []float64{1, 0.5, 0.75}},
		{desc: "in-flight: min-max", s: leastInFlight{}, eps: []m{{inflight: 2}, {inflight: 0}, {inflight: 1}}, want: []float64{0, 1, 0.5}},
		{desc: "lora: running > free slot > full, no info gets the mean", s: loraScorer{}, req: Request{Model: "ad", TargetModel: "ad"},
			eps: []m{
				{maxLoras: 2, runningLoRAs: []string{"ad"}},
				{maxLoras: 2, runningLoRAs: []string{"x"}},
				{maxLoras: 2, runningLoRAs: []string{"x", "y"}, waitingLoRAs: []string{"ad"}},
				{},
			},
			want: []float64{1, 0.5, 0, 0.5}},
		{desc: "lora: base model is neutral", s: loraScorer{}, req: Request{Model: "base", TargetModel: "base"},
			eps:  []m{{maxLoras: 1, runningLoRAs: []string{"x"}}, {maxLoras: 1}},
			want: []float64{1, 1}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			e := mkEps(tc.eps...)
			req := tc.req
			req.Now = now
			got := make([]float64, len(e))
			tc.s.Score(&req, e, got)
			inDelta(t, got, tc.want)
		})
	}
}

func names(eps []*Endpoint) string {
	var b strings.Builder
	for _, e := range eps {
		b.WriteString(e.Address)
	}
	return b.String()
}

func TestMetricFilters(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc string
		f    Filter
		req  Request
		eps  []m
		want string
	}{
		{"stale dropped, unscraped kept", healthFilter{}, Request{}, []m{{}, {stale: true}, {none: true}}, "ac"},
		{"all stale kept", healthFilter{}, Request{}, []m{{stale: true}, {stale: true}}, "ab"},
		// Every reading aged at once (the picker fell behind): the one
		// silent for longer than its MaxAge before the others' newest
		// reading had died before it.
		{"all stale: long silent dropped", healthFilter{}, Request{}, []m{{silent: 1500 * time.Millisecond}, {silent: 5 * time.Second}, {silent: 1200 * time.Millisecond}}, "ac"},
		{"all stale: failing dropped while others are not", healthFilter{}, Request{}, []m{{stale: true}, {silent: 2 * time.Second}}, "b"},
		{"all stale alike kept", healthFilter{}, Request{}, []m{{silent: 2 * time.Second}, {silent: 2500 * time.Millisecond}}, "ab"},
		{"adapter: running or free slot", loraFilter{}, Request{Model: "ad", TargetModel: "ad"},
			[]m{{maxLoras: 1, runningLoRAs: []string{"x"}}, {maxLoras: 1, runningLoRAs: []string{"ad"}}, {maxLoras: 2, runningLoRAs: []string{"x"}}}, "bc"},
		{"adapter: no slot anywhere keeps all", loraFilter{}, Request{Model: "ad", TargetModel: "ad"},
			[]m{{maxLoras: 1, runningLoRAs: []string{"x"}, waitingLoRAs: []string{"ad"}}, {maxLoras: 1, runningLoRAs: []string{"y"}}}, "ab"},
		{"base model untouched", loraFilter{}, Request{Model: "base", TargetModel: "base"},
			[]m{{maxLoras: 1, runningLoRAs: []string{"x"}}, {maxLoras: 1}}, "ab"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			req := tc.req
			req.Now = now
			if got := names(tc.f.Filter(&req, mkEps(tc.eps...))); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestPrefixScorerAndLoadGuard(t *testing.T) {
	t.Parallel()
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 1, CharsPerToken: 4}) // 4-char blocks
	prompt := "aaaabbbbccccddddeeeeffffgggghhhh"                               // 8 blocks
	hashes := h.Hash(nil, "m", prompt)
	for _, tc := range []struct {
		desc string
		eps  []m
		want []float64
	}{
		{"fraction of blocks held", []m{{}, {}, {}}, []float64{0.5, 0.25, 0}},
		{"holder within half the guard keeps affinity", []m{{waiting: 4}, {}, {}}, []float64{0.5, 0.25, 0}},
		{"holder fades between half and full guard", []m{{waiting: 6}, {}, {}}, []float64{0.25, 0.25, 0}},
		{"holder over the guard loses affinity", []m{{waiting: 8}, {}, {}}, []float64{0, 0.25, 0}},
		{"in-flight prompt tokens guard too", []m{{tokens: 32768}, {}, {}}, []float64{0, 0.25, 0}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			idx := prefix.NewIndex(prefix.Config{})
			idx.Add("a", hashes[:4])
			idx.Add("b", hashes[:2])
			p := &prefixScorer{Index: idx, Guard: DefaultLoadGuard}
			req := Request{Now: now, Hashes: hashes}
			got := make([]float64, 3)
			p.Score(&req, mkEps(tc.eps...), got)
			inDelta(t, got, tc.want)
		})
	}
	t.Run("picked endpoint learns the whole prompt and its capacity", func(t *testing.T) {
		idx := prefix.NewIndex(prefix.Config{})
		p := &prefixScorer{Index: idx}
		e := mkEps(m{numBlocks: 1000}, m{})
		req := Request{Now: now, Hashes: hashes}
		got := make([]float64, 2)
		p.Score(&req, e, got)
		inDelta(t, got, []float64{0, 0})
		p.Picked(&req, e[0])
		p.Score(&req, e, got)
		inDelta(t, got, []float64{1, 0})
		if c := idx.Stats().PerEndpoint["a"].Capacity; c != 1000 {
			t.Errorf("capacity %d, want the scraped num_gpu_blocks 1000", c)
		}
	})
}

func TestSessionAffinity(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc    string
		eps     []m
		drop    bool // remembered endpoint not a candidate
		session string
		at      time.Duration
		want    []float64
	}{
		{desc: "remembered endpoint wins", eps: []m{{}, {}, {}}, session: "s1", want: []float64{0, 1, 0}},
		{desc: "no session header: neutral", eps: []m{{}, {}, {}}, session: "", want: []float64{0, 0, 0}},
		{desc: "unknown session: neutral", eps: []m{{}, {}, {}}, session: "other", want: []float64{0, 0, 0}},
		{desc: "overloaded endpoint released", eps: []m{{}, {waiting: 8}, {}}, session: "s1", want: []float64{0, 0, 0}},
		{desc: "endpoint gone or unhealthy: neutral", eps: []m{{}, {}}, drop: true, session: "s1", want: []float64{0, 0}},
		{desc: "expired session: neutral", eps: []m{{}, {}, {}}, session: "s1", at: time.Hour, want: []float64{0, 0, 0}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			tab := NewSessions(10, time.Minute)
			tab.Put("s1", "b", now)
			s := &sessionScorer{Table: tab, Guard: DefaultLoadGuard}
			e := mkEps(tc.eps...)
			if tc.drop {
				e[1].Address = "c" // b is not among the candidates
			}
			req := Request{Now: now.Add(tc.at), Session: tc.session}
			got := make([]float64, len(e))
			s.Score(&req, e, got)
			inDelta(t, got, tc.want)
		})
	}
	t.Run("picked rebinds and LRU is bounded", func(t *testing.T) {
		tab := NewSessions(2, time.Minute)
		s := &sessionScorer{Table: tab}
		e := mkEps(m{}, m{})
		s.Picked(&Request{Session: "s1", Now: now}, e[0])
		s.Picked(&Request{Session: "s1", Now: now}, e[1])
		if a, _ := tab.Get("s1", now); a != "b" {
			t.Errorf("s1 -> %q, want rebound to b", a)
		}
		s.Picked(&Request{Session: "s2", Now: now}, e[0])
		s.Picked(&Request{Session: "s3", Now: now}, e[0])
		if _, ok := tab.Get("s1", now); ok || tab.Len() != 2 {
			t.Errorf("least recent session kept (len %d)", tab.Len())
		}
	})
}

func TestSaturation(t *testing.T) {
	t.Parallel()
	th := Thresholds{Queue: 5, KV: 0.8}
	for _, tc := range []struct {
		desc string
		eps  []m
		want bool
	}{
		{"every queue over threshold", []m{{waiting: 5}, {waiting: 9}}, true},
		{"one endpoint under both", []m{{waiting: 5}, {waiting: 4, kv: 0.5}}, false},
		{"every KV over threshold", []m{{kv: 0.8}, {kv: 0.95}}, true},
		{"mixed queue and KV", []m{{waiting: 6}, {kv: 0.9}}, true},
		{"stale counts as saturated", []m{{stale: true}, {waiting: 7}}, true},
		{"stale with a free endpoint", []m{{stale: true}, {waiting: 1}}, false},
		{"every endpoint stale, no batch learned, is not judged", []m{{stale: true}, {stale: true}}, false},
		{"requests sent since the scrape count", []m{{waiting: 3, running: 2, inflight: 7}, {waiting: 9}}, true},
		{"requests the scrape already counts do not", []m{{waiting: 3, running: 2, inflight: 5}, {waiting: 9}}, false},
		{"unscraped endpoint is not judged", []m{{none: true}, {waiting: 7}}, false},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			if got := th.Saturated(now, mkEps(tc.eps...)); got != tc.want {
				t.Errorf("saturated %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("every endpoint stale: judged by what the picker sent against the learned batch", func(t *testing.T) {
		th := Thresholds{Queue: 2, KV: 0.8}
		// Each server ran 1 (its batch) with 1 waiting at its last good
		// scrape, both sent by this picker (2 in flight then).
		stale := func(inflight int64, learned bool) []*Endpoint {
			e := mkEps(m{stale: true, running: 1, waiting: 1, inflight: inflight}, m{stale: true, running: 1, waiting: 1, inflight: inflight})
			for _, x := range e {
				x.Load.mark.Store(&scrapeMark{at: x.Snapshot().LastSuccess, inFlight: 2})
				if learned {
					x.Load.batch.Store(1)
				}
			}
			return e
		}
		if !th.Saturated(now, stale(2, true)) {
			t.Error("nothing finished since the last good scrapes: saturated")
		}
		if th.Saturated(now, stale(1, true)) {
			t.Error("a request finished on each since: room for one")
		}
		if th.Saturated(now, stale(2, false)) {
			t.Error("no batch learned: not judged")
		}
		e := stale(3, true)
		for _, x := range e {
			x.Load.mark.Store(nil) // no mark for the snapshot: in flight alone
		}
		if !th.Saturated(now, e) {
			t.Error("3 in flight, batch 1, no mark: saturated")
		}
	})
	t.Run("any rule", func(t *testing.T) {
		e := mkEps(m{inflight: 3}, m{inflight: 3})
		if !(anySaturated{th, inFlightLimit{Max: 3}}).Saturated(now, e) || (anySaturated{th, inFlightLimit{Max: 4}}).Saturated(now, e) {
			t.Error("in-flight guard must count in anySaturated")
		}
	})
}

func TestPickers(t *testing.T) {
	t.Parallel()
	t.Run("weighted random follows scores, fallbacks by score", func(t *testing.T) {
		for range 200 {
			e := mkEps(m{}, m{}, m{})
			got := weightedRandom{}.Pick(e, []float64{0, 1, 0.5, 0.25}[:3], 3, nil)
			// b or c first (weights 1 : 0.5, a has 0), then by score.
			if n := names(got); n != "bca" && n != "cba" {
				t.Fatalf("order %q, want bca or cba", n)
			}
		}
		counts := map[string]int{}
		for range 4000 {
			e := mkEps(m{}, m{})
			counts[weightedRandom{}.Pick(e, []float64{1, 3}, 1, nil)[0].Address]++
		}
		if counts["b"] < 2700 || counts["b"] > 3300 {
			t.Errorf("b picked %d of 4000, want ~3000 (weights 1:3)", counts["b"])
		}
	})
	t.Run("round robin walks", func(t *testing.T) {
		var c atomic.Uint64
		rr := roundRobin{Counter: &c}
		e := mkEps(m{}, m{}, m{})
		var got []string
		for range 4 {
			got = append(got, names(rr.Pick(e, nil, 2, nil)))
		}
		if strings.Join(got, " ") != "ab bc ca ab" {
			t.Errorf("round robin %v", got)
		}
	})
}

func TestValidateAndBuildProfiles(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc string
		sc   *registry.Scheduling
		want []string // substrings of the error; nil means valid
	}{
		{"nil is defaults", nil, nil},
		{"all knobs", &registry.Scheduling{Profile: "least-queue", Picker: "weighted-random", Scorers: map[string]float64{"prefix": 1, "kv-cache": 0},
			QueueThreshold: 3, KVThreshold: 0.9, Metrics: map[string]string{"waiting": "my_queue"}}, nil},
		{"unknown names", &registry.Scheduling{Profile: "fastest", Picker: "best", Scorers: map[string]float64{"magic": 1}},
			[]string{`profile "fastest"`, `picker "best"`, `scorer "magic"`}},
		{"bad numbers", &registry.Scheduling{Scorers: map[string]float64{"queue": -1}, KVThreshold: 2, QueueThreshold: -1},
			[]string{`scheduling.scorers.queue: scorer "queue" has weight -1`, "scheduling.kv_threshold: kv_threshold 2", "scheduling.queue_threshold: queue_threshold -1"}},
		{"bad metric override", &registry.Scheduling{Metrics: map[string]string{"nope": "x", "waiting": ""}},
			[]string{`scheduling.metrics.nope: unknown metric "nope"`, `scheduling.metrics.waiting: metric "waiting" has an empty name`}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			err := ValidateScheduling(tc.sc)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if _, berr := BuildProfile(tc.sc, Deps{}); berr == nil {
				t.Error("BuildProfile must reject what ValidateScheduling rejects")
			}
		})
	}
	deps := Deps{Prefix: prefix.NewIndex(prefix.Config{}), Sessions: NewSessions(0, 0), RoundRobin: new(atomic.Uint64)}
	for _, tc := range []struct {
		sc   *registry.Scheduling
		want map[string]float64
	}{
		{nil, DefaultWeights()},
		{&registry.Scheduling{Profile: ProfilePredictedTTFT}, PredictedTTFTWeights()},
	} {
		p, err := BuildProfile(tc.sc, deps)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, ws := range p.Scorers {
			got[ws.Scorer.Name()] = ws.Weight
		}
		if !maps.Equal(got, tc.want) {
			t.Errorf("profile %s weights %v, want %v", p.Name, got, tc.want)
		}
		if p.Picker.Name() != PickerMaxScore || !p.Uses(ScorerSession) {
			t.Errorf("profile %s: picker %s, session %v", p.Name, p.Picker.Name(), p.Uses(ScorerSession))
		}
	}
	p, _ := BuildProfile(&registry.Scheduling{Profile: "least-queue", Scorers: map[string]float64{"kv-cache": 0.5}, Picker: "weighted-random"}, deps)
	if len(p.Scorers) != 2 || p.Picker.Name() != PickerWeightedRandom {
		t.Errorf("override: %d scorers, picker %s", len(p.Scorers), p.Picker.Name())
	}
	p, _ = BuildProfile(&registry.Scheduling{Profile: "round-robin"}, deps)
	if p.Picker.Name() != "round-robin" || len(p.Scorers) != 0 {
		t.Errorf("round-robin profile: picker %s, %d scorers", p.Picker.Name(), len(p.Scorers))
	}
}

// TestWeightedProfileRanksEndToEnd checks the whole weighted mix on a
// hand-built pool: the endpoint holding the prompt wins while it is not
// overloaded, and loses to the idle one once its queue passes the guard.
func TestWeightedProfileRanksEndToEnd(t *testing.T) {
	t.Parallel()
	h := prefix.NewHasher(prefix.HashConfig{})
	hashes := h.Hash(nil, "m", strings.Repeat("system prompt words ", 200))
	for _, tc := range []struct {
		desc    string
		holderQ int
		want    string
	}{
		{"prefix holder with a short queue", 2, "a"},
		{"prefix holder overloaded", 10, "b"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			idx := prefix.NewIndex(prefix.Config{})
			idx.Add("a", hashes)
			p, _ := BuildProfile(&registry.Scheduling{Profile: ProfileWeighted}, Deps{Prefix: idx, Sessions: NewSessions(0, 0)})
			e := mkEps(m{waiting: tc.holderQ, kv: 0.3}, m{kv: 0.1}, m{waiting: 1, kv: 0.2})
			var sc Scratch
			req := &Request{Model: "m", TargetModel: "m", Now: now, Hashes: hashes, Explain: true}
			got := p.Schedule(req, e, 3, &sc)
			if got[0].Address != tc.want {
				t.Errorf("primary %s, want %s (%s)", got[0].Address, tc.want, sc.Explanation)
			}
			if !strings.Contains(sc.Explanation, "prefix=") {
				t.Errorf("explanation %q lacks per-scorer scores", sc.Explanation)
			}
		})
	}
}

// Endpoints without a models list are judged by what their server lists
// in /v1/models; a server that lists other names never gets the request,
// even when that leaves nobody (it would answer its own 404), unless the
// pool's servers load adapters on demand.
func TestModelFilterUsesServedModels(t *testing.T) {
	t.Parallel()
	now := time.Now()
	served := func(models ...string) MetricsSource {
		return fixedSource{&metrics.Snapshot{LastSuccess: now, MaxAge: time.Minute, ServedModels: models}}
	}
	e := eps([2]int64{}, [2]int64{}, [2]int64{}, [2]int64{})
	e[0].Metrics = served("base")             // a: base only
	e[1].Metrics = served("base", "sql-lora") // b: has the adapter
	e[2].Models = []string{"base"}            // c: declared list wins over discovery
	e[2].Metrics = served("base", "sql-lora")
	// d: not scraped yet, so unknown: kept
	for _, tc := range []struct {
		desc string
		req  Request
		want string
	}{
		{"adapter goes where it is loaded", Request{Model: "sql-lora", TargetModel: "sql-lora"}, "bd"},
		{"base model everywhere", Request{Model: "base", TargetModel: "base"}, "abcd"},
		{"client name listed counts", Request{Model: "sql-lora", TargetModel: "sql-lora-v2"}, "bd"},
	} {
		in := append([]*Endpoint(nil), e...)
		got := ""
		for _, x := range (modelFilter{}).Filter(&tc.req, in) {
			got += x.Address
		}
		if got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.desc, got, tc.want)
		}
	}
	// Nobody lists the model (say servers name it differently): no
	// candidate, which the picker answers with a 503 naming the model.
	known := eps([2]int64{}, [2]int64{})
	known[0].Metrics = served("llama-3-8b")
	known[1].Metrics = served("llama-3-8b")
	req := Request{Model: "llama", TargetModel: "llama"}
	if got := (modelFilter{}).Filter(&req, append([]*Endpoint(nil), known...)); len(got) != 0 {
		t.Errorf("model nobody lists: kept %d endpoints, want none", len(got))
	}
	// Adapters loaded on demand: any endpoint may take the adapter.
	req = Request{Model: "sql-lora", TargetModel: "sql-lora"}
	if got := (modelFilter{AnyAdapter: true}).Filter(&req, append([]*Endpoint(nil), known...)); len(got) != 2 {
		t.Errorf("adapters on demand: kept %d endpoints, want both", len(got))
	}
}

// TestHealthFilterJudgesThePool: the profile runs the health filter on the
// whole pool before the model filter, so a model served only by a stale
// endpoint has no candidate while the pool has fresh endpoints (EDS no
// longer holds the stale one), and the profile reports which filter
// emptied the list.
func TestHealthFilterJudgesThePool(t *testing.T) {
	t.Parallel()
	now := time.Now()
	fresh := fixedSource{&metrics.Snapshot{LastSuccess: now, MaxAge: time.Minute, ServedModels: []string{"base"}}}
	stale := fixedSource{&metrics.Snapshot{LastSuccess: now.Add(-time.Hour), MaxAge: time.Minute, ServedModels: []string{"base", "sql-lora"}}}
	e := eps([2]int64{}, [2]int64{})
	e[0].Metrics, e[1].Metrics = fresh, stale
	prof, err := BuildProfile(nil, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	var sc Scratch
	req := Request{Model: "sql-lora", TargetModel: "sql-lora", Now: now}
	if got := prof.Filter(&req, e, &sc); len(got) != 0 || sc.EmptiedBy != FilterModel {
		t.Fatalf("adapter on a stale endpoint only: %d candidates, emptied by %q; want none, by %q", len(got), sc.EmptiedBy, FilterModel)
	}
	// Every endpoint stale: all are kept (as EDS keeps them).
	e[0].Metrics = stale
	if got := prof.Filter(&req, e, &sc); len(got) != 2 || sc.EmptiedBy != "" {
		t.Fatalf("all stale: %d candidates (emptied by %q), want both", len(got), sc.EmptiedBy)
	}
}

// The saturation rule sees the server's queue as it would be with one
// more request: requests sent and finished since the scrape count, and
// once the batch size is learned (a scrape with requests waiting) a
// finished request frees its slot at once instead of at the next scrape.
func TestWaitingIfSent(t *testing.T) {
	t.Parallel()
	th := Thresholds{Queue: 1, KV: 1}
	wait := func(e *Endpoint, s *metrics.Snapshot, at time.Time) float64 {
		n, _ := waitingIfSent(e, s, at)
		return n
	}
	t.Run("no mark: what the scrape and the excess in flight say", func(t *testing.T) {
		e := mkEps(m{waiting: 0, running: 3, inflight: 4})
		if n, exact := waitingIfSent(e[0], e[0].Snapshot(), now); n != 1 || exact {
			t.Errorf("waiting %v (exact %v), want 1 now (one sent beyond the scrape's 3)", n, exact)
		}
	})
	t.Run("batch not learned: the server has taken everything so far", func(t *testing.T) {
		e := mkEps(m{waiting: 0, running: 3, inflight: 3})
		e[0].Load.MarkScrape(e[0].Snapshot())
		e[0].Load.InFlightRequests.Add(5)
		if th.Saturated(now, e) {
			t.Fatal("saturated before the server ever had a request waiting")
		}
	})
	t.Run("batch learned: room only for a request that starts at once", func(t *testing.T) {
		e := mkEps(m{waiting: 2, running: 8, inflight: 10})
		e[0].Load.MarkScrape(e[0].Snapshot())
		if got := wait(e[0], e[0].Snapshot(), now); got != 3 {
			t.Fatalf("two waiting: one more would be the third, got %v", got)
		}
		e[0].Load.InFlightRequests.Add(-2) // two finish: the waiting two run
		if !th.Saturated(now, e) {
			t.Fatal("the batch is full again: want saturated")
		}
		e[0].Load.InFlightRequests.Add(-1) // one more finishes: a free slot
		if th.Saturated(now, e) {
			t.Fatal("a slot is free: want room")
		}
		if got := wait(e[0], e[0].Snapshot(), now); got != 0 {
			t.Errorf("with a free slot: waiting %v, want 0", got)
		}
		e[0].Load.InFlightRequests.Add(1) // the slot is taken
		if got := wait(e[0], e[0].Snapshot(), now); got != 1 {
			t.Errorf("batch full: one more would wait, got %v", got)
		}
	})
	t.Run("requests in the server's front end count", func(t *testing.T) {
		// The scrape saw 8 running, 1 waiting; the picker had 12 in
		// flight: 3 were not queued yet and will wait too.
		e := mkEps(m{waiting: 1, running: 8, inflight: 12})
		e[0].Load.MarkScrape(e[0].Snapshot())
		if got := wait(e[0], e[0].Snapshot(), now); got != 5 {
			t.Errorf("waiting if sent %v, want 5", got)
		}
	})
	t.Run("batch full, nothing waiting: one probe beyond it, now and then", func(t *testing.T) {
		e := mkEps(m{waiting: 1, running: 8, inflight: 9})
		e[0].Load.MarkScrape(e[0].Snapshot()) // learns 8
		snap := *e[0].Snapshot()
		snap.Waiting, snap.LastSuccess = 0, snap.LastSuccess.Add(time.Millisecond)
		e[0].Load.InFlightRequests.Store(8)
		e[0].Load.MarkScrape(&snap)
		if got := wait(e[0], &snap, now); got != 1 {
			t.Errorf("batch confirmed just now: waiting if sent %v, want 1 (no probe yet)", got)
		}
		later := now.Add(probeAfter + time.Second)
		if got := wait(e[0], &snap, later); got != 0 {
			t.Errorf("probe due: waiting if sent %v, want 0", got)
		}
		e[0].Load.InFlightRequests.Add(1)
		if got := wait(e[0], &snap, later); got != 1 {
			t.Errorf("with the probe sent: waiting if sent %v, want 1", got)
		}
	})
	t.Run("a mark of an older scrape is ignored", func(t *testing.T) {
		e := mkEps(m{waiting: 2, running: 8, inflight: 10})
		old := *e[0].Snapshot()
		old.LastSuccess = old.LastSuccess.Add(-time.Second)
		e[0].Load.MarkScrape(&old)
		e[0].Load.InFlightRequests.Add(-5)
		if n, exact := waitingIfSent(e[0], e[0].Snapshot(), now); n != 2 || exact {
			t.Errorf("waiting %v (exact %v), want the scrape's 2", n, exact)
		}
	})
}

// The batch grows at once to the most running seen with requests
// waiting, and shrinks only after several scrapes in a row show requests
// waiting behind fewer running: one request caught between two scheduler
// steps does not shrink it.
func TestBatchLearning(t *testing.T) {
	t.Parallel()
	l := new(Load)
	at := now
	scrape := func(running, waiting int) {
		at = at.Add(50 * time.Millisecond)
		s := &metrics.Snapshot{LastSuccess: at}
		s.Running, s.Waiting = running, waiting
		l.MarkScrape(s)
	}
	scrape(3, 0)
	if b := l.batch.Load(); b != 0 {
		t.Fatalf("batch %d before any request waited, want unknown (0)", b)
	}
	scrape(8, 2)
	scrape(5, 1) // a request caught between steps
	if b := l.batch.Load(); b != 8 {
		t.Fatalf("batch %d after one scrape with a request waiting behind 5, want 8 kept", b)
	}
	for range shrinkAfter {
		scrape(6, 3) // long prompts: the KV cache holds 6
	}
	if b := l.batch.Load(); b != 6 {
		t.Fatalf("batch %d after %d scrapes with requests waiting behind 6, want 6", b, shrinkAfter)
	}
	scrape(7, 0)
	if b := l.batch.Load(); b != 7 {
		t.Fatalf("batch %d after 7 ran with nothing waiting, want 7", b)
	}
}

// QueueIfSent is the saturation rule's queue with the endpoint's
// freshness: a fresh endpoint's waitingIfSent, 0 for one never scraped,
// and a stale one is reported stale.
func TestQueueIfSent(t *testing.T) {
	t.Parallel()
	e := mkEps(m{waiting: 2, running: 8, inflight: 10}, m{none: true, inflight: 7}, m{stale: true, waiting: 9})
	e[0].Load.MarkScrape(e[0].Snapshot())
	for i, want := range []struct {
		n float64
		f Freshness
	}{{3, Fresh}, {0, Unscraped}, {0, Stale}} {
		if n, f := e[i].QueueIfSent(now); n != want.n || f != want.f {
			t.Errorf("%s: %v %v, want %v %v", e[i].Address, n, f, want.n, want.f)
		}
	}
}
