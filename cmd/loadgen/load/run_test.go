package load

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"
)

func baseConfig(url string) Config {
	return Config{
		URL:   url,
		Model: "base",
		Workload: Workload{
			Kind:   WorkloadRandom,
			Input:  Range{Min: 8, Max: 16},
			Output: Fixed(4),
		},
		Arrival:      ArrivalConstant,
		Stages:       []Stage{{Rate: 20, Duration: 500 * time.Millisecond}},
		Seed:         7,
		DrainTimeout: 10 * time.Second,
		Timeout:      10 * time.Second,
	}
}

func mustRun(t *testing.T, ctx context.Context, cfg Config) *Report {
	t.Helper()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	return rep
}

// The server sleeps ttft before the first token and itl between tokens,
// fails every 4th request with 503, rotates three x-served-by names and
// reports a quarter of the prompt as cached. Counts must match exactly;
// timings are checked only against lower bounds the server guarantees.
func TestMeasuresWhatTheServerProduced(t *testing.T) {
	for _, api := range []API{APICompletions, APIChat} {
		t.Run(string(api), func(t *testing.T) {
			t.Parallel()
			f := newFakeServer(t)
			f.ttft, f.itl = 60*time.Millisecond, 20*time.Millisecond
			f.servers = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
			f.failEvery = 4
			f.cachedPct = 25
			cfg := baseConfig(f.url)
			cfg.API = api
			cfg.Workload.Input = Fixed(40) // 40 prompt tokens: 25% is exactly 10 cached
			cfg.Arrival = ArrivalConcurrency
			cfg.Stages = []Stage{{Concurrency: 3, Duration: 700 * time.Millisecond}}
			rep := mustRun(t, context.Background(), cfg)
			tot := rep.Total

			served, failed, tokens, prompts, cached := f.snapshot()
			if tot.Sent == 0 || tot.Sent != f.n.Load() {
				t.Fatalf("sent %d, server saw %d", tot.Sent, f.n.Load())
			}
			if tot.Completed+tot.Failed+tot.Cancelled != tot.Sent {
				t.Errorf("completed %d + failed %d + cancelled %d != sent %d", tot.Completed, tot.Failed, tot.Cancelled, tot.Sent)
			}
			if tot.Failed != int64(failed) || tot.Errors["http 503"] != int64(failed) || len(tot.Errors) != 1 {
				t.Errorf("errors %v, failed %d; server failed %d", tot.Errors, tot.Failed, failed)
			}
			if tot.Statuses[503] != int64(failed) || tot.Statuses[200] != tot.Completed {
				t.Errorf("statuses %v, completed %d, server failed %d", tot.Statuses, tot.Completed, failed)
			}
			for name, n := range served {
				if tot.Servers[name] != int64(n) {
					t.Errorf("server %s: reported %d, served %d", name, tot.Servers[name], n)
				}
			}
			if len(tot.Servers) != len(served) {
				t.Errorf("servers %v, want %v", tot.Servers, served)
			}
			if tot.OutputTokens != int64(tokens) || tot.OutputTokens != 4*tot.Completed {
				t.Errorf("output tokens %d, server sent %d, completed %d x 4", tot.OutputTokens, tokens, tot.Completed)
			}
			if tot.PromptTokens != int64(prompts) || tot.CachedTokens != int64(cached) || tot.PrefixCacheHitRate != 0.25 {
				t.Errorf("prompt %d cached %d rate %v; server %d/%d, want rate 0.25", tot.PromptTokens, tot.CachedTokens, tot.PrefixCacheHitRate, prompts, cached)
			}
			if tot.TTFT.Count != tot.Completed || tot.E2E.Count != tot.Completed || tot.TPOT.Count != tot.Completed {
				t.Errorf("samples ttft %d tpot %d e2e %d, completed %d", tot.TTFT.Count, tot.TPOT.Count, tot.E2E.Count, tot.Completed)
			}
			if tot.ITL.Count != 3*tot.Completed {
				t.Errorf("ITL samples %d, want 3 per request (%d)", tot.ITL.Count, 3*tot.Completed)
			}
			// Lower bounds the server guarantees: the first token leaves 60ms
			// after the request arrived, the last 3x20ms later.
			if tot.TTFT.Min < 60*time.Millisecond {
				t.Errorf("TTFT min %v < 60ms the server waited", tot.TTFT.Min)
			}
			if tot.E2E.Min < 120*time.Millisecond {
				t.Errorf("E2E min %v < 120ms the server took", tot.E2E.Min)
			}
			if tot.TTFT.P50 > tot.E2E.P50 || tot.ITL.P50 > tot.TTFT.P50 {
				t.Errorf("ordering: ITL p50 %v <= TTFT p50 %v <= E2E p50 %v violated", tot.ITL.P50, tot.TTFT.P50, tot.E2E.P50)
			}
			if tot.ITL.Mean < 5*time.Millisecond || tot.TPOT.Mean < 5*time.Millisecond {
				t.Errorf("ITL mean %v / TPOT mean %v far below the 20ms the server paced", tot.ITL.Mean, tot.TPOT.Mean)
			}
			if tot.WindowS < 0.7 {
				t.Errorf("window %.3fs shorter than the stage", tot.WindowS)
			}
			want := float64(tot.Completed) / tot.WindowS
			if d := tot.RequestThroughput - want; d > 1e-9 || d < -1e-9 || tot.OutputTokenThroughput != 4*tot.RequestThroughput {
				t.Errorf("throughput %v req/s %v tok/s, want %v and 4x", tot.RequestThroughput, tot.OutputTokenThroughput, want)
			}
			// Closed loop with 3 workers: never more than 3 in flight.
			if m := f.maxInfl.Load(); m > 3 {
				t.Errorf("server saw %d concurrent requests, concurrency was 3", m)
			}
		})
	}
}

// Connections are reused: the client reads each stream to EOF and keeps
// an idle connection per concurrent request.
func TestKeepAliveReusesConnections(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	cfg := baseConfig(f.url)
	cfg.Arrival = ArrivalConcurrency
	cfg.Stages = []Stage{{Concurrency: 3, Duration: 300 * time.Millisecond}}
	for _, stream := range []bool{true, false} {
		cfg.NoStream = !stream
		before := f.conns.Load()
		rep := mustRun(t, context.Background(), cfg)
		if rep.Total.Completed < 10 {
			t.Fatalf("stream=%v: only %d requests", stream, rep.Total.Completed)
		}
		// Ideally 3; Go's transport returns a connection to the pool just
		// after the body's EOF, so a worker that is quicker occasionally
		// dials one more. Without reuse this is one per request.
		if n := f.conns.Load() - before; n > 8 {
			t.Errorf("stream=%v: %d requests used %d connections, want about 3", stream, rep.Total.Completed, n)
		}
	}
}

func TestNonStreamingMeasuresE2EAndUsage(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	f.ttft = 30 * time.Millisecond
	f.cachedPct = 50
	cfg := baseConfig(f.url)
	cfg.NoStream = true
	cfg.Workload.Input = Fixed(10)
	rep := mustRun(t, context.Background(), cfg)
	tot := rep.Total
	if tot.Completed != 10 || tot.E2E.Count != 10 || tot.TTFT.Count != 0 || tot.ITL.Count != 0 {
		t.Fatalf("completed %d e2e %d ttft %d itl %d; want 10 requests with only e2e", tot.Completed, tot.E2E.Count, tot.TTFT.Count, tot.ITL.Count)
	}
	if tot.E2E.Min < 30*time.Millisecond || tot.OutputTokens != 40 || tot.PrefixCacheHitRate != 0.5 {
		t.Errorf("e2e min %v, output %d, hit rate %v", tot.E2E.Min, tot.OutputTokens, tot.PrefixCacheHitRate)
	}
	for _, b := range f.recorded() {
		if bytes.Contains(b, []byte("stream_options")) || !bytes.Contains(b, []byte(`"stream":false`)) {
			t.Fatalf("non-streaming body %s", b)
		}
	}
}

// Constant arrivals are scheduled at k/rate from the stage start, so the
// count is exact however slow the machine is.
func TestConstantArrivalCountAndStages(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	cfg := baseConfig(f.url)
	cfg.Stages = []Stage{{Rate: 20, Duration: 500 * time.Millisecond}, {Rate: 0, Duration: 200 * time.Millisecond}, {Rate: 60, Duration: 500 * time.Millisecond}}
	rep := mustRun(t, context.Background(), cfg)
	want := []int64{10, 0, 30}
	for i, s := range rep.Stages {
		if s.Sent != want[i] || s.Completed != want[i] {
			t.Errorf("stage %d: sent %d completed %d, want %d", i, s.Sent, s.Completed, want[i])
		}
	}
	if rep.Total.Sent != 40 || f.n.Load() != 40 {
		t.Errorf("total sent %d, server saw %d, want 40", rep.Total.Sent, f.n.Load())
	}
	if rep.Elapsed < 1200*time.Millisecond {
		t.Errorf("run took %v, stages last 1.2s", rep.Elapsed)
	}
}

func TestPoissonArrivalCountIsSeededAndNearRate(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	cfg := baseConfig(f.url)
	cfg.Arrival = ArrivalPoisson
	cfg.Stages = []Stage{{Rate: 200, Duration: 500 * time.Millisecond}}
	first := mustRun(t, context.Background(), cfg).Total.Sent
	second := mustRun(t, context.Background(), cfg).Total.Sent
	if first != second {
		t.Errorf("same seed gave %d then %d arrivals", first, second)
	}
	// 100 expected; a Poisson count has sd 10, so 60..140 is a 4-sigma band.
	if first < 60 || first > 140 {
		t.Errorf("poisson sent %d in 0.5s at 200/s", first)
	}
	cfg.Seed = 8
	if other := mustRun(t, context.Background(), cfg).Total.Sent; other < 60 || other > 140 {
		t.Errorf("seed 8: poisson sent %d in 0.5s at 200/s", other)
	}
}

func TestConcurrencyStages(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	f.ttft = 100 * time.Millisecond // long enough that stage 1's workers overlap on a starved CPU
	type arrival struct {
		at       time.Time
		inflight int64
	}
	var mu sync.Mutex
	var arrivals []arrival
	f.onRequest = func(int64) {
		mu.Lock()
		arrivals = append(arrivals, arrival{time.Now(), f.inflight.Load()})
		mu.Unlock()
	}
	cfg := baseConfig(f.url)
	cfg.Arrival = ArrivalConcurrency
	cfg.Stages = []Stage{{Concurrency: 1, Duration: 400 * time.Millisecond}, {Concurrency: 4, Duration: 400 * time.Millisecond}}
	rep := mustRun(t, context.Background(), cfg)
	s0, s1 := rep.Stages[0], rep.Stages[1]
	if s0.Sent == 0 || s1.Sent == 0 {
		t.Errorf("stage sends %d then %d", s0.Sent, s1.Sent)
	}
	// Stage 1 starts no earlier than 400ms after Start, so whatever the
	// server held before then was sent in stage 0.
	mu.Lock()
	defer mu.Unlock()
	stage0 := 0
	for _, a := range arrivals {
		if a.at.Before(rep.Start.Add(400 * time.Millisecond)) {
			stage0++
			if a.inflight != 1 {
				t.Errorf("stage 0 (concurrency 1) had %d requests in flight", a.inflight)
			}
		}
	}
	if stage0 == 0 {
		t.Error("no request arrived during stage 0")
	}
	if m := f.maxInfl.Load(); m > 4 || m < 2 {
		t.Errorf("max in flight %d, want 2..4 with stage concurrency 4", m)
	}
	if rep.Total.Sent != s0.Sent+s1.Sent || rep.Total.Completed != rep.Total.Sent {
		t.Errorf("total %+v does not add up", rep.Total)
	}
}

// Open-loop arrivals are never throttled by slow responses: past the
// in-flight cap they are dropped and counted, and the drain timeout
// cancels what is still running.
func TestMaxInFlightDropsAndDrainCancels(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	f.block = true
	cfg := baseConfig(f.url)
	cfg.Stages = []Stage{{Rate: 100, Duration: 500 * time.Millisecond}}
	cfg.MaxInFlight = 5
	cfg.DrainTimeout = 200 * time.Millisecond
	rep := mustRun(t, context.Background(), cfg)
	tot := rep.Total
	if tot.Sent != 5 || tot.Dropped != 45 || tot.Cancelled != 5 || tot.Failed != 0 {
		t.Errorf("sent %d dropped %d cancelled %d failed %d; want 5, 45, 5, 0", tot.Sent, tot.Dropped, tot.Cancelled, tot.Failed)
	}
	if rep.Interrupted {
		t.Error("a drain timeout is not an interruption")
	}
}

func TestCancelReturnsPartialReport(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	f.block = true
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f.onRequest = func(n int64) {
		if n == 3 {
			cancel()
		}
	}
	cfg := baseConfig(f.url)
	cfg.Stages = []Stage{{Rate: 50, Duration: time.Minute}}
	rep := mustRun(t, ctx, cfg)
	if !rep.Interrupted || rep.Total.Sent < 3 || rep.Total.Cancelled != rep.Total.Sent {
		t.Errorf("interrupted %v sent %d cancelled %d", rep.Interrupted, rep.Total.Sent, rep.Total.Cancelled)
	}
	if rep.Elapsed > 30*time.Second {
		t.Errorf("cancelled run took %v", rep.Elapsed)
	}
}

func TestErrorKinds(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc  string
		setup func(f *fakeServer, cfg *Config)
		kind  string
	}{
		{"error event", func(f *fakeServer, _ *Config) { f.errEvent = true }, ErrStream},
		{"no [DONE]", func(f *fakeServer, _ *Config) { f.noDone = true }, ErrStream},
		{"timeout", func(f *fakeServer, cfg *Config) { f.block = true; cfg.Timeout = 100 * time.Millisecond }, ErrTimeout},
		{"refused", func(f *fakeServer, cfg *Config) { cfg.URL = "http://127.0.0.1:1" }, ErrTransport},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			f := newFakeServer(t)
			cfg := baseConfig(f.url)
			cfg.Stages = []Stage{{Rate: 20, Duration: 250 * time.Millisecond}}
			tc.setup(f, &cfg)
			tot := mustRun(t, context.Background(), cfg).Total
			if tot.Sent != 5 || tot.Failed != 5 || tot.Errors[tc.kind] != 5 || tot.Completed != 0 {
				t.Errorf("sent %d failed %d errors %v completed %d; want 5 %s", tot.Sent, tot.Failed, tot.Errors, tot.Completed, tc.kind)
			}
			if tot.ErrorExamples[tc.kind] == "" {
				t.Errorf("no example message for %s", tc.kind)
			}
		})
	}
}

func TestHeadersAndLoRASplitOnTheWire(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	cfg := baseConfig(f.url)
	cfg.Headers = map[string][]string{"X-Tenant": {"blue"}, "Authorization": {"Bearer secret"}}
	cfg.LoRA = []LoRASplit{{Adapter: "sql-lora", Fraction: 0.5}}
	cfg.Stages = []Stage{{Rate: 100, Duration: 400 * time.Millisecond}}
	rep := mustRun(t, context.Background(), cfg)
	seen := map[string]int64{}
	for _, b := range f.recorded() {
		var r fakeReq
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		seen[r.Model]++
	}
	if seen["sql-lora"] != rep.Total.Models["sql-lora"] || seen["base"] != rep.Total.Models["base"] || seen["sql-lora"] == 0 || seen["base"] == 0 {
		t.Errorf("server saw models %v, report %v", seen, rep.Total.Models)
	}
	for _, h := range f.headers {
		if h.Get("X-Tenant") != "blue" || h.Get("Content-Type") != "application/json" {
			t.Fatalf("headers %v", h)
		}
	}
	var out bytes.Buffer
	if err := rep.WriteJSON(&out); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "secret") {
		t.Error("JSON report leaks the Authorization header")
	}
}

// Multi-turn through Run: each turn carries the session header and the
// previous answers the server streamed; with one worker and a
// deterministic server the whole request sequence is reproducible.
func TestMultiTurnRunIsReproducibleAndCarriesAnswers(t *testing.T) {
	t.Parallel()
	run := func() [][]byte {
		f := newFakeServer(t)
		cfg := baseConfig(f.url)
		cfg.API = APIChat
		cfg.Workload = Workload{Kind: WorkloadMultiTurn, Sessions: 2, Turns: 3, QuestionLen: 5, SystemLen: 3, Output: Fixed(2)}
		cfg.Arrival = ArrivalConcurrency
		cfg.Stages = []Stage{{Concurrency: 1, Duration: 300 * time.Millisecond}}
		rep := mustRun(t, context.Background(), cfg)
		if rep.Total.Completed < 4 {
			t.Fatalf("only %d requests completed", rep.Total.Completed)
		}
		for i, h := range f.headers {
			if !strings.HasPrefix(h.Get(DefaultSessionHeader), "sess-") {
				t.Fatalf("request %d has no session header: %v", i, h)
			}
		}
		// Sessions alternate (round robin): request 2 is session 0's turn 2.
		var r fakeReq
		if err := json.Unmarshal(f.recorded()[2], &r); err != nil {
			t.Fatal(err)
		}
		if len(r.Messages) != 4 || r.Messages[2].Role != "assistant" || r.Messages[2].Content != "axyz bxyz " {
			t.Errorf("turn 2 messages %+v: want system, user, the streamed answer, user", r.Messages)
		}
		if f.headers[0].Get(DefaultSessionHeader) != f.headers[2].Get(DefaultSessionHeader) ||
			f.headers[0].Get(DefaultSessionHeader) == f.headers[1].Get(DefaultSessionHeader) {
			t.Error("session ids do not follow the sessions")
		}
		return f.recorded()
	}
	a, b := run(), run()
	n := min(len(a), len(b))
	for i := range n {
		if !bytes.Equal(a[i], b[i]) {
			t.Fatalf("request %d differs between runs with the same seed:\n%s\n%s", i, a[i], b[i])
		}
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	cfg := baseConfig("ftp://x")
	cfg.Model = ""
	cfg.Stages = nil
	_, err := Run(context.Background(), cfg)
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"url", "model", "stages"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
}

func TestWriteText(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t)
	f.servers = []string{"a:1", "b:2"}
	f.failEvery = 5
	cfg := baseConfig(f.url)
	cfg.Stages = []Stage{{Rate: 20, Duration: 250 * time.Millisecond}, {Rate: 40, Duration: 250 * time.Millisecond}}
	rep := mustRun(t, context.Background(), cfg)
	var out bytes.Buffer
	if err := rep.WriteText(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"latency, stage 0", "latency, stage 1", "latency, total", "TTFT", "TPOT", "ITL", "E2E", "http 503", "a:1", "b:2", "20/s 250ms", "total"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("text report lacks %q:\n%s", want, out.String())
		}
	}
}

// Several URLs are used in turn: the round-robin baseline against model
// servers directly.
func TestSeveralURLsRoundRobin(t *testing.T) {
	a, b, c := newFakeServer(t), newFakeServer(t), newFakeServer(t)
	cfg := baseConfig(a.url + "," + b.url + ", " + c.url)
	cfg.Arrival = ArrivalConcurrency
	cfg.Stages = []Stage{{Concurrency: 1, Duration: 300 * time.Millisecond}}
	rep := mustRun(t, context.Background(), cfg)
	na, nb, nc := a.n.Load(), b.n.Load(), c.n.Load()
	if rep.Total.Sent != na+nb+nc || rep.Total.Sent < 6 {
		t.Fatalf("sent %d; servers saw %d, %d, %d", rep.Total.Sent, na, nb, nc)
	}
	// One at a time, in turn: the counts differ by at most one.
	if max(na, nb, nc)-min(na, nb, nc) > 1 {
		t.Errorf("servers saw %d, %d, %d requests: not round-robin", na, nb, nc)
	}
}
