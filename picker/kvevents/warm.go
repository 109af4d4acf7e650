package kvevents

import (
	"context"
	"errors"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Background calls: a request whose stable prefix is not cached is
// routed by the estimate at once, and its prefix is fetched here for the
// requests that follow. Prompts wanted while their call is queued or
// running share it; the calls run Workers at a time per pool, one at a
// time per server and within each server's budget (CallsPerSecond), on
// the least busy candidate of the request that wanted it; what finds no
// room is dropped (the next request that needs it asks again). A failed
// prompt is not asked for again for failedFor.

// failedFor is how long a prompt whose call failed is left alone.
const failedFor = 30 * time.Second

// acquireFor is how long a job waits for a server within its budget
// before it is dropped.
const acquireFor = 2 * time.Second

// warmJob is one background task: fetch a stable prefix's ids (key,
// body), and/or the whole prompt's (whole, wholeBody) to check the
// prefix against (verify) or because the model's prefixes are not
// used; or read a server's model list (models).
type warmJob struct {
	servers []string
	model   string
	chat    bool

	key  uint64 // prefix to fetch (0: none, it is cached: cmp)
	cmp  uint64 // the prefix whose ids the whole prompt's must start with
	body []byte

	whole     uint64
	wholeBody []byte
	verify    bool // compare cmp's ids with the whole prompt's
	wholeOnly bool // the model's prefixes are not used: fetch the whole

	models bool
}

type stabKey struct {
	model string
	chat  bool
}

// stability is what checking a model's prefixes found.
type stability struct {
	verified, mismatches int64
	queued               int64 // verifications waiting
	// Prefixes the servers tokenized, and refused (400).
	accepted, refused int64
	unstable          bool
}

// maxRefused is how many refused prefixes, with none accepted, make a
// model's prefixes unused.
const maxRefused = 3

// engineBudget is one server's share of the background calls.
type engineBudget struct {
	tokens   float64
	last     time.Time
	inflight int
}

type warmer struct {
	t    *Tokenizer
	jobs chan *warmJob
	once sync.Once
	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	pending  map[uint64]bool
	models   map[string]bool // model lists being read, by model
	failed   map[uint64]time.Time
	engines  map[string]*engineBudget
	stab     map[stabKey]*stability
	lookups  atomic.Int64
	unstable atomic.Int32 // models with unstable prefixes (fast path: 0)

	dropped, verified, mismatches, refused atomic.Int64
}

func (w *warmer) init(t *Tokenizer) {
	w.t = t
	w.jobs = make(chan *warmJob, t.opts.QueueLength)
	w.ctx, w.stop = context.WithCancel(context.Background())
	w.pending, w.models, w.failed = map[uint64]bool{}, map[string]bool{}, map[uint64]time.Time{}
	w.engines, w.stab = map[string]*engineBudget{}, map[stabKey]*stability{}
}

func (w *warmer) close() {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	w.stop()
	w.wg.Wait()
}

func (w *warmer) start() {
	w.once.Do(func() {
		for range w.t.opts.Workers {
			w.wg.Add(1)
			go func() {
				defer w.wg.Done()
				for {
					select {
					case <-w.ctx.Done():
						return
					case j := <-w.jobs:
						w.run(j)
					}
				}
			}()
		}
	})
}

func (w *warmer) stats(st *TokenizerStats) {
	st.Dropped, st.Verified, st.Mismatches, st.Refused = w.dropped.Load(), w.verified.Load(), w.mismatches.Load(), w.refused.Load()
	w.mu.Lock()
	for k, s := range w.stab {
		if s.unstable {
			kind := "completions"
			if k.chat {
				kind = "chat"
			}
			st.Unstable = append(st.Unstable, k.model+" ("+kind+")")
		}
	}
	w.mu.Unlock()
	sort.Strings(st.Unstable)
}

// busy reports whether background work is queued or running.
func (w *warmer) busy() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.pending) > 0 || len(w.models) > 0 || len(w.jobs) > 0 {
		return true
	}
	for _, s := range w.stab {
		if s.queued > 0 {
			return true
		}
	}
	return false
}

// stable reports whether p's model may be matched by stable prefixes.
func (w *warmer) stable(p Prompt) bool {
	if w.unstable.Load() == 0 {
		return true
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.stab[stabKey{p.Model, p.Chat}]
	return s == nil || !s.unstable
}

// sampleVerify says whether a prefix hit of p is checked against its
// whole prompt: while the model has fewer than VerifyFirst checks, then
// one lookup in VerifyEvery.
func (w *warmer) sampleVerify(p Prompt) bool {
	n := w.lookups.Add(1)
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.stabOf(p.Model, p.Chat)
	if s.verified+s.queued < int64(w.t.opts.VerifyFirst) || n%int64(w.t.opts.VerifyEvery) == 0 {
		s.queued++
		return true
	}
	return false
}

func (w *warmer) stabOf(model string, chat bool) *stability {
	k := stabKey{model, chat}
	s := w.stab[k]
	if s == nil {
		s = &stability{}
		w.stab[k] = s
	}
	return s
}

// enqueue queues the background work a Lookup of p found needed:
// fetching target (unless hit is target), checking it against the whole
// prompt (verify), or, for a model whose prefixes are not used, fetching
// the whole prompt.
func (w *warmer) enqueue(servers []string, p Prompt, k *keyed, target, hit *cut, verify bool) {
	j := &warmJob{model: p.Model, chat: p.Chat, whole: k.whole}
	var fetch uint64
	switch {
	case target == nil:
		j.wholeOnly = true
		fetch = k.whole
	case hit == target:
		j.cmp = target.key
	default:
		j.key, j.cmp = target.key, target.key
		fetch = target.key
	}
	now := time.Now()
	w.mu.Lock()
	if w.closed || fetch != 0 && (w.pending[fetch] || now.Sub(w.failed[fetch]) < failedFor) || fetch == 0 && !verify {
		if verify {
			w.stabOf(p.Model, p.Chat).queued--
		}
		w.mu.Unlock()
		return
	}
	if !verify && !j.wholeOnly {
		// The first prompts of a model are checked whatever their path.
		if s := w.stabOf(p.Model, p.Chat); s.verified+s.queued < int64(w.t.opts.VerifyFirst) {
			s.queued++
			verify = true
		}
	}
	j.verify = verify
	if fetch != 0 {
		w.pending[fetch] = true
	}
	w.mu.Unlock()
	// Built only now: most lookups queue nothing.
	if j.key != 0 {
		j.body = prefixBody(p, k, target)
	}
	if j.verify || j.wholeOnly {
		j.wholeBody = wholeBody(p, &k.r, k.text)
	}
	j.servers = slices.Clone(servers)
	w.start()
	select {
	case w.jobs <- j:
	default:
		w.dropped.Add(1)
		w.done(j, fetch, false)
	}
}

// refreshModels queues a read of a server's model list for model.
func (w *warmer) refreshModels(servers []string, model string) {
	w.mu.Lock()
	if w.closed || w.models[model] {
		w.mu.Unlock()
		return
	}
	w.models[model] = true
	w.mu.Unlock()
	w.start()
	select {
	case w.jobs <- &warmJob{models: true, model: model, servers: slices.Clone(servers)}:
	default:
		w.dropped.Add(1)
		w.mu.Lock()
		delete(w.models, model)
		w.mu.Unlock()
	}
}

// done ends job j's bookkeeping: fetch is no longer pending (failed:
// not asked for again for a while), its verification no longer queued.
func (w *warmer) done(j *warmJob, fetch uint64, failed bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if fetch != 0 {
		delete(w.pending, fetch)
		if failed {
			w.failed[fetch] = time.Now()
			if len(w.failed) > 4096 {
				now := time.Now()
				for k, at := range w.failed {
					if now.Sub(at) >= failedFor {
						delete(w.failed, k)
					}
				}
			}
		}
	}
	if j.verify {
		w.stabOf(j.model, j.chat).queued--
	}
}

// acquire takes a call from the least busy of servers that has one in
// its budget and no call in flight; "" when none has.
func (w *warmer) acquire(servers []string, calls int) string {
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	rate, burst := w.t.opts.CallsPerSecond, float64(w.t.opts.Burst)
	best, bestBusy := "", 0
	for _, s := range servers {
		e := w.engines[s]
		if e == nil {
			e = &engineBudget{tokens: burst, last: now}
			w.engines[s] = e
		}
		e.tokens = min(burst, e.tokens+now.Sub(e.last).Seconds()*rate)
		e.last = now
		if e.inflight > 0 || e.tokens < float64(calls) {
			continue
		}
		busy := 0
		if w.t.opts.Busy != nil {
			busy = w.t.opts.Busy(w.t.pool, s)
		}
		if best == "" || busy < bestBusy {
			best, bestBusy = s, busy
		}
	}
	if best != "" {
		e := w.engines[best]
		e.tokens -= float64(calls)
		e.inflight++
	}
	if len(w.engines) > 4*MaxServers { // servers come and go
		for s, e := range w.engines {
			if e.inflight == 0 && e.tokens >= burst {
				delete(w.engines, s)
			}
		}
	}
	return best
}

func (w *warmer) release(srv string) {
	w.mu.Lock()
	if e := w.engines[srv]; e != nil {
		e.inflight--
	}
	w.mu.Unlock()
}

// run does one job.
func (w *warmer) run(j *warmJob) {
	fetch := j.key
	if j.wholeOnly {
		fetch = j.whole
	}
	calls := 0
	if j.key != 0 || j.wholeOnly {
		calls++
	}
	if j.verify {
		calls++
	}
	if j.models {
		calls = 1
	}
	srv := ""
	deadline := time.Now().Add(acquireFor)
	for {
		if srv = w.acquire(j.servers, calls); srv != "" || time.Now().After(deadline) {
			break
		}
		t := time.NewTimer(5 * time.Millisecond)
		select {
		case <-w.ctx.Done():
			t.Stop()
			w.finish(j, fetch, false)
			return
		case <-t.C:
		}
	}
	if srv == "" {
		w.dropped.Add(1)
		w.finish(j, fetch, false)
		return
	}
	defer w.release(srv)
	t := w.t
	if j.models {
		_, _ = t.fetchModels(w.ctx, srv)
		w.finish(j, 0, false)
		return
	}
	var prefix []uint32
	switch {
	case j.wholeOnly:
		ids, err := t.call(w.ctx, srv, j.wholeBody)
		if err == nil {
			t.store(j.whole, ids)
		}
		w.finish(j, fetch, err != nil)
		return
	case j.key != 0:
		ids, err := t.call(w.ctx, srv, j.body)
		w.accepted(j, err)
		if err != nil {
			w.finish(j, fetch, true)
			return
		}
		t.store(j.key, ids)
		prefix = ids
	default:
		prefix = t.lookup(j.cmp)
	}
	if j.verify && prefix != nil {
		whole, err := t.call(w.ctx, srv, j.wholeBody)
		if err == nil {
			t.store(j.whole, whole)
			w.check(j, prefix, whole)
		}
	}
	w.finish(j, fetch, false)
}

func (w *warmer) finish(j *warmJob, fetch uint64, failed bool) {
	if j.models {
		w.mu.Lock()
		delete(w.models, j.model)
		w.mu.Unlock()
		return
	}
	w.done(j, fetch, failed)
}

// accepted records whether a server tokenized a prefix of j's model or
// refused it (a template or tokenizer that refuses conversations ending
// with that role): a model whose prefixes are refused, none accepted,
// is matched by whole prompts only from then on.
func (w *warmer) accepted(j *warmJob, err error) {
	var refused *refusedError
	isRefused := errors.As(err, &refused)
	if err != nil && !isRefused {
		return
	}
	if isRefused {
		w.refused.Add(1)
	}
	w.mu.Lock()
	s := w.stabOf(j.model, j.chat)
	if isRefused {
		s.refused++
	} else {
		s.accepted++
	}
	turned := s.refused >= maxRefused && s.accepted == 0 && w.markUnstable(s)
	w.mu.Unlock()
	if turned && w.t.opts.OnUnstable != nil {
		w.t.opts.OnUnstable(j.model, j.chat)
	}
}

// markUnstable marks s unstable; it reports whether it was not. w.mu is
// held.
func (w *warmer) markUnstable(s *stability) bool {
	if s.unstable {
		return false
	}
	s.unstable = true
	w.unstable.Add(1)
	return true
}

// check records whether prefix's ids start the whole prompt's: a model
// whose do not is matched by whole prompts only from then on.
func (w *warmer) check(j *warmJob, prefix, whole []uint32) {
	ok := len(whole) > len(prefix) && slices.Equal(whole[:len(prefix)], prefix)
	w.verified.Add(1)
	w.mu.Lock()
	s := w.stabOf(j.model, j.chat)
	s.verified++
	turned := false
	if !ok {
		w.mismatches.Add(1)
		s.mismatches++
		turned = w.markUnstable(s)
	}
	w.mu.Unlock()
	if turned && w.t.opts.OnUnstable != nil {
		w.t.opts.OnUnstable(j.model, j.chat)
	}
}
