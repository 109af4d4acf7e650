// Package sim owns the simulated vLLM engine behind cmd/vllm-sim: a
// step-loop scheduler modelled on vLLM V1 (continuous batching, chunked
// prefill, FCFS admission under max_num_seqs, a token budget, KV blocks and
// max_loras, recompute preemption), a block KV cache with chained-hash prefix
// caching and LRU eviction, a deterministic tokenizer, and the engine's
// Prometheus metrics in vLLM's names. It has no HTTP; cmd/vllm-sim wires it
// to the OpenAI API.
package sim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Config is the engine configuration. Zero fields take the defaults of
// DefaultConfig in New.
type Config struct {
	// Model is the served model name used as the model_name metric label.
	Model string
	// MaxNumSeqs caps running requests (vLLM --max-num-seqs).
	MaxNumSeqs int
	// MaxNumBatchedTokens is the per-step token budget (--max-num-batched-tokens).
	MaxNumBatchedTokens int
	// NumGPUBlocks is the number of KV blocks (--num-gpu-blocks-override).
	NumGPUBlocks int
	// BlockSize is tokens per KV block (--block-size).
	BlockSize int
	// EnablePrefixCaching turns on reuse of cached prefix blocks.
	EnablePrefixCaching bool
	// MaxModelLen caps prompt + output tokens of one request.
	MaxModelLen int
	// EnableLoRA makes the engine report vllm:lora_requests_info.
	EnableLoRA bool
	// MaxLoRAs caps distinct adapters among running requests (--max-loras).
	MaxLoRAs int
	// StepBase, PerDecodeSeq and PerPrefillToken give the duration of one
	// engine step: StepBase + PerDecodeSeq*decodes + PerPrefillToken*prefill tokens.
	StepBase        time.Duration
	PerDecodeSeq    time.Duration
	PerPrefillToken time.Duration
	// BatchSlowdown stretches a step by how full its batch is: a step of
	// n requests lasts 1 + (BatchSlowdown-1)*(n-1)/(MaxNumSeqs-1) times
	// the duration above, so every latency is BatchSlowdown times longer
	// at a full batch than alone. 0 or 1: no stretch (vLLM's own steps
	// grow only by the per-sequence and per-token terms).
	BatchSlowdown float64
	// FrontendLatency models the API server (tokenize, IPC, detokenize) and
	// is spent in Submit before a request reaches the scheduler queue.
	FrontendLatency time.Duration
	// TimeScale divides every simulated duration: 10 runs 10x faster.
	TimeScale float64
	// LegacyKVMetric names KV usage vllm:gpu_cache_usage_perc (pre-v0.11).
	LegacyKVMetric bool
	// KVTransferLatency and KVTransferPerToken time the pull of a remote
	// prefill's KV blocks (disaggregated prefill): a fixed setup cost plus
	// a cost per transferred token; scaled by TimeScale.
	KVTransferLatency  time.Duration
	KVTransferPerToken time.Duration
	// KVLease is how long a prefill keeps the KV blocks of a request sent
	// with do_remote_decode for a decode server to pull (vLLM's NIXL
	// kv_lease_duration, 30 s); real time, not scaled.
	KVLease time.Duration
	// KVConnector reports the KV connector's metrics
	// (vllm:external_prefix_cache_*), as vLLM does when one is configured.
	KVConnector bool
	// OnKVEvents, when set, receives the KV-cache events of every engine
	// step that has any, in order, at the step's end (vLLM publishes them
	// from the scheduler's update after each step), under the engine's
	// lock: it must not call back into the engine.
	OnKVEvents func([]KVEvent)
}

// DefaultConfig is Llama-3-8B on one H100 80GB under vLLM 0.11.
//
// KV blocks: Llama-3-8B has 32 layers and 8 KV heads of dim 128, so in bf16
// one token's K and V take 2*32*8*128*2 B = 128 KiB and a 16-token block
// 2 MiB. gpu_memory_utilization 0.9 leaves ~71 GiB; minus ~15 GiB of
// weights and a few GiB of activations and CUDA graphs, ~52 GiB hold about
// 26000 blocks (~416k tokens of KV cache). We use 26000.
//
// FrontendLatency (17 ms) stands for the API server's tokenization, IPC and
// detokenization; with the spec's step model it puts the low-load TTFT of a
// 192-token shared-prefix prompt at the measured ~27-31 ms.
//
// KV transfer (disaggregated prefill over NIXL): 2 ms of setup plus 3 us
// per token, the figures llm-d-inference-sim publishes for an 8B model on
// H100s over RDMA (docs/latency-profiles.md there: RDMA setup 0.5-2 ms;
// InfiniBand NDR 400G at ~40 GB/s effective moves Llama-3-8B's 128 KiB of
// KV per token in ~3 us). KVLease is vLLM 0.32's NixlConnector default
// kv_lease_duration.
func DefaultConfig() Config {
	return Config{
		Model:               "meta-llama/Meta-Llama-3-8B-Instruct",
		MaxNumSeqs:          256,
		MaxNumBatchedTokens: 8192,
		NumGPUBlocks:        26000,
		BlockSize:           16,
		EnablePrefixCaching: true,
		MaxModelLen:         8192,
		MaxLoRAs:            1,
		StepBase:            7 * time.Millisecond,
		PerDecodeSeq:        33 * time.Microsecond,
		PerPrefillToken:     40 * time.Microsecond,
		FrontendLatency:     17 * time.Millisecond,
		TimeScale:           1,
		KVTransferLatency:   2 * time.Millisecond,
		KVTransferPerToken:  3 * time.Microsecond,
		KVLease:             30 * time.Second,
	}
}

// ErrInvalidRequest marks requests the engine refuses (the HTTP layer
// answers 400).
var ErrInvalidRequest = errors.New("invalid request")

// Request is one generation request.
type Request struct {
	Prompt    []uint32
	MaxTokens int
	// StopAfter, when > 0, ends the request with finish reason "stop" after
	// that many tokens: where the simulated model emits EOS.
	StopAfter int
	// LoRA is the adapter name, empty for the base model.
	LoRA string
	// HoldKV, when set, keeps the request's KV blocks after it finishes,
	// under this key, for a decode server to pull (PullKV) until the
	// engine's KVLease passes: a prefill sent with do_remote_decode.
	HoldKV string
	// RemoteTokens is the number of leading prompt tokens whose KV a
	// remote prefill computed: the request waits out their transfer
	// (KVTransferLatency + KVTransferPerToken each) before it queues, and
	// is not prefilled for them.
	RemoteTokens int
	// RemoteCached is the remote prefill's own prefix-cache hits, reported
	// as the request's cached tokens (vLLM 0.32's
	// remote_prefill_cached_tokens); -1 reports local hits plus the
	// transferred tokens, as vLLM did before.
	RemoteCached int
}

// Usage is a request's token accounting.
type Usage struct {
	PromptTokens     int
	CompletionTokens int
	CachedTokens     int
}

// Event is one generated token. The last event of a request has Done set.
type Event struct {
	Index        int // 0-based index of the generated token
	Text         string
	Done         bool
	FinishReason string // "length" or "stop" on the last event
	Usage        Usage
	// KVBlocks and KVTokens, on the last event of a HoldKV request, name
	// the held blocks and how many tokens they hold.
	KVBlocks []int
	KVTokens int
}

// ErrKVNotFound is PullKV's answer for blocks that are not (or no longer)
// held: never held, already pulled, or their lease ran out.
var ErrKVNotFound = errors.New("kv blocks not found")

// Handle is a submitted request.
type Handle struct {
	// Events delivers every generated token; it never blocks the engine.
	Events <-chan Event
	s      *seq
	e      *Engine
}

// Cancel aborts the request; its KV blocks are freed at the next step.
func (h *Handle) Cancel() {
	if h.s.aborted.CompareAndSwap(false, true) {
		h.e.poke()
	}
}

// seq is the engine's state for one request.
type seq struct {
	id              uint64
	tokens          []uint32 // prompt then generated tokens
	numPrompt       int
	numComputed     int // tokens whose KV is in the cache
	maxTokens       int
	stopAfter       int
	generated       int
	lora            string
	hashes          []uint64 // chained hash of each full block of tokens
	blocks          []*block
	numCachedBlocks int // leading blocks already registered in the prefix cache
	cachedTokens    int
	holdKV          string
	remoteTokens    int // remote tokens still usable (0 after a preemption)
	remoteReceived  int // tokens the transfer brought
	remoteCached    int
	everScheduled   bool
	arrival         time.Time
	scheduled       time.Time // first admission
	firstToken      time.Time
	queued          time.Time
	lastToken       time.Time
	aborted         atomic.Bool
	finished        bool
	preempted       int // times preempted
	out             chan Event
}

type work struct {
	s      *seq
	numNew int
	decode bool
}

// Engine is the simulated vLLM engine core. Submit requests from any
// goroutine; Run drives steps in real time, or tests call Step with a
// ManualClock.
type Engine struct {
	cfg   Config
	clock Clock
	wake  chan struct{}

	mu      sync.Mutex
	kv      *kvCache
	running []*seq // admission order
	waiting []*seq // FCFS, preempted requests at the front
	nextID  uint64
	lastEnd time.Time // scheduled end of the previous step while busy
	stats   counters
	held    map[string]*heldKV
	// version counts changes of state; page is the metrics page rendered
	// at pageVersion (an idle engine's page is rendered once).
	version     uint64
	page        []byte
	pageVersion uint64
	created     time.Time
}

// heldKV is a finished prefill's KV kept for a remote decode.
type heldKV struct {
	blocks  []*block
	tokens  int
	expires time.Time
}

// New returns an engine with cfg (zero fields defaulted) on clock.
func New(cfg Config, clock Clock) (*Engine, error) {
	def := DefaultConfig()
	setDefault := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	setDefault(&cfg.MaxNumSeqs, def.MaxNumSeqs)
	setDefault(&cfg.MaxNumBatchedTokens, def.MaxNumBatchedTokens)
	setDefault(&cfg.NumGPUBlocks, def.NumGPUBlocks)
	setDefault(&cfg.BlockSize, def.BlockSize)
	setDefault(&cfg.MaxModelLen, def.MaxModelLen)
	setDefault(&cfg.MaxLoRAs, def.MaxLoRAs)
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1
	}
	if cfg.KVLease == 0 {
		cfg.KVLease = def.KVLease
	}
	if cfg.Model == "" {
		cfg.Model = def.Model
	}
	switch {
	case cfg.MaxNumSeqs < 1:
		return nil, fmt.Errorf("max-num-seqs must be >= 1, got %d", cfg.MaxNumSeqs)
	case cfg.MaxNumBatchedTokens < 1:
		return nil, fmt.Errorf("max-num-batched-tokens must be >= 1, got %d", cfg.MaxNumBatchedTokens)
	case cfg.NumGPUBlocks < 2:
		return nil, fmt.Errorf("num-gpu-blocks must be >= 2 (one is the null block), got %d", cfg.NumGPUBlocks)
	case cfg.BlockSize < 1:
		return nil, fmt.Errorf("block-size must be >= 1, got %d", cfg.BlockSize)
	case cfg.MaxLoRAs < 1:
		return nil, fmt.Errorf("max-loras must be >= 1, got %d", cfg.MaxLoRAs)
	case cfg.TimeScale < 0:
		return nil, fmt.Errorf("time-scale must be > 0, got %g", cfg.TimeScale)
	case cfg.BatchSlowdown < 0 || (cfg.BatchSlowdown > 0 && cfg.BatchSlowdown < 1):
		return nil, fmt.Errorf("batch-slowdown must be >= 1 (or 0 for none), got %g", cfg.BatchSlowdown)
	case cfg.StepBase < 0 || cfg.PerDecodeSeq < 0 || cfg.PerPrefillToken < 0:
		return nil, fmt.Errorf("step times must not be negative")
	}
	if clock == nil {
		clock = RealClock{}
	}
	return &Engine{
		cfg:     cfg,
		clock:   clock,
		wake:    make(chan struct{}, 1),
		kv:      newKVCache(cfg.NumGPUBlocks, cfg.BlockSize, cfg.EnablePrefixCaching, cfg.OnKVEvents != nil),
		stats:   newCounters(cfg.MaxModelLen),
		held:    make(map[string]*heldKV),
		version: 1,
		created: clock.Now(),
	}, nil
}

// Config returns the engine's effective configuration.
func (e *Engine) Config() Config { return e.cfg }

func (e *Engine) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) / e.cfg.TimeScale)
}

func (e *Engine) poke() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Submit queues r after the frontend latency and returns its handle. It
// fails with ErrInvalidRequest for requests that can never run, or with
// ctx's error.
func (e *Engine) Submit(ctx context.Context, r Request) (*Handle, error) {
	if len(r.Prompt) == 0 {
		return nil, fmt.Errorf("%w: prompt is empty", ErrInvalidRequest)
	}
	if r.MaxTokens < 1 {
		return nil, fmt.Errorf("%w: max_tokens must be at least 1, got %d", ErrInvalidRequest, r.MaxTokens)
	}
	total := len(r.Prompt) + r.MaxTokens
	if total > e.cfg.MaxModelLen {
		return nil, fmt.Errorf("%w: this model's maximum context length is %d tokens, but %d were requested (%d in the prompt, %d for the completion)",
			ErrInvalidRequest, e.cfg.MaxModelLen, total, len(r.Prompt), r.MaxTokens)
	}
	if n := e.kv.blocksFor(total); n > e.kv.capacity() {
		return nil, fmt.Errorf("%w: request needs %d KV blocks but the cache has only %d", ErrInvalidRequest, n, e.kv.capacity())
	}
	if r.RemoteTokens < 0 || r.RemoteTokens > len(r.Prompt) {
		return nil, fmt.Errorf("%w: %d remote tokens for a %d-token prompt", ErrInvalidRequest, r.RemoteTokens, len(r.Prompt))
	}
	arrival := e.clock.Now()
	// The API server's work, then the pull of a remote prefill's KV.
	wait := e.cfg.FrontendLatency
	if r.RemoteTokens > 0 {
		wait += e.cfg.KVTransferLatency + time.Duration(r.RemoteTokens)*e.cfg.KVTransferPerToken
	}
	if wait > 0 {
		if err := e.clock.SleepUntil(ctx, arrival.Add(e.scaled(wait))); err != nil {
			return nil, fmt.Errorf("submit: %w", err)
		}
	}
	tokens := make([]uint32, len(r.Prompt), total)
	copy(tokens, r.Prompt)
	s := &seq{
		tokens:    tokens,
		numPrompt: len(r.Prompt),
		maxTokens: r.MaxTokens,
		stopAfter: r.StopAfter,
		lora:      r.LoRA,
		holdKV:    r.HoldKV,
		// The last prompt token is always computed here, as vLLM does.
		remoteTokens:   min(r.RemoteTokens, len(r.Prompt)-1),
		remoteReceived: r.RemoteTokens,
		remoteCached:   r.RemoteCached,
		arrival:        arrival,
		out:            make(chan Event, r.MaxTokens),
	}
	e.mu.Lock()
	e.version++
	e.nextID++
	s.id = e.nextID
	s.queued = e.clock.Now()
	e.waiting = append(e.waiting, s)
	e.touchLoRAInfo(s.queued)
	e.mu.Unlock()
	e.poke()
	return &Handle{Events: s.out, s: s, e: e}, nil
}

// Run steps the engine until ctx ends, blocking (not spinning) while there
// is no work.
func (e *Engine) Run(ctx context.Context) {
	for ctx.Err() == nil {
		if e.Step(ctx) {
			continue
		}
		select {
		case <-e.wake:
		case <-ctx.Done():
		}
	}
}

// Step runs one engine step: schedule, wait out the step's duration on the
// clock, then emit the tokens it produced. It reports false, without
// waiting, when there was nothing to run.
//
// Back-to-back steps are timed from the previous step's scheduled end, not
// from when the loop got round to the next one, so timer and scheduling
// lateness (up to maxCatchUp) does not stretch simulated time; this matters
// at high time scales where a step is a fraction of a millisecond.
func (e *Engine) Step(ctx context.Context) bool {
	e.mu.Lock()
	start := e.clock.Now()
	if !e.lastEnd.IsZero() && start.Sub(e.lastEnd) < maxCatchUp {
		start = e.lastEnd
	}
	e.version++ // scheduling admits, preempts and drops aborted requests
	plan := e.schedule(start)
	if len(plan) == 0 {
		e.lastEnd = time.Time{}
		e.mu.Unlock()
		return false
	}
	d := e.stepDuration(plan)
	e.lastEnd = start.Add(d)
	e.mu.Unlock()
	if err := e.clock.SleepUntil(ctx, start.Add(d)); err != nil {
		return false
	}
	e.mu.Lock()
	e.commit(plan, e.clock.Now())
	e.mu.Unlock()
	return true
}

// publishKVEvents hands the step's KV events to OnKVEvents. Called with
// e.mu held.
func (e *Engine) publishKVEvents() {
	if e.kv.events == nil || len(*e.kv.events) == 0 {
		return
	}
	e.cfg.OnKVEvents(*e.kv.events)
	*e.kv.events = (*e.kv.events)[:0]
}

// ResetPrefixCache drops every cached block, as vLLM's
// /reset_prefix_cache: it reports false, changing nothing, while a
// request holds blocks. Like vLLM, the AllBlocksCleared event goes out
// with the next step's events.
func (e *Engine) ResetPrefixCache() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.kv.reset() {
		return false
	}
	e.version++
	return true
}

// maxCatchUp bounds how late a step may start and still be timed from the
// previous step's end.
const maxCatchUp = time.Millisecond

// StepDuration is the simulated duration of a step with the given batch
// (decodeSeqs decoding requests, and prefillTokens computed for one
// request in prefill when more than 0), after time scaling.
func (e *Engine) StepDuration(decodeSeqs, prefillTokens int) time.Duration {
	return e.stepTime(decodeSeqs+min(prefillTokens, 1), decodeSeqs, prefillTokens)
}

// stepTime is the scaled duration of a step of seqs requests, decodeSeqs
// of them decoding, computing prefillTokens prompt tokens.
func (e *Engine) stepTime(seqs, decodeSeqs, prefillTokens int) time.Duration {
	d := e.cfg.StepBase + time.Duration(decodeSeqs)*e.cfg.PerDecodeSeq + time.Duration(prefillTokens)*e.cfg.PerPrefillToken
	if f := e.cfg.BatchSlowdown; f > 1 && seqs > 1 && e.cfg.MaxNumSeqs > 1 {
		full := float64(min(seqs, e.cfg.MaxNumSeqs)-1) / float64(e.cfg.MaxNumSeqs-1)
		d = time.Duration(float64(d) * (1 + (f-1)*full))
	}
	return e.scaled(d)
}

func (e *Engine) stepDuration(plan []work) time.Duration {
	decodes, prefill := 0, 0
	for _, w := range plan {
		if w.decode {
			decodes++
		} else {
			prefill += w.numNew
		}
	}
	return e.stepTime(len(plan), decodes, prefill)
}

// schedule picks this step's work. Called with e.mu held.
func (e *Engine) schedule(now time.Time) []work {
	if e.dropAborted(now) {
		e.touchLoRAInfo(now)
	}
	e.expireHeld(now)
	budget := e.cfg.MaxNumBatchedTokens
	var plan []work
	preempted := false

	// Running requests first: a decode token each, or the next prefill chunk.
	for i := 0; i < len(e.running) && budget > 0; i++ {
		s := e.running[i]
		numNew := min(len(s.tokens)-s.numComputed, budget)
		if numNew <= 0 {
			continue
		}
		scheduled := true
		for !e.kv.grow(s, s.numComputed+numNew) {
			// Out of blocks: preempt the most recently admitted request.
			victim := e.running[len(e.running)-1]
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim)
			preempted = true
			if victim == s {
				scheduled = false
				break
			}
		}
		if !scheduled {
			break
		}
		decode := s.generated > 0 && numNew == 1 && s.numComputed == len(s.tokens)-1
		plan = append(plan, work{s: s, numNew: numNew, decode: decode})
		budget -= numNew
	}

	// Then admit waiting requests FCFS, unless this step had to preempt.
	if preempted {
		return plan
	}
	active := make(map[string]bool)
	for _, s := range e.running {
		if s.lora != "" {
			active[s.lora] = true
		}
	}
	var skipped []*seq
	for len(e.waiting) > 0 && len(e.running) < e.cfg.MaxNumSeqs && budget > 0 {
		s := e.waiting[0]
		if s.lora != "" && !active[s.lora] && len(active) >= e.cfg.MaxLoRAs {
			// No adapter slot: let later requests of loaded adapters pass.
			skipped = append(skipped, s)
			e.waiting = e.waiting[1:]
			continue
		}
		hits := e.kv.lookup(s)
		numCached := len(hits) * e.cfg.BlockSize
		// Tokens whose KV came from a remote prefill are not computed
		// here either; their blocks are allocated fresh.
		numSkipped := max(numCached, s.remoteTokens)
		numNew := min(len(s.tokens)-numSkipped, budget)
		if !e.kv.admit(s, hits, numSkipped+numNew) {
			break
		}
		if e.cfg.EnablePrefixCaching {
			e.stats.prefixQueries += uint64(len(s.tokens))
			e.stats.prefixHits += uint64(numCached)
		}
		if e.cfg.KVConnector && !s.everScheduled {
			e.stats.externalQueries += uint64(len(s.tokens) - numCached)
			if s.remoteTokens > 0 {
				e.stats.externalHits += uint64(s.remoteReceived)
			}
		}
		if !s.everScheduled {
			s.everScheduled = true
			s.scheduled = now
			s.cachedTokens = numSkipped
			if s.remoteTokens > 0 && s.remoteCached >= 0 {
				s.cachedTokens = s.remoteCached
			}
			e.stats.queueTime.observe(max(0, now.Sub(s.queued).Seconds()))
		}
		s.numComputed = numSkipped
		e.waiting = e.waiting[1:]
		e.running = append(e.running, s)
		if s.lora != "" {
			active[s.lora] = true
		}
		plan = append(plan, work{s: s, numNew: numNew})
		budget -= numNew
	}
	if len(skipped) > 0 {
		e.waiting = append(skipped, e.waiting...)
	}
	return plan
}

// preempt frees a running request's blocks and puts it back at the head of
// the queue; its prompt and generated tokens are recomputed on readmission.
func (e *Engine) preempt(s *seq) {
	e.kv.release(s)
	s.numComputed = 0
	s.remoteTokens = 0 // the transferred KV is gone with the blocks
	e.waiting = append([]*seq{s}, e.waiting...)
	e.stats.preemptions++
	s.preempted++
}

// dropAborted removes cancelled requests; it reports whether there were any.
func (e *Engine) dropAborted(now time.Time) bool {
	dropped := false
	keep := e.running[:0]
	for _, s := range e.running {
		if s.aborted.Load() {
			e.kv.release(s)
			e.finish(s, now, "abort")
			dropped = true
			continue
		}
		keep = append(keep, s)
	}
	clear(e.running[len(keep):])
	e.running = keep
	wkeep := e.waiting[:0]
	for _, s := range e.waiting {
		if s.aborted.Load() {
			e.finish(s, now, "abort")
			dropped = true
			continue
		}
		wkeep = append(wkeep, s)
	}
	clear(e.waiting[len(wkeep):])
	e.waiting = wkeep
	return dropped
}

func (e *Engine) finish(s *seq, now time.Time, reason string) {
	s.finished = true
	e.stats.success[reason]++
	e.stats.e2e.observe(now.Sub(s.arrival).Seconds())
	if reason != "abort" {
		e.stats.reqPrompt.observe(float64(s.numPrompt))
		e.stats.reqGeneration.observe(float64(s.generated))
		// As vLLM: the phases of a request that ran, observed at its end.
		e.stats.prefillTime.observe(max(0, s.firstToken.Sub(s.scheduled).Seconds()))
		e.stats.inferenceTime.observe(max(0, now.Sub(s.scheduled).Seconds()))
		// As vLLM: the prompt less what the response reports cached (for a
		// remote prefill, the prefill's own hits).
		e.stats.prefillComputed.observe(float64(s.numPrompt - s.cachedTokens))
		e.stats.reqMaxGen.observe(float64(s.maxTokens))
		e.stats.paramsN.observe(1)
		e.stats.paramsMaxTokens.observe(float64(s.maxTokens))
		e.stats.decodeTime.observe(max(0, now.Sub(s.firstToken).Seconds()))
		if s.generated > 1 {
			e.stats.tpot.observe(max(0, now.Sub(s.firstToken).Seconds()) / float64(s.generated-1))
		}
		e.stats.numPreempt.observe(float64(s.preempted))
	}
}

// commit applies a finished step: computed tokens enter the cache and every
// request whose tokens are all computed produces its next token. Called with
// e.mu held.
func (e *Engine) commit(plan []work, now time.Time) {
	e.version++
	// Computed tokens enter the cache first, and the step's KV events go
	// out before its tokens do, as vLLM publishes them from the
	// scheduler's update before the step's outputs leave the engine: a
	// client that reads a response sees its cache's events already sent.
	stepTokens := 0
	for _, w := range plan {
		stepTokens += w.numNew
		s := w.s
		if s.aborted.Load() || s.finished {
			continue
		}
		s.numComputed += w.numNew
		e.kv.commit(s)
	}
	e.publishKVEvents()
	anyDone := false
	for _, w := range plan {
		s := w.s
		if s.aborted.Load() || s.finished {
			continue
		}
		if s.numComputed < len(s.tokens) {
			continue // more prefill chunks to go
		}
		idx := s.generated
		s.tokens = append(s.tokens, fillerID(idx))
		s.generated++
		e.stats.generationTokens++
		if idx == 0 {
			s.firstToken = now
			e.stats.promptTokens += uint64(s.numPrompt)
			e.stats.ttft.observe(now.Sub(s.arrival).Seconds())
		} else {
			itl := now.Sub(s.lastToken).Seconds()
			e.stats.itl.observe(itl)
		}
		s.lastToken = now
		ev := Event{
			Index: idx,
			Text:  FillerToken(idx),
			Usage: Usage{PromptTokens: s.numPrompt, CompletionTokens: s.generated, CachedTokens: s.cachedTokens},
		}
		reason := ""
		switch {
		case s.generated >= s.maxTokens:
			reason = "length"
		case s.stopAfter > 0 && s.generated >= s.stopAfter:
			reason = "stop"
		}
		if reason != "" {
			ev.Done, ev.FinishReason = true, reason
			if s.holdKV != "" {
				ev.KVBlocks, ev.KVTokens = e.hold(s, now)
			} else {
				e.kv.release(s)
			}
			e.finish(s, now, reason)
			anyDone = true
		}
		s.out <- ev // capacity maxTokens: never blocks
	}
	if anyDone {
		keep := e.running[:0]
		for _, s := range e.running {
			if !s.finished {
				keep = append(keep, s)
			}
		}
		clear(e.running[len(keep):])
		e.running = keep
	}
	e.stats.steps++
	e.stats.iterTokens.observe(float64(stepTokens))
	e.touchLoRAInfo(now)
}

// hold keeps a finished prefill's blocks for a remote decode until the
// lease passes, and returns their ids and token count. Called with e.mu
// held.
func (e *Engine) hold(s *seq, now time.Time) ([]int, int) {
	ids := make([]int, len(s.blocks))
	for i, b := range s.blocks {
		ids[i] = b.id
	}
	if old := e.held[s.holdKV]; old != nil {
		e.kv.releaseBlocks(old.blocks)
	}
	e.held[s.holdKV] = &heldKV{blocks: s.blocks, tokens: s.numComputed, expires: now.Add(e.cfg.KVLease)}
	s.blocks = nil
	s.numCachedBlocks = 0
	return ids, s.numComputed
}

// expireHeld frees held blocks whose lease has passed. Called with e.mu
// held.
func (e *Engine) expireHeld(now time.Time) {
	for k, h := range e.held {
		if !now.Before(h.expires) {
			e.kv.releaseBlocks(h.blocks)
			delete(e.held, k)
			e.version++
		}
	}
}

// PullKV hands over the blocks a finished prefill holds under key to a
// remote decode and frees them; it returns how many tokens they hold, or
// ErrKVNotFound.
func (e *Engine) PullKV(key string) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expireHeld(e.clock.Now())
	h, ok := e.held[key]
	if !ok {
		return 0, fmt.Errorf("%w: %q", ErrKVNotFound, key)
	}
	delete(e.held, key)
	e.kv.releaseBlocks(h.blocks)
	e.version++
	e.poke()
	return h.tokens, nil
}

// Stats is a snapshot of the engine's state and counters.
type Stats struct {
	Running, Waiting int
	KVUsage          float64
	FreeBlocks       int
	Preemptions      uint64
	PrefixQueries    uint64 // tokens looked up in the prefix cache
	PrefixHits       uint64 // tokens found there
	PromptTokens     uint64
	GenerationTokens uint64
	Steps            uint64
	RunningLoRAs     []string
	WaitingLoRAs     []string
	FinishedByReason map[string]uint64
	TTFTCount        uint64
	TTFTSum          float64
	// HeldKV counts finished prefills whose blocks wait for a pull.
	HeldKV int
}

// Stats returns a snapshot of the engine state.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expireHeld(e.clock.Now())
	run, wait := e.loraSets()
	fin := make(map[string]uint64, len(e.stats.success))
	for k, v := range e.stats.success {
		fin[k] = v
	}
	return Stats{
		Running:          len(e.running),
		Waiting:          len(e.waiting),
		KVUsage:          e.kv.usage(),
		FreeBlocks:       e.kv.numFree,
		Preemptions:      e.stats.preemptions,
		PrefixQueries:    e.stats.prefixQueries,
		PrefixHits:       e.stats.prefixHits,
		PromptTokens:     e.stats.promptTokens,
		GenerationTokens: e.stats.generationTokens,
		Steps:            e.stats.steps,
		RunningLoRAs:     run,
		WaitingLoRAs:     wait,
		FinishedByReason: fin,
		TTFTCount:        e.stats.ttft.count,
		TTFTSum:          e.stats.ttft.sum,
		HeldKV:           len(e.held),
	}
}

// loraSets returns the distinct adapters of running and of waiting
// requests, in queue order. Called with e.mu held.
func (e *Engine) loraSets() (running, waiting []string) {
	collect := func(list []*seq) []string {
		var out []string
		seen := map[string]bool{}
		for _, s := range list {
			if s.lora != "" && !seen[s.lora] {
				seen[s.lora] = true
				out = append(out, s.lora)
			}
		}
		return out
	}
	return collect(e.running), collect(e.waiting)
}
