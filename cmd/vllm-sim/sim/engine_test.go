package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// testEngine returns an engine on a manual clock with no frontend latency.
func testEngine(t *testing.T, mod func(*Config)) (*Engine, *ManualClock) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.FrontendLatency = 0
	if mod != nil {
		mod(&cfg)
	}
	clk := NewManualClock(t0)
	e, err := New(cfg, clk)
	if err != nil {
		t.Fatal(err)
	}
	return e, clk
}

type result struct {
	first, last time.Time
	tokens      int
	done        bool
	usage       Usage
	text        strings.Builder
}

func (r *result) ttft() time.Duration { return r.first.Sub(t0) }

// tracker records when each handle's tokens arrive on the manual clock.
type tracker struct {
	e       *Engine
	clk     *ManualClock
	handles []*Handle
	res     map[*Handle]*result
}

func newTracker(e *Engine, clk *ManualClock) *tracker {
	return &tracker{e: e, clk: clk, res: map[*Handle]*result{}}
}

func (tr *tracker) submit(t *testing.T, r Request) *Handle {
	t.Helper()
	h, err := tr.e.Submit(context.Background(), r)
	if err != nil {
		t.Fatalf("submit: %v", err)
	}
	tr.handles = append(tr.handles, h)
	tr.res[h] = &result{}
	return h
}

func (tr *tracker) drain() {
	now := tr.clk.Now()
	for _, h := range tr.handles {
		r := tr.res[h]
		for {
			select {
			case ev := <-h.Events:
				if r.tokens == 0 {
					r.first = now
				}
				r.tokens++
				r.last = now
				r.usage = ev.Usage
				r.text.WriteString(ev.Text)
				if ev.Done {
					r.done = true
				}
				continue
			default:
			}
			break
		}
	}
}

// step runs one engine step and collects its output.
func (tr *tracker) step(t *testing.T) bool {
	t.Helper()
	ok := tr.e.Step(context.Background())
	tr.drain()
	return ok
}

// run steps until the engine has no work (bounded).
func (tr *tracker) run(t *testing.T) {
	t.Helper()
	for i := 0; i < 100000; i++ {
		if !tr.step(t) {
			return
		}
	}
	t.Fatal("engine did not go idle")
}

func prompt(words ...string) []uint32 { return Tokenize(strings.Join(words, " ")) }

// nTokens returns a prompt of n distinct tokens tagged by seed.
func nTokens(seed string, n int) []uint32 {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", seed[:1], i%1000)
	}
	toks := Tokenize(b.String())
	if len(toks) != n {
		panic(fmt.Sprintf("nTokens: got %d tokens, want %d", len(toks), n))
	}
	return toks
}

func concat(a, b []uint32) []uint32 { return append(append([]uint32{}, a...), b...) }

func TestTokenizerSharesPrefixes(t *testing.T) {
	a := Tokenize("You are a helpful assistant. What is the capital of France?")
	b := Tokenize("You are a helpful assistant. Tell me a joke")
	if len(a) != CountTokens("You are a helpful assistant. What is the capital of France?") {
		t.Fatalf("CountTokens disagrees with Tokenize")
	}
	common := 0
	for common < len(a) && common < len(b) && a[common] == b[common] {
		common++
	}
	// "You are a helpful assistant." = You,are,a,help,ful,assi,stan,t. = 8 tokens
	if common != 8 {
		t.Fatalf("shared prefix = %d tokens, want 8 (a=%v b=%v)", common, a, b)
	}
	chat := RenderChat([]Message{{"system", "be brief"}, {"user", "hi"}})
	if !strings.HasPrefix(chat, "<|system|> be brief\n<|user|> hi\n") || !strings.HasSuffix(chat, "<|assistant|>") {
		t.Fatalf("chat template rendered %q", chat)
	}
}

func TestSingleRequestTimingFollowsStepModel(t *testing.T) {
	e, clk := testEngine(t, nil)
	tr := newTracker(e, clk)
	h := tr.submit(t, Request{Prompt: nTokens("a", 192), MaxTokens: 4})
	tr.run(t)
	r := tr.res[h]
	if !r.done || r.tokens != 4 {
		t.Fatalf("got %d tokens, done=%v; want 4 and done", r.tokens, r.done)
	}
	prefill := e.StepDuration(0, 192)
	if r.ttft() != prefill {
		t.Fatalf("TTFT = %v, want one prefill step of 192 tokens = %v", r.ttft(), prefill)
	}
	wantLast := prefill + 3*e.StepDuration(1, 0)
	if got := r.last.Sub(t0); got != wantLast {
		t.Fatalf("last token at %v, want %v", got, wantLast)
	}
	if r.usage.PromptTokens != 192 || r.usage.CompletionTokens != 4 || r.usage.CachedTokens != 0 {
		t.Fatalf("usage = %+v", r.usage)
	}
	if r.text.String() != " the quick brown fox" {
		t.Fatalf("text = %q", r.text.String())
	}
	st := e.Stats()
	if st.Running != 0 || st.Waiting != 0 || st.GenerationTokens != 4 || st.PromptTokens != 192 {
		t.Fatalf("stats after finish = %+v", st)
	}
}

func TestTTFTGrowsWithQueueDepth(t *testing.T) {
	e, clk := testEngine(t, func(c *Config) { c.MaxNumSeqs = 4 })
	tr := newTracker(e, clk)
	var hs []*Handle
	for i := range 16 {
		hs = append(hs, tr.submit(t, Request{Prompt: nTokens(fmt.Sprintf("%c", 'a'+i), 64), MaxTokens: 32}))
	}
	if st := e.Stats(); st.Waiting != 16 {
		t.Fatalf("waiting = %d before the first step, want 16", st.Waiting)
	}
	tr.step(t)
	if st := e.Stats(); st.Running != 4 || st.Waiting != 12 {
		t.Fatalf("after one step running=%d waiting=%d, want 4 and 12 (max_num_seqs=4)", st.Running, st.Waiting)
	}
	tr.run(t)
	// Requests are served in waves of four; each wave's TTFT is larger.
	for wave := 1; wave < 4; wave++ {
		prev, cur := tr.res[hs[(wave-1)*4]].ttft(), tr.res[hs[wave*4]].ttft()
		if cur <= prev {
			t.Fatalf("wave %d TTFT %v not above wave %d TTFT %v", wave, cur, wave-1, prev)
		}
	}
	if last := tr.res[hs[15]].ttft(); last < 3*32*e.StepDuration(4, 0) {
		t.Fatalf("16th request TTFT %v; it should have queued behind three waves of 32 decode steps", last)
	}
}

func TestPrefixCacheHitLowersTTFT(t *testing.T) {
	for _, caching := range []bool{true, false} {
		t.Run(fmt.Sprintf("caching=%v", caching), func(t *testing.T) {
			e, clk := testEngine(t, func(c *Config) { c.EnablePrefixCaching = caching })
			system := nTokens("s", 512)
			tr := newTracker(e, clk)
			a := tr.submit(t, Request{Prompt: concat(system, nTokens("q", 20)), MaxTokens: 2})
			tr.run(t)
			start := clk.Now()
			b := tr.submit(t, Request{Prompt: concat(system, nTokens("u", 20)), MaxTokens: 2})
			tr.run(t)
			ra, rb := tr.res[a], tr.res[b]
			ttftA, ttftB := ra.first.Sub(t0), rb.first.Sub(start)
			st := e.Stats()
			if !caching {
				if rb.usage.CachedTokens != 0 || st.PrefixHits != 0 || ttftB != ttftA {
					t.Fatalf("caching off: cached=%d hits=%d ttft %v vs %v", rb.usage.CachedTokens, st.PrefixHits, ttftB, ttftA)
				}
				return
			}
			if ra.usage.CachedTokens != 0 {
				t.Fatalf("first request cached_tokens = %d, want 0", ra.usage.CachedTokens)
			}
			if rb.usage.CachedTokens != 512 {
				t.Fatalf("second request cached_tokens = %d, want 512 (the 32 full blocks of the shared prefix)", rb.usage.CachedTokens)
			}
			if want := e.StepDuration(0, 532-512); ttftB != want {
				t.Fatalf("cached TTFT = %v, want a 20-token prefill step %v (uncached was %v)", ttftB, want, ttftA)
			}
			if st.PrefixQueries != 2*532 || st.PrefixHits != 512 {
				t.Fatalf("prefix queries/hits = %d/%d, want %d/512", st.PrefixQueries, st.PrefixHits, 2*532)
			}
		})
	}
}

func TestFullyCachedPromptRecomputesLastToken(t *testing.T) {
	e, clk := testEngine(t, nil)
	p := nTokens("x", 33)
	tr := newTracker(e, clk)
	tr.submit(t, Request{Prompt: p, MaxTokens: 1})
	tr.run(t)
	start := clk.Now()
	h := tr.submit(t, Request{Prompt: p, MaxTokens: 1})
	tr.run(t)
	if got := tr.res[h].usage.CachedTokens; got != 32 {
		t.Fatalf("cached tokens = %d, want 32", got)
	}
	if got, want := tr.res[h].first.Sub(start), e.StepDuration(0, 1); got != want {
		t.Fatalf("TTFT = %v, want a 1-token prefill step %v", got, want)
	}
	// A 32-token prompt is block-aligned: the last block must be recomputed.
	p32 := nTokens("y", 32)
	tr.submit(t, Request{Prompt: p32, MaxTokens: 1})
	tr.run(t)
	h = tr.submit(t, Request{Prompt: p32, MaxTokens: 1})
	tr.run(t)
	if got := tr.res[h].usage.CachedTokens; got != 16 {
		t.Fatalf("block-aligned prompt: cached tokens = %d, want 16", got)
	}
}

func TestChunkedPrefill(t *testing.T) {
	e, clk := testEngine(t, func(c *Config) { c.MaxNumBatchedTokens = 32 })
	tr := newTracker(e, clk)
	h := tr.submit(t, Request{Prompt: nTokens("c", 100), MaxTokens: 2})
	for i := range 3 {
		tr.step(t)
		if tr.res[h].tokens != 0 {
			t.Fatalf("token after %d chunks of 32; prompt of 100 needs 4", i+1)
		}
	}
	tr.step(t)
	if tr.res[h].tokens != 1 {
		t.Fatalf("no first token after the 4th chunk")
	}
	if want := 3*e.StepDuration(0, 32) + e.StepDuration(0, 4); tr.res[h].ttft() != want {
		t.Fatalf("TTFT %v, want %v", tr.res[h].ttft(), want)
	}
}

func TestBatchSlowdownStretchesFullSteps(t *testing.T) {
	e, clk := testEngine(t, func(c *Config) { c.MaxNumSeqs = 8; c.BatchSlowdown = 2 })
	plain, _ := testEngine(t, func(c *Config) { c.MaxNumSeqs = 8 })
	if got, want := e.StepDuration(1, 0), plain.StepDuration(1, 0); got != want {
		t.Fatalf("one request: step %v, want %v (no stretch)", got, want)
	}
	if got, want := e.StepDuration(8, 0), 2*plain.StepDuration(8, 0); got != want {
		t.Fatalf("full batch: step %v, want twice %v", got, plain.StepDuration(8, 0))
	}
	if got, want := e.StepDuration(7, 100), plain.StepDuration(7, 100)*2; got != want {
		t.Fatalf("7 decoding and one prefill: step %v, want %v", got, want)
	}
	// A prefill joining 3 decoding requests: 4 of 8, 1 + 3/7 times.
	tr := newTracker(e, clk)
	for i := range 3 {
		tr.submit(t, Request{Prompt: nTokens(fmt.Sprintf("d%d", i), 16), MaxTokens: 50})
	}
	tr.step(t)
	tr.step(t)
	h := tr.submit(t, Request{Prompt: nTokens("p", 200), MaxTokens: 1})
	before := clk.Now()
	tr.step(t)
	want := time.Duration(float64(plain.StepDuration(3, 200)) * (1 + 3.0/7))
	if got := tr.res[h].first.Sub(before); got < want-time.Microsecond || got > want+time.Microsecond {
		t.Fatalf("prefill beside 3 decodes took %v, want %v", got, want)
	}
	if _, err := New(Config{BatchSlowdown: 0.5}, clk); err == nil {
		t.Fatal("batch slowdown 0.5 accepted")
	}
}

func TestKVUsageAndPreemption(t *testing.T) {
	// 24 usable blocks of 16 tokens (and the null block); each request
	// ends at 48+80 = 128 tokens = 8 blocks, so four of them cannot all
	// finish side by side.
	e, clk := testEngine(t, func(c *Config) { c.NumGPUBlocks = 25; c.EnablePrefixCaching = false })
	tr := newTracker(e, clk)
	usage := []float64{e.Stats().KVUsage}
	for i := range 4 {
		tr.submit(t, Request{Prompt: nTokens(fmt.Sprintf("%c", 'k'+i), 48), MaxTokens: 80})
		tr.step(t)
		usage = append(usage, e.Stats().KVUsage)
	}
	for i := 1; i < len(usage); i++ {
		if usage[i] <= usage[i-1] {
			t.Fatalf("KV usage did not rise with each admitted request: %v", usage)
		}
	}
	maxUsage := 0.0
	for tr.step(t) {
		maxUsage = max(maxUsage, e.Stats().KVUsage)
	}
	st := e.Stats()
	if st.Preemptions == 0 {
		t.Fatalf("no preemptions with 24 blocks for 4x8 blocks of demand")
	}
	if maxUsage < 0.9 {
		t.Fatalf("peak KV usage %.2f; expected the cache to fill", maxUsage)
	}
	for h, r := range tr.res {
		if !r.done || r.tokens != 80 {
			t.Fatalf("request %p: done=%v tokens=%d; preempted requests must resume and finish", h, r.done, r.tokens)
		}
	}
	if st.KVUsage != 0 || st.FreeBlocks != 24 {
		t.Fatalf("blocks leaked: usage %.2f free %d", st.KVUsage, st.FreeBlocks)
	}
}

func TestThirdAdapterWaitsForLoRASlot(t *testing.T) {
	e, clk := testEngine(t, func(c *Config) { c.EnableLoRA = true; c.MaxLoRAs = 2 })
	tr := newTracker(e, clk)
	a := tr.submit(t, Request{Prompt: nTokens("a", 20), MaxTokens: 10, LoRA: "a"})
	tr.submit(t, Request{Prompt: nTokens("b", 20), MaxTokens: 30, LoRA: "b"})
	c := tr.submit(t, Request{Prompt: nTokens("c", 20), MaxTokens: 5, LoRA: "c"})
	a2 := tr.submit(t, Request{Prompt: nTokens("d", 20), MaxTokens: 5, LoRA: "a"})
	base := tr.submit(t, Request{Prompt: nTokens("e", 20), MaxTokens: 5})
	tr.step(t)
	st := e.Stats()
	if st.Running != 4 || st.Waiting != 1 {
		t.Fatalf("running=%d waiting=%d, want 4 running (a, b, a, base) and c waiting", st.Running, st.Waiting)
	}
	if fmt.Sprint(st.RunningLoRAs) != "[a b]" || fmt.Sprint(st.WaitingLoRAs) != "[c]" {
		t.Fatalf("running adapters %v waiting %v", st.RunningLoRAs, st.WaitingLoRAs)
	}
	var buf bytes.Buffer
	if err := e.WriteMetrics(&buf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), `vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}`) {
		t.Fatalf("lora_requests_info missing the a,b / c series:\n%s", grep(buf.String(), "lora"))
	}
	tr.run(t)
	rc := tr.res[c]
	if !rc.done || !rc.first.After(tr.res[a].last) {
		t.Fatalf("adapter c started at %v, before adapter a finished at %v", rc.first, tr.res[a].last)
	}
	if !tr.res[a2].first.Before(rc.first) || !tr.res[base].first.Before(rc.first) {
		t.Fatalf("requests behind c (adapter a, base model) should not wait for c")
	}
}

func TestCancelFreesBlocks(t *testing.T) {
	e, clk := testEngine(t, nil)
	tr := newTracker(e, clk)
	h := tr.submit(t, Request{Prompt: nTokens("z", 100), MaxTokens: 1000})
	tr.step(t)
	tr.step(t)
	usable := e.cfg.NumGPUBlocks - 1 // all but the null block
	if e.Stats().FreeBlocks == usable {
		t.Fatal("running request holds no blocks")
	}
	h.Cancel()
	tr.step(t)
	st := e.Stats()
	if st.Running != 0 || st.FreeBlocks != usable || st.FinishedByReason["abort"] != 1 {
		t.Fatalf("after cancel: %+v", st)
	}
}

func TestSubmitRejectsImpossibleRequests(t *testing.T) {
	e, _ := testEngine(t, func(c *Config) { c.NumGPUBlocks = 4; c.MaxModelLen = 1000 })
	for _, r := range []Request{
		{Prompt: nil, MaxTokens: 4},
		{Prompt: nTokens("a", 10), MaxTokens: 0},
		{Prompt: nTokens("a", 900), MaxTokens: 200},
		{Prompt: nTokens("a", 60), MaxTokens: 10},
	} {
		if _, err := e.Submit(context.Background(), r); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("Submit(prompt %d, max %d) = %v, want ErrInvalidRequest", len(r.Prompt), r.MaxTokens, err)
		}
	}
}

func TestRunIdlesAndServes(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TimeScale = 1000
	e, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { e.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	h, err := e.Submit(ctx, Request{Prompt: nTokens("r", 50), MaxTokens: 8})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for ev := range h.Events {
		n++
		if ev.Done {
			break
		}
	}
	if n != 8 {
		t.Fatalf("got %d tokens, want 8", n)
	}
	// The loop blocks on its wake channel when idle: no steps without work.
	if st := e.Stats(); st.Steps != 8 {
		t.Fatalf("engine ran %d steps for an 8-token request, want 8", st.Steps)
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func parseMetrics(t *testing.T, text string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("metrics do not parse: %v\n%s", err, text)
	}
	return fams
}

func TestMetricsParseWithVLLMNames(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			e, clk := testEngine(t, func(c *Config) {
				c.Model = "llama"
				c.LegacyKVMetric = legacy
				c.EnableLoRA = true
			})
			tr := newTracker(e, clk)
			tr.submit(t, Request{Prompt: nTokens("m", 40), MaxTokens: 3, LoRA: "sql"})
			tr.submit(t, Request{Prompt: nTokens("m", 40), MaxTokens: 3})
			tr.step(t)
			var buf bytes.Buffer
			if err := e.WriteMetrics(&buf); err != nil {
				t.Fatal(err)
			}
			fams := parseMetrics(t, buf.String())
			kv := "vllm:kv_cache_usage_perc"
			if legacy {
				kv = "vllm:gpu_cache_usage_perc"
			}
			want := map[string]dto.MetricType{
				"vllm:num_requests_running":        dto.MetricType_GAUGE,
				"vllm:num_requests_waiting":        dto.MetricType_GAUGE,
				kv:                                 dto.MetricType_GAUGE,
				"vllm:prefix_cache_queries_total":  dto.MetricType_COUNTER,
				"vllm:prefix_cache_hits_total":     dto.MetricType_COUNTER,
				"vllm:num_preemptions_total":       dto.MetricType_COUNTER,
				"vllm:prompt_tokens_total":         dto.MetricType_COUNTER,
				"vllm:generation_tokens_total":     dto.MetricType_COUNTER,
				"vllm:request_success_total":       dto.MetricType_COUNTER,
				"vllm:time_to_first_token_seconds": dto.MetricType_HISTOGRAM,
				"vllm:inter_token_latency_seconds": dto.MetricType_HISTOGRAM,
				"vllm:e2e_request_latency_seconds": dto.MetricType_HISTOGRAM,
				"vllm:lora_requests_info":          dto.MetricType_GAUGE,
				"vllm:cache_config_info":           dto.MetricType_GAUGE,
			}
			for name, typ := range want {
				f, ok := fams[name]
				if !ok {
					t.Errorf("missing %s", name)
					continue
				}
				if f.GetType() != typ {
					t.Errorf("%s has type %v, want %v", name, f.GetType(), typ)
				}
			}
			label := func(m *dto.Metric, name string) string {
				for _, l := range m.GetLabel() {
					if l.GetName() == name {
						return l.GetValue()
					}
				}
				return ""
			}
			run := fams["vllm:num_requests_running"].GetMetric()[0]
			if label(run, "model_name") != "llama" || label(run, "engine") != "0" || run.GetGauge().GetValue() != 2 {
				t.Errorf("num_requests_running = %v", run)
			}
			if v := fams[kv].GetMetric()[0].GetGauge().GetValue(); v <= 0 || v >= 1 {
				t.Errorf("KV usage %v with two running requests", v)
			}
			cc := fams["vllm:cache_config_info"].GetMetric()[0]
			if label(cc, "block_size") != "16" || label(cc, "num_gpu_blocks") != "26000" || cc.GetGauge().GetValue() != 1 {
				t.Errorf("cache_config_info = %v", cc)
			}
			lora := fams["vllm:lora_requests_info"].GetMetric()
			newest := lora[0]
			for _, m := range lora {
				if m.GetGauge().GetValue() > newest.GetGauge().GetValue() {
					newest = m
				}
			}
			if label(newest, "running_lora_adapters") != "sql" || label(newest, "max_lora") != "1" {
				t.Errorf("newest lora_requests_info = %v", newest)
			}
			if got := fams["vllm:time_to_first_token_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); got != 2 {
				t.Errorf("TTFT histogram count = %d, want 2", got)
			}
		})
	}
}

// BenchmarkStepFullBatch measures the engine's own CPU cost of one step with
// 256 running decodes (the real-time loop must stay far below the ~15 ms a
// step of that size simulates).
func BenchmarkStepFullBatch(b *testing.B) {
	cfg := DefaultConfig()
	cfg.FrontendLatency = 0
	e, err := New(cfg, NewManualClock(t0))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	var hs []*Handle
	submit := func(i int) {
		h, err := e.Submit(ctx, Request{Prompt: nTokens(fmt.Sprintf("%c", 'a'+i%26), 200), MaxTokens: 1 << 12})
		if err != nil {
			b.Fatal(err)
		}
		hs = append(hs, h)
	}
	for i := range 256 {
		submit(i)
	}
	for e.Stats().Running < 256 || e.Stats().Waiting > 0 {
		e.Step(ctx)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		e.Step(ctx)
		for _, h := range hs {
			for len(h.Events) > 0 {
				<-h.Events
			}
		}
		if i%4000 == 3999 { // requests run out of tokens: refill the batch
			b.StopTimer()
			for e.Step(ctx) {
			}
			hs = hs[:0]
			for j := range 256 {
				submit(j)
			}
			for e.Stats().Running < 256 || e.Stats().Waiting > 0 {
				e.Step(ctx)
			}
			b.StartTimer()
		}
	}
}
