package sched

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/registry"
)

// perfEp is an endpoint with a fresh scrape carrying perf figures.
func perfEp(addr string, v metrics.Values, p metrics.Perf) *Endpoint {
	s := &metrics.Snapshot{Values: v, Perf: p, MaxAge: time.Second, LastSuccess: now.Add(-10 * time.Millisecond)}
	return &Endpoint{Pool: "p", Address: addr, Load: new(Load), Metrics: fixedSource{s}}
}

func near(t *testing.T, what string, got, want time.Duration, tol time.Duration) {
	t.Helper()
	if d := got - want; d < -tol || d > tol {
		t.Errorf("%s = %v, want %v ± %v", what, got, want, tol)
	}
}

// The prediction's parts come from the endpoint's page: prefill per token,
// the fixed part (server TTFT minus queue and prefill); the slot limit is
// the batch the scrapes taught (Load.MarkScrape).
func TestPredictFromScrapedPerf(t *testing.T) {
	t.Parallel()
	perf := metrics.Perf{TTFT: 0.080, Queue: 0.010, PrefillTokens: 1000, PrefillPerToken: 50e-6, Inference: 2, Requests: 100}
	req := &Request{Tokens: 3000, BlockTokens: 16, Now: now}

	idle := perfEp("idle", metrics.Values{Running: 1}, perf)
	p := predict(req, idle, 0, loraNone, nil, nil)
	near(t, "base", p.Base, 20*time.Millisecond, time.Microsecond) // 80 - 10 - 50µs*1000
	near(t, "prefill", p.Prefill, 150*time.Millisecond, time.Microsecond)
	if p.Wait != 0 || p.Uncached != 3000 || p.Total != p.Base+p.Prefill {
		t.Errorf("idle endpoint: %+v", p)
	}

	// 125 of the prompt's blocks (2,000 tokens) cached: 1,000 to compute.
	if p := predict(req, idle, 125*16, loraNone, nil, nil); p.Uncached != 1000 {
		t.Errorf("uncached %d, want 1000", p.Uncached)
	} else {
		near(t, "prefill with a cache hit", p.Prefill, 50*time.Millisecond, time.Microsecond)
	}

	// 4,000 tokens of prefill queued ahead, taking 200 ms: all of it to
	// wait now, what is left of it later, nothing once it is done.
	busy := perfEp("busy", metrics.Values{Running: 2}, perf)
	busy.Load.StartPrefill(4000, 200*time.Millisecond, now)
	if p := predict(req, busy, 0, loraNone, nil, nil); p.Ahead != 4000 {
		t.Errorf("ahead %d tokens, want 4000", p.Ahead)
	}
	near(t, "wait behind prefill", predict(req, busy, 0, loraNone, nil, nil).Wait, 200*time.Millisecond, time.Microsecond)
	later := *req
	later.Now = now.Add(150 * time.Millisecond)
	near(t, "wait 150 ms later", predict(&later, busy, 0, loraNone, nil, nil).Wait, 50*time.Millisecond, time.Microsecond)
	busy.Load.StartPrefill(2000, 100*time.Millisecond, later.Now) // queues behind
	near(t, "wait behind both", predict(&later, busy, 0, loraNone, nil, nil).Wait, 150*time.Millisecond, time.Microsecond)
	busy.Load.EndPrefill(4000)
	busy.Load.EndPrefill(2000)
	if p := predict(&later, busy, 0, loraNone, nil, nil); p.Wait != 0 {
		t.Errorf("wait %v with no prefill counted", p.Wait)
	}

	// At its slot limit (4 running, 2 waiting at the scrape, which taught
	// the batch of 4; one more sent since): fourth in line for one of 4
	// slots, each freeing every 2 s/4.
	full := perfEp("full", metrics.Values{Running: 4, Waiting: 2}, perf)
	full.Load.InFlightRequests.Store(6)
	full.Load.MarkScrape(full.Metrics.Load())
	full.Load.InFlightRequests.Store(7)
	p = predict(req, full, 0, loraNone, nil, nil)
	near(t, "slot wait", p.SlotWait, 2*time.Second, time.Microsecond)
	if p.Wait != p.SlotWait {
		t.Errorf("wait %v, want the slot wait %v", p.Wait, p.SlotWait)
	}

	// KV full: 3 running with a queue teach a batch of 3, whatever
	// max-num-seqs is.
	kvFull := perfEp("kv", metrics.Values{Running: 3, Waiting: 1, KVUsage: 0.99}, perf)
	kvFull.Load.InFlightRequests.Store(4)
	kvFull.Load.MarkScrape(kvFull.Metrics.Load())
	near(t, "slot wait with the KV cache full", predict(req, kvFull, 0, loraNone, nil, nil).SlotWait, 2*time.Second*2/3, time.Microsecond)

	// A prompt that does not fit in the free KV blocks waits for running
	// requests to free them: 2,000 tokens are 125 blocks of 16, 62.5 more
	// than the free 62.5 of 1,000; the 937.5 used ones come free over a
	// 2 s hold, so 62.5 of them in 2 s / 15.
	kv := perfEp("kv-room", metrics.Values{Running: 2, KVUsage: 0.9375, NumBlocks: 1000, BlockSize: 16}, perf)
	near(t, "KV wait", predict(&Request{Tokens: 2000, BlockTokens: 16, Now: now}, kv, 0, loraNone, nil, nil).SlotWait,
		2*time.Second/15, time.Microsecond)
	if p := predict(&Request{Tokens: 800, BlockTokens: 16, Now: now}, kv, 0, loraNone, nil, nil); p.SlotWait != 0 {
		t.Errorf("a prompt that fits waits %v", p.SlotWait)
	}

	// An adapter to load, or a slot to wait for.
	if p := predict(req, idle, 0, loraLoad, nil, nil); p.LoRA != DefaultLoRALoad {
		t.Errorf("adapter load %v, want the cold-start %v", p.LoRA, DefaultLoRALoad)
	}
	near(t, "adapter slot wait", predict(req, idle, 0, loraWaitSlot, nil, nil).LoRA, 2*time.Second, time.Microsecond)
}

// Without a page or observations, the cold-start values apply, and
// requests the picker has in flight beyond DefaultMaxNumSeqs wait.
func TestPredictColdStart(t *testing.T) {
	t.Parallel()
	e := &Endpoint{Pool: "p", Address: "a", Load: new(Load)}
	req := &Request{Tokens: 1000, Now: now}
	p := predict(req, e, 0, loraNone, nil, nil)
	if p.Base != DefaultTTFTBase || p.Prefill != 1000*DefaultPrefillPerToken || p.SlotWait != 0 {
		t.Fatalf("cold start: %+v", p)
	}
	e.Load.InFlightRequests.Store(DefaultMaxNumSeqs)
	near(t, "slot wait past the default limit", predict(req, e, 0, loraNone, nil, nil).SlotWait, DefaultHold/DefaultMaxNumSeqs, time.Microsecond)
}

// Observed TTFTs teach the endpoint its own fixed and per-token costs,
// whatever the page says: the fit converges on the truth.
func TestTTFTLearnsFromObservations(t *testing.T) {
	t.Parallel()
	// The page claims 50 µs a token and a 5 ms fixed part; the truth is
	// 100 µs and 40 ms (the tokenizer estimate, the network in between).
	e := perfEp("a", metrics.Values{}, metrics.Perf{TTFT: 0.055, PrefillTokens: 1000, PrefillPerToken: 50e-6, Requests: 10})
	rng := rand.New(rand.NewPCG(1, 2))
	truth := func(x int64) time.Duration { return 40*time.Millisecond + time.Duration(x)*100*time.Microsecond }
	for range 400 {
		req := &Request{Tokens: 100 + rng.Int64N(4000), Now: now}
		p := predict(req, e, 0, loraNone, nil, nil)
		noise := time.Duration(rng.NormFloat64() * float64(2*time.Millisecond))
		e.Load.ObserveTTFT(Observation{Predicted: p, TTFT: truth(p.Uncached+p.Ahead) + noise, At: now})
	}
	m := e.TTFTModel(now)
	near(t, "learned base", m.Base, 40*time.Millisecond, 2*time.Millisecond)
	near(t, "learned per 1k tokens", m.PerToken, 100*time.Millisecond, 3*time.Millisecond)
	req := &Request{Tokens: 2000, Now: now}
	near(t, "prediction", predict(req, e, 0, loraNone, nil, nil).Total, truth(2000), 5*time.Millisecond)
	if m.Compared != 400 || m.MeanAbs <= 0 {
		t.Errorf("error accounting: %+v", m)
	}
}

// With observations that all compute the same number of tokens, the
// per-token cost stays with the prior and the fixed part takes the rest.
func TestTTFTWithoutSpreadKeepsPriorSlope(t *testing.T) {
	t.Parallel()
	e := perfEp("a", metrics.Values{}, metrics.Perf{TTFT: 0.03, PrefillTokens: 500, PrefillPerToken: 40e-6, Requests: 10})
	for range 200 {
		p := predict(&Request{Tokens: 500, Now: now}, e, 0, loraNone, nil, nil)
		e.Load.ObserveTTFT(Observation{Predicted: p, TTFT: 70 * time.Millisecond, At: now})
	}
	m := e.TTFTModel(now)
	near(t, "per 1k tokens", m.PerToken, 40*time.Millisecond, 2*time.Millisecond)
	near(t, "prediction at the observed size", predict(&Request{Tokens: 500, Now: now}, e, 0, loraNone, nil, nil).Total, 70*time.Millisecond, 2*time.Millisecond)
}

// Adapter loads are learned from requests predicted to load one; slot
// waits do not feed the prefill fit.
func TestTTFTLearnsLoRALoad(t *testing.T) {
	t.Parallel()
	e := perfEp("a", metrics.Values{}, metrics.Perf{TTFT: 0.03, PrefillTokens: 500, PrefillPerToken: 40e-6, Requests: 10})
	before := e.TTFTModel(now)
	for range 50 {
		p := predict(&Request{Tokens: 500, Now: now}, e, 0, loraLoad, nil, nil)
		e.Load.ObserveTTFT(Observation{Predicted: p, TTFT: p.Total - p.LoRA + 300*time.Millisecond, At: now})
	}
	m := e.TTFTModel(now)
	near(t, "adapter load", m.LoRALoad, 300*time.Millisecond, 10*time.Millisecond)
	if m.Base != before.Base || m.Observed != 0 {
		t.Errorf("adapter observations moved the prefill fit: %+v, before %+v", m, before)
	}
}

// The scorer ranks by predicted TTFT: a cache hit on a server with a
// little prefill ahead beats a miss on an idle one, but not one with a
// long queue of prefill ahead; the scratch keeps every prediction.
func TestTTFTScorerRanksByPrediction(t *testing.T) {
	t.Parallel()
	idx := prefix.NewIndex(prefix.Config{})
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 16})
	prompt := strings.Repeat("shared system prompt words ", 400) // ~2,700 tokens
	hashes := h.Hash(nil, "m", prompt)
	perf := metrics.Perf{TTFT: 0.03, PrefillTokens: 500, PrefillPerToken: 40e-6, Inference: 1, Requests: 100}
	holder := perfEp("holder", metrics.Values{Running: 3}, perf)
	idle := perfEp("idle", metrics.Values{}, perf)
	idx.Add("holder", hashes)
	req := Request{Tokens: int64(len(prompt)) / 4, Hashes: hashes, BlockTokens: 16, Now: now, Explain: true}
	prof := &Profile{Name: "t", Scorers: []weightedScorer{{Scorer: &TTFTScorer{Index: idx}, Weight: 1}}, Picker: maxScore{}}
	sc := new(Scratch)

	holder.Load.StartPrefill(500, 20*time.Millisecond, now)
	got := prof.Rank(&req, []*Endpoint{idle, holder}, 2, sc)
	if got[0] != holder {
		t.Fatalf("picked %s first; want the prefix holder (%s)", got[0].Address, sc.Explanation)
	}
	ph, _ := sc.Prediction("holder")
	pi, _ := sc.Prediction("idle")
	if ph.Uncached >= pi.Uncached || ph.Queued != 20*time.Millisecond || ph.Total >= pi.Total {
		t.Fatalf("holder %v, idle %v", ph, pi)
	}
	if !strings.Contains(sc.Explanation, "holder") || !strings.Contains(sc.Explanation, "ttft=") || !strings.Contains(sc.Explanation, "wait") {
		t.Errorf("explanation lacks the predictions: %s", sc.Explanation)
	}

	holder.Load.StartPrefill(20000, 800*time.Millisecond, now) // 800 ms more of prefill queued
	if got := prof.Rank(&req, []*Endpoint{holder, idle}, 2, sc); got[0] != idle {
		t.Fatalf("picked %s; want the idle server over a long prefill queue (%s)", got[0].Address, sc.Explanation)
	}
}

// The predicted-ttft profile builds with the TTFT scorer, the LoRA-slot
// filter, and exposes its predictor; other profiles have none.
func TestPredictedTTFTProfile(t *testing.T) {
	t.Parallel()
	idx := prefix.NewIndex(prefix.Config{})
	p, err := BuildProfile(&registry.Scheduling{Profile: ProfilePredictedTTFT}, Deps{Prefix: idx})
	if err != nil {
		t.Fatal(err)
	}
	if p.Predictor() == nil || !p.Uses(ScorerTTFT) || p.Uses(ScorerPrefix) {
		t.Fatalf("profile %+v", p)
	}
	hasLoRA := false
	for _, f := range p.Filters {
		hasLoRA = hasLoRA || f.Name() == FilterLoRASlot
	}
	if !hasLoRA {
		t.Error("no LoRA-slot filter")
	}
	w, _ := BuildProfile(&registry.Scheduling{Profile: ProfileWeighted}, Deps{Prefix: idx})
	if w.Predictor() != nil {
		t.Error("weighted has a predictor")
	}
	d, _ := BuildProfile(nil, Deps{Prefix: idx})
	if d.Predictor() != nil {
		t.Error("the weighted default has a predictor")
	}
	c, _ := BuildProfile(&registry.Scheduling{Profile: ProfileCacheAware}, Deps{Prefix: idx})
	if c.Predictor() == nil || !c.Predictor().EvictionCost || !c.Predictor().Shrink {
		t.Error("cache-aware's TTFT scorer does not price eviction and shrink rates")
	}
	if p.Predictor().EvictionCost || p.Predictor().Shrink {
		t.Error("predicted-ttft prices eviction")
	}
}

// With nothing to tell the servers apart (no metrics, prompts too short
// to predict apart), predicted-ttft spreads by requests in flight, and a
// session stays on its server unless that is predicted much slower.
func TestPredictedTTFTTieBreakAndSessions(t *testing.T) {
	t.Parallel()
	deps := Deps{Prefix: prefix.NewIndex(prefix.Config{}), Sessions: NewSessions(0, 0)}
	p, err := BuildProfile(&registry.Scheduling{Profile: ProfilePredictedTTFT}, deps)
	if err != nil {
		t.Fatal(err)
	}
	eps := mkEps(m{none: true, inflight: 2}, m{none: true, inflight: 1}, m{none: true, inflight: 3})
	c := eps[2] // Rank reorders eps
	sc := new(Scratch)
	req := &Request{Model: "m", TargetModel: "m", Now: now, Tokens: 4}
	if got := p.Rank(req, eps, 3, sc); got[0].Address != "b" || got[1].Address != "a" || got[2].Address != "c" {
		t.Errorf("order %s %s %s, want b a c (fewest in flight first)", got[0].Address, got[1].Address, got[2].Address)
	}

	deps.Sessions.Put("s1", "c", now)
	req = &Request{Model: "m", TargetModel: "m", Now: now, Tokens: 4, Session: "s1", Explain: true}
	if got := p.Rank(req, eps, 3, sc); got[0].Address != "c" {
		t.Errorf("session request went to %s, want its server c", got[0].Address)
	}
	// Its server now has a long prefill queue: the session moves.
	c.Load.StartPrefill(20000, time.Second, now)
	if got := p.Rank(req, eps, 3, sc); got[0].Address == "c" {
		t.Errorf("session request stayed on c behind a second of prefill (%s)", sc.Explanation)
	}
}

func TestSolveDegenerate(t *testing.T) {
	t.Parallel()
	pr := ttftPrior{base: 0.02, perToken: 5e-5}
	var nilStats *ttftStats
	if b, k := nilStats.solve(pr); b != pr.base || k != pr.perToken {
		t.Fatalf("no stats: %g %g", b, k)
	}
	// Observations that shrink with size: no negative per-token cost.
	var st ttftStats
	for i := range 100 {
		x := float64(100 + 40*i)
		st.observe(x, 0.5-x*1e-4)
	}
	b, k := st.solve(pr)
	if k < minPerToken || b < 0 || math.IsNaN(b) {
		t.Fatalf("base %g per token %g", b, k)
	}
}

// The per-token part stays within a band around the page's figure, and
// requests that met a queue or prefill ahead do not teach the fit.
func TestTTFTFitBoundsAndQuietObservations(t *testing.T) {
	t.Parallel()
	perf := metrics.Perf{TTFT: 0.03, PrefillTokens: 1000, PrefillPerToken: 20e-6, Requests: 10}
	e := perfEp("a", metrics.Values{}, perf)
	rng := rand.New(rand.NewPCG(3, 4))
	for range 300 {
		p := predict(&Request{Tokens: 100 + rng.Int64N(4000), Now: now}, e, 0, loraNone, nil, nil)
		e.Load.ObserveTTFT(Observation{Predicted: p, TTFT: time.Duration(p.Uncached) * 200 * time.Microsecond, At: now})
	}
	near(t, "per 1k tokens, capped", e.TTFTModel(now).PerToken, pageBand*20*time.Millisecond, time.Millisecond)

	q := perfEp("q", metrics.Values{Waiting: 3}, perf)
	for range 50 {
		p := predict(&Request{Tokens: 1000, Now: now}, q, 0, loraNone, nil, nil)
		q.Load.ObserveTTFT(Observation{Predicted: p, TTFT: 2 * time.Second, At: now})
	}
	if m := q.TTFTModel(now); m.Observed != 0 {
		t.Fatalf("observations behind a queue taught the fit: %+v", m)
	}
}

// A server nothing is known about yet is predicted like its measured
// peers, not by the cold-start values: otherwise a new server next to
// fast measured ones would look slower for good, and never be picked (so
// never measured).
func TestUnmeasuredServerTakesThePoolsPrior(t *testing.T) {
	t.Parallel()
	perf := metrics.Perf{TTFT: 0.004, PrefillTokens: 100, PrefillPerToken: 10e-6, Inference: 0.5, Requests: 50}
	old1 := perfEp("old1", metrics.Values{Running: 2}, perf)
	old2 := perfEp("old2", metrics.Values{Running: 2}, perf)
	fresh := perfEp("new", metrics.Values{}, metrics.Perf{})
	eps := []*Endpoint{old1, old2, fresh}
	req := &Request{Tokens: 300, Now: now}
	var preds []Prediction
	for _, e := range eps {
		preds = append(preds, predict(req, e, 0, loraNone, nil, nil))
	}
	pool, ok := poolPrior(preds)
	if !ok {
		t.Fatal("no pool prior with two measured servers")
	}
	pm, pn := predict(req, old1, 0, loraNone, &pool, nil), predict(req, fresh, 0, loraNone, &pool, nil)
	near(t, "new server's prediction", pn.Total, pm.Total, time.Microsecond)
	if cold := predict(req, fresh, 0, loraNone, nil, nil); cold.Total <= 2*pm.Total {
		t.Fatalf("cold-start prediction %v should be far above the measured %v for this test to mean anything", cold.Total, pm.Total)
	}
	prof, err := BuildProfile(&registry.Scheduling{Profile: ProfilePredictedTTFT}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	old1.Load.InFlightRequests.Store(1)
	old2.Load.InFlightRequests.Store(1)
	if got := prof.Rank(req, eps, 3, new(Scratch)); got[0] != fresh {
		t.Errorf("picked %s; want the new, idle server", got[0].Address)
	}
	if _, ok := poolPrior(preds[2:]); ok {
		t.Error("a pool prior with no measured server")
	}
}

// cache-aware prices eviction: a request for a prefix whose holder is a
// little busy stays there rather than evict, on a full idle server, the
// only copy of another prefix in use; with room on the idle server, or
// when the other prefix is cached elsewhere too, it moves. predicted-ttft
// moves in every case.
func TestCacheAwarePricesEviction(t *testing.T) {
	t.Parallel()
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 16})
	mine := h.Hash(nil, "m", strings.Repeat("mine ", 1600))    // 125 blocks, 2,000 tokens
	theirs := h.Hash(nil, "m", strings.Repeat("their ", 1400)) // 131 blocks
	perf := metrics.Perf{TTFT: 0.03, PrefillTokens: 500, PrefillPerToken: 40e-6, Inference: 1, Requests: 100}
	setup := func(idleBlocks int, shared bool) (*Profile, *Profile, []*Endpoint) {
		idx := prefix.NewIndex(prefix.Config{})
		holder := perfEp("holder", metrics.Values{Running: 3}, perf)
		idle := perfEp("idle", metrics.Values{}, perf)
		idx.SetCapacity("idle", idleBlocks)
		idx.Add("holder", mine)
		idx.Add("idle", theirs)
		idx.Add("idle", theirs) // in use: reused
		if shared {
			idx.Add("third", theirs)
		}
		holder.Load.StartPrefill(2000, 100*time.Millisecond, now) // 100 ms of prefill ahead on the holder
		aware, err := BuildProfile(&registry.Scheduling{Profile: ProfileCacheAware}, Deps{Prefix: idx})
		if err != nil {
			t.Fatal(err)
		}
		plain, err := BuildProfile(&registry.Scheduling{Profile: ProfilePredictedTTFT}, Deps{Prefix: idx})
		if err != nil {
			t.Fatal(err)
		}
		return aware, plain, []*Endpoint{idle, holder}
	}
	req := func() *Request {
		return &Request{Model: "m", TargetModel: "m", Tokens: 2000, Hashes: mine, BlockTokens: 16, Now: now, Explain: true}
	}
	for _, c := range []struct {
		name       string
		idleBlocks int
		shared     bool
		want       string
	}{
		{"full, the only copy", 200, false, "holder"},
		{"room for both", 1000, false, "idle"},
		{"full, copied elsewhere", 200, true, "idle"},
	} {
		aware, plain, eps := setup(c.idleBlocks, c.shared)
		sc := new(Scratch)
		if got := plain.Rank(req(), slices.Clone(eps), 2, sc); got[0].Address != "idle" {
			t.Fatalf("%s: predicted-ttft picked %s; the test needs the idle server to win on TTFT (%s)", c.name, got[0].Address, sc.Explanation)
		}
		if got := aware.Rank(req(), slices.Clone(eps), 2, sc); got[0].Address != c.want {
			t.Errorf("%s: cache-aware picked %s, want %s (%s)", c.name, got[0].Address, c.want, sc.Explanation)
		}
		p, _ := sc.Prediction("idle")
		if c.want == "holder" && (p.Lost == 0 || p.Eviction == 0 || !strings.Contains(sc.Explanation, "the only copy")) {
			t.Errorf("%s: idle prediction %v, explanation %s", c.name, p, sc.Explanation)
		}
	}
}

// teachTTFT has e observe n TTFTs of base plus per a token, for prompts
// of 500 to 2,400 tokens.
func teachTTFT(e *Endpoint, base, per time.Duration, n int) {
	for i := range n {
		tokens := int64(500 + 100*(i%20))
		p := predict(&Request{Tokens: tokens, Now: now}, e, 0, loraNone, nil, nil)
		e.Load.ObserveTTFT(Observation{Predicted: p, TTFT: base + time.Duration(tokens)*per, At: now})
	}
}

// cache-aware pulls learned per-token rates towards the pool's: two
// identical servers whose fits differ by noise (2x) are predicted almost
// alike, so misses do not all go to the one that looks faster.
func TestCacheAwareShrinksNoisyRates(t *testing.T) {
	t.Parallel()
	perf := metrics.Perf{TTFT: 0.03, PrefillTokens: 500, PrefillPerToken: 40e-6, Inference: 1, Requests: 100}
	fast := perfEp("fast", metrics.Values{}, perf)
	slow := perfEp("slow", metrics.Values{}, perf)
	teachTTFT(fast, 20*time.Millisecond, 30*time.Microsecond, 16)
	teachTTFT(slow, 20*time.Millisecond, 60*time.Microsecond, 16)
	req := &Request{Tokens: 2000, Now: now}
	eps := []*Endpoint{fast, slow}
	raw := predict(req, slow, 0, loraNone, nil, nil).Prefill.Seconds() / predict(req, fast, 0, loraNone, nil, nil).Prefill.Seconds()
	fit, ok := poolFit(now, eps)
	if !ok {
		t.Fatal("no pool fit")
	}
	shrunk := predict(req, slow, 0, loraNone, nil, &fit).Prefill.Seconds() / predict(req, fast, 0, loraNone, nil, &fit).Prefill.Seconds()
	t.Logf("prefill slow/fast after 16 observations each: %.2f learned, %.2f shrunk", raw, shrunk)
	if raw < 1.5 || math.Log(shrunk) > math.Log(raw)/2 {
		t.Errorf("prefill slow/fast: %.2f learned, %.2f shrunk; want the learned gap (>1.5) more than halved (log) after 16 observations", raw, shrunk)
	}
	// Many observations keep most of a real difference.
	teachTTFT(fast, 20*time.Millisecond, 30*time.Microsecond, 400)
	teachTTFT(slow, 20*time.Millisecond, 60*time.Microsecond, 400)
	fit, _ = poolFit(now, eps)
	kept := predict(req, slow, 0, loraNone, nil, &fit).Prefill.Seconds() / predict(req, fast, 0, loraNone, nil, &fit).Prefill.Seconds()
	t.Logf("after 400 more: %.2f", kept)
	if kept < 1.6 {
		t.Errorf("after a full window of observations: %.2f, want most of the 2x difference kept", kept)
	}
}

// The pool's fit weighs each server by the observations behind it: a
// server seen once, on a slow cold request, is predicted like its
// well-observed peer (shrunk towards a pool fit that is mostly the
// peer's), not kept looking slower by its own one observation; the
// unweighted mean left their bases ~15 % apart, which on two idle real
// vLLM servers sent nearly everything to the peer.
func TestPoolFitWeighsObservations(t *testing.T) {
	t.Parallel()
	perf := metrics.Perf{TTFT: 0.02, PrefillTokens: 500, PrefillPerToken: 40e-6, Inference: 1, Requests: 100}
	seen := perfEp("seen", metrics.Values{}, perf)
	once := perfEp("once", metrics.Values{}, perf)
	teachTTFT(seen, 10*time.Millisecond, 40*time.Microsecond, 100)
	teachTTFT(once, 60*time.Millisecond, 40*time.Microsecond, 1)
	eps := []*Endpoint{seen, once}
	fit, ok := poolFit(now, eps)
	if !ok {
		t.Fatal("no pool fit")
	}
	fSeen, _ := solveOwn(seen, seen.fresh(now))
	fOnce, _ := solveOwn(once, once.fresh(now))
	ownSeen, ownOnce := fSeen.base, fOnce.base
	if ownOnce < 1.3*ownSeen {
		t.Fatalf("own bases %.1f and %.1f ms: the cold observation should set the once-seen server apart", ownSeen*1e3, ownOnce*1e3)
	}
	if d := fit.base - ownSeen; d < 0 || d > 0.1*(ownOnce-ownSeen) {
		t.Errorf("pool base %.1f ms, own bases %.1f (100 observations) and %.1f ms (1): want it within a tenth of the way to the once-seen one", fit.base*1e3, ownSeen*1e3, ownOnce*1e3)
	}
	req := &Request{Tokens: 1000, Now: now}
	a, b := predict(req, seen, 0, loraNone, nil, &fit).Base, predict(req, once, 0, loraNone, nil, &fit).Base
	t.Logf("predicted bases %v (100 observations) and %v (1), own %.1f and %.1f ms", a, b, ownSeen*1e3, ownOnce*1e3)
	if math.Abs(float64(b-a)) > 0.05*float64(a) {
		t.Errorf("once-seen server's base predicted %v against %v: want within 5%%", b, a)
	}
}
