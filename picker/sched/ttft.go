package sched

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
)

// Cold-start values of the TTFT prediction: used only for an endpoint
// about which neither its metrics page nor the picker's own observations
// say anything yet, and pulled towards what they say as soon as they do.
const (
	// DefaultMaxNumSeqs is vLLM's default --max-num-seqs for the OpenAI
	// server (256 on most GPUs; 1024 on large ones): the slot limit
	// assumed until an endpoint's batch is learned (Load.MarkScrape).
	DefaultMaxNumSeqs = 256
	// DefaultPrefillPerToken is the prefill time per prompt token assumed
	// before any is measured (an 8B model on one current GPU computes
	// some 10-20k prompt tokens a second).
	DefaultPrefillPerToken = 50 * time.Microsecond
	// DefaultTTFTBase is the fixed part of a time to first token assumed
	// before any is measured: API server, network, one engine step.
	DefaultTTFTBase = 25 * time.Millisecond
	// DefaultLoRALoad is what loading an adapter into a free slot is
	// assumed to add before any such load is observed.
	DefaultLoRALoad = 50 * time.Millisecond
	// DefaultHold is how long a request is assumed to hold its slot
	// before the endpoint's running time is measured.
	DefaultHold = time.Second
)

// Learning constants of the TTFT model.
const (
	// ttftWindow: the observations a fit mostly reflects (each new one
	// scales the earlier ones' weight by 1-1/ttftWindow).
	ttftWindow = 128
	// ttftPriorWeight: how many observations the prior (metrics page or
	// cold-start values) counts as for the level while there are none (it
	// fades as they come); for the per-token part it counts as much as two
	// observations ttftPriorSpread tokens apart (see solve).
	ttftPriorWeight = 4
	ttftPriorSpread = 1000
	// minPerToken keeps the per-token cost positive, so more work is
	// never predicted to be faster.
	minPerToken = 1e-8
)

// Prediction is one endpoint's predicted time to first token for one
// request, in parts: Total = Base + Wait + Prefill + LoRA.
type Prediction struct {
	// Base is the fixed part: API server, network, the first engine step.
	Base time.Duration
	// Wait is the time before the request's own prefill: the prefill work
	// already queued ahead of it (Queued: what is left of it now, as
	// Ahead tokens), or waiting for a slot when the endpoint runs at its
	// limit or for KV blocks when its cache cannot take the prompt
	// (SlotWait), whichever is longer (prefill ahead runs while a request
	// waits for a slot).
	Wait     time.Duration
	Queued   time.Duration
	SlotWait time.Duration
	// Prefill computes the Uncached part of the request's prompt.
	Prefill time.Duration
	// LoRA is the adapter's load, or waiting for an adapter slot.
	LoRA  time.Duration
	Total time.Duration
	// Delay is what the request's prefill is predicted to add to the
	// requests that reach the endpoint while it runs (each of the
	// endpoint's Rate arrivals a second during Prefill waits half of it
	// on average): the cost a request imposes on others, which TTFTScorer
	// adds to Total when it ranks, so a cache miss goes where it holds up
	// the fewest requests and a cached prefix is not given up for a
	// small gain.
	Delay time.Duration
	Rate  float64
	// Evicts is how many cached blocks the pick would push out of the
	// endpoint's full KV cache, Lost how many of them are the pool's only
	// copy of a prefix in use, and Eviction the prefill the requests that
	// would have hit those blocks will spend computing them again: a
	// TTFTScorer that prices eviction adds it to the cost it ranks by, so
	// a miss goes where it destroys the least, and a request stays on its
	// prefix's server rather than evict another prefix's only copy for a
	// small gain.
	Evicts, Lost int
	Eviction     time.Duration
	// Tokens is the request's prompt estimate, Uncached the part the
	// endpoint is believed not to hold, Ahead the prompt tokens of the
	// requests sent to it whose first token has not come yet.
	Tokens, Uncached, Ahead int64
	// PerToken is the prefill seconds per token used; Observed how many
	// of the endpoint's observed TTFTs (decayed) the fit rests on.
	PerToken float64
	Observed float64
	// Waiting is the endpoint's scraped queue at the prediction (0 when
	// unknown): only observations of requests that met no queue teach
	// the fixed and per-token parts.
	Waiting int
	// measured: the endpoint's own figures made the prediction, not a
	// prior (see poolPrior).
	measured bool
}

// String renders p for decision logs: "ttft=93.0ms (base 21.0 + wait
// 12.0 [prefill ahead 12.0, slot 0.0] + prefill 60.0 + lora 0.0;
// 1200/2600 tokens uncached, 300 ahead) delays others 18.0ms (10.0
// req/s)".
func (p Prediction) String() string {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e6) }
	out := fmt.Sprintf("ttft=%sms (base %s + wait %s [prefill ahead %s, slot %s] + prefill %s + lora %s; %d/%d tokens uncached, %d ahead) delays others %sms (%.1f req/s)",
		ms(p.Total), ms(p.Base), ms(p.Wait), ms(p.Queued), ms(p.SlotWait), ms(p.Prefill), ms(p.LoRA), p.Uncached, p.Tokens, p.Ahead, ms(p.Delay), p.Rate)
	if p.Evicts > 0 {
		out += fmt.Sprintf(" evicts %d blocks (%d the only copy: %sms)", p.Evicts, p.Lost, ms(p.Eviction))
	}
	return out
}

// ttftLearner learns one endpoint's TTFT from the picker's observations.
//
// The fixed and per-token parts come from a linear fit TTFT = base +
// perToken * x, where x is the uncached part of the request's prompt (in
// the picker's token estimate). Only requests that met no queue, no
// prefill ahead and no slot wait teach it: under load, delays the model
// does not explain would otherwise land in the fixed part (and make an
// endpoint look slow for good) or flatten the per-token part (and make
// cached prefixes look worthless). The fit is least squares over
// exponentially decayed observations with a prior (the endpoint's metrics
// page, else the cold-start values), and the per-token part stays within
// a band around the page's own figure.
//
// Slot-wait observations calibrate slot waits, adapter observations the
// adapter load. It keeps the prediction's error too.
type ttftLearner struct {
	mu  sync.Mutex
	cur ttftStats
	fit atomic.Pointer[ttftStats] // immutable copy of cur, read per decision
}

// ttftStats are a learner's decayed sums.
type ttftStats struct {
	// Weighted sums of the quiet observations: weight, x, y, x², xy.
	n, sx, sy, sxx, sxy float64
	// Adapter load time (mean of observed excess when a load was
	// predicted), and its weight.
	lora, loraN float64
	// hold is the mean time from pick to the response's end.
	hold float64
	// slotScale calibrates predicted slot waits against observed ones
	// (1 until a slot wait is observed).
	slotScale, slotN float64
	// Prediction error: count, sum and sum of absolute values of
	// observed - predicted, in seconds (not decayed).
	errN            int64
	errSum, errAbs  float64
	lastObservation time.Time
}

// ttftPrior is what a fit falls back on, and the band its per-token
// part stays in.
type ttftPrior struct {
	base, perToken float64
	lo, hi         float64
}

// poolFitted is a pool's fit (poolFit) with the log of its per-token
// part, as shrinking works on a log scale. It stays apart from ttftPrior,
// which prior returns per candidate per decision: a fifth field there
// made predicted-ttft's decision over 1,000 endpoints ~15 % slower.
type poolFitted struct {
	ttftPrior
	logPer float64
}

// Bands around the prior's per-token cost: the page's own figure (prefill
// time over computed tokens) differs from the picker's view by the
// tokenizer estimate and fixed per-step costs; the cold-start value may
// be off by a lot more.
const (
	pageBand = 3
	coldBand = 20
)

// prior derives the prior from an endpoint's metrics page: prefill time
// per computed token, and the part of the server's own TTFT that is
// neither queueing nor prefill. Missing figures take cold-start values.
func prior(s *metrics.Snapshot) ttftPrior {
	p := ttftPrior{base: DefaultTTFTBase.Seconds(), perToken: DefaultPrefillPerToken.Seconds()}
	band := float64(coldBand)
	if s != nil && s.Perf.PrefillPerToken > 0 {
		p.perToken = s.Perf.PrefillPerToken
		band = pageBand
	}
	if s != nil && s.Perf.TTFT > 0 {
		p.base = max(s.Perf.TTFT-s.Perf.Queue-p.perToken*s.Perf.PrefillTokens, 0.001)
	}
	p.lo, p.hi = p.perToken/band, p.perToken*band
	return p
}

// solve returns base and perToken: a least-squares line through the
// decayed observations and the prior. The per-token part is fitted to how
// TTFT varies with x around the observations' mean, pulled towards the
// prior's as if two more observations sat ttftPriorSpread tokens apart;
// the level at that mean blends the observed mean TTFT with the prior's
// prediction there, the prior counting as ttftPriorWeight observations at
// first and less as observations accumulate. So a few observations move
// the fit a little, many decide it, and observations that all compute the
// same number of tokens set the level and leave the per-token part to the
// prior.
func (st *ttftStats) solve(pr ttftPrior) (base, perToken float64) {
	if st == nil || st.n <= 0 {
		return pr.base, pr.perToken
	}
	mx, my := st.sx/st.n, st.sy/st.n
	vxx := max(st.sxx-st.n*mx*mx, 0)
	cxy := st.sxy - st.n*mx*my
	k := ttftPriorSpread * ttftPriorSpread / 2.0
	n0 := ttftPriorWeight / (1 + st.n/8)
	perToken = (cxy + k*pr.perToken) / (vxx + k)
	if math.IsNaN(perToken) {
		perToken = pr.perToken
	}
	perToken = min(max(perToken, pr.lo, minPerToken), max(pr.hi, minPerToken))
	level := (st.n*my + n0*(pr.base+pr.perToken*mx)) / (st.n + n0)
	return max(level-perToken*mx, 0), perToken
}

// observe adds one observation: x tokens computed before the first
// token, y seconds of TTFT.
func (st *ttftStats) observe(x, y float64) {
	d := 1 - 1.0/ttftWindow
	st.n = st.n*d + 1
	st.sx = st.sx*d + x
	st.sy = st.sy*d + y
	st.sxx = st.sxx*d + x*x
	st.sxy = st.sxy*d + x*y
}

// Observation is one request's observed time to first token on the
// endpoint it was predicted for.
type Observation struct {
	Predicted Prediction
	TTFT      time.Duration
	At        time.Time
}

// ObserveTTFT teaches the endpoint's model one observed time to first
// token (from the pick to the first response bytes of a streamed answer)
// with the prediction made at the pick.
func (l *Load) ObserveTTFT(o Observation) {
	t := &l.ttft
	p := o.Predicted
	y := o.TTFT.Seconds()
	t.mu.Lock()
	defer t.mu.Unlock()
	c := &t.cur
	err := y - p.Total.Seconds()
	c.errN++
	c.errSum += err
	c.errAbs += math.Abs(err)
	c.lastObservation = o.At
	switch {
	case p.LoRA > 0:
		// What the adapter added beyond the rest of the prediction.
		excess := y - (p.Base + p.Wait + p.Prefill).Seconds()
		c.loraN = c.loraN*(1-1.0/ttftWindow) + 1
		c.lora += (max(excess, 0) - c.lora) / min(c.loraN, 16)
	case p.SlotWait > p.Queued:
		// A predicted slot wait: how long the wait really was, as a
		// share of the prediction, calibrates later ones (a slot wait
		// that does not happen fades out). It does not teach the
		// prefill model: its error would land in the fixed part.
		ratio := min(max((y-(p.Base+p.Prefill).Seconds())/p.SlotWait.Seconds(), 0), 4)
		if c.slotN == 0 {
			c.slotScale = 1
		}
		c.slotN = min(c.slotN+1, 16)
		c.slotScale += (ratio - c.slotScale) / c.slotN
	case p.SlotWait == 0 && p.Queued == 0 && p.Waiting == 0:
		// A request that met nothing ahead of it: the fixed and
		// per-token parts.
		c.observe(float64(p.Uncached), y)
	}
	snap := *c
	t.fit.Store(&snap)
}

// ObserveHold records how long a request held the endpoint, from the pick
// to the end of its response: the fallback for the slot hold time when
// the endpoint does not report its running time.
func (l *Load) ObserveHold(d time.Duration) {
	t := &l.ttft
	t.mu.Lock()
	defer t.mu.Unlock()
	c := &t.cur
	if c.hold == 0 {
		c.hold = d.Seconds()
	} else {
		c.hold += (d.Seconds() - c.hold) / 64
	}
	snap := *c
	t.fit.Store(&snap)
}

// TTFTModel is an endpoint's learned TTFT model, for status pages.
type TTFTModel struct {
	// Base and PerToken are the fit in force (prior included); Observed
	// the decayed count of observations behind it.
	Base     time.Duration
	PerToken time.Duration // per 1,000 tokens
	Observed float64
	LoRALoad time.Duration
	// Errors: how many observations were compared with their prediction,
	// the mean error (observed - predicted) and the mean absolute error.
	Compared           int64
	MeanError, MeanAbs time.Duration
}

// TTFTModel returns e's learned model at now.
func (e *Endpoint) TTFTModel(now time.Time) TTFTModel {
	st := e.Load.ttft.fit.Load()
	base, per := st.solve(prior(e.fresh(now)))
	m := TTFTModel{Base: secs(base), PerToken: secs(per * 1000), LoRALoad: DefaultLoRALoad}
	if st != nil {
		m.Observed = st.n
		if st.loraN > 0 {
			m.LoRALoad = secs(st.lora)
		}
		if st.errN > 0 {
			m.Compared = st.errN
			m.MeanError = secs(st.errSum / float64(st.errN))
			m.MeanAbs = secs(st.errAbs / float64(st.errN))
		}
	}
	return m
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// measured reports whether s or st says anything of the endpoint's own
// TTFT: a metrics page with prefill or TTFT figures, or observations.
func measured(s *metrics.Snapshot, st *ttftStats) bool {
	return (s != nil && (s.Perf.PrefillPerToken > 0 || s.Perf.TTFT > 0)) || (st != nil && st.n > 0)
}

// poolPrior is the prior of an endpoint nothing is known about yet: the
// mean fit behind the predictions of the candidates that are measured
// (servers of one pool are usually alike), so a new server is predicted
// like its peers rather than by the cold-start values, which would make
// it look slower or faster than every measured one for good (a server
// that is never picked is never measured). ok is false when no candidate
// is measured.
func poolPrior(preds []Prediction) (pr ttftPrior, ok bool) {
	n := 0
	for _, p := range preds {
		if !p.measured {
			continue
		}
		pr.base += p.Base.Seconds()
		pr.perToken += p.PerToken
		n++
	}
	if n == 0 {
		return ttftPrior{}, false
	}
	pr.base /= float64(n)
	pr.perToken /= float64(n)
	pr.lo, pr.hi = pr.perToken/pageBand, pr.perToken*pageBand
	return pr, true
}

// poolFit is the fit of a pool's measured candidates: the mean of their
// fixed parts and the geometric mean of their per-token parts (each as
// its own fit solves it), each weighted by the observations it rests on
// plus one; ok is false when none is measured. Unweighted, a server seen
// once (its first, cold request) counted as much as one seen a hundred
// times, and the pool's fit it skewed kept it looking slower for good:
// on two idle real vLLM servers cache-aware sent 88-91 % of requests to
// one of them.
func poolFit(now time.Time, eps []*Endpoint) (pr poolFitted, ok bool) {
	return poolFitOf(&Request{Now: now}, eps, make([]ownFit, len(eps)))
}

// ownFit is one endpoint's fit as its own prior and observations solve
// it, for one decision: TTFTScorer solves each candidate's once, for the
// pool's fit and for the candidate's prediction.
type ownFit struct {
	base, per, logPer float64
	// known: measured (the prior is the endpoint's, not the pool's).
	known bool
}

// solveOwn solves e's fit given its fresh snapshot s (nil: none), and
// returns its weight in the pool's fit (observations plus one; kept out
// of ownFit, which one decision holds per candidate: a fifth field made
// cache-aware's decision over 1,000 endpoints ~20 % slower); logPer is
// left for the callers that shrink (poolFitOf).
func solveOwn(e *Endpoint, s *metrics.Snapshot) (ownFit, float64) {
	st := e.Load.ttft.fit.Load()
	base, per := st.solve(prior(s))
	w := 1.0
	if st != nil {
		w += st.n
	}
	return ownFit{base: base, per: per, known: measured(s, st)}, w
}

// poolFitOf is poolFit for the decision req, leaving each candidate's
// own fit in fits (len(eps)).
func poolFitOf(req *Request, eps []*Endpoint, fits []ownFit) (pr poolFitted, ok bool) {
	w, logPer := 0.0, 0.0
	for i, e := range eps {
		f, fw := solveOwn(e, req.freshAt(eps, i))
		if f.known {
			f.logPer = math.Log(max(f.per, minPerToken))
			pr.base += fw * f.base
			logPer += fw * f.logPer
			w += fw
		}
		fits[i] = f
	}
	if w == 0 {
		return poolFitted{}, false
	}
	pr.base /= w
	pr.logPer = logPer / w
	pr.perToken = math.Exp(pr.logPer)
	pr.lo, pr.hi = pr.perToken/pageBand, pr.perToken*pageBand
	return pr, true
}

// shrinkObservations is how many observations an endpoint's own fit
// counts for against the pool's when they are blended (see predict's
// shrink): with the learner's window of 128, a fit resting on a full
// window keeps four fifths of its difference from the pool's.
const shrinkObservations = 32

// predict estimates the request's TTFT on e, given how many leading
// prompt tokens e is believed to hold and whether the request's adapter
// must be loaded (1) or wait for a slot (2) there. An endpoint that is
// not measured yet takes pool as its prior when given (poolPrior,
// poolFit). With shrink, a measured endpoint's fit is pulled towards
// shrink's by how few observations it rests on (n of them keep
// n/(n+shrinkObservations) of the difference, the per-token part on a
// log scale): servers of a pool are usually alike, and fits of a few
// noisy observations otherwise tell identical servers apart.
func predict(req *Request, e *Endpoint, cached int64, lora loraNeed, pool *ttftPrior, shrink *poolFitted) Prediction {
	return predictWith(req, e, e.fresh(req.Now), cached, lora, pool, shrink, nil)
}

// predictWith is predict given e's fresh snapshot s (nil: none) and,
// when not nil, e's own fit solved for this decision (solveOwn).
func predictWith(req *Request, e *Endpoint, s *metrics.Snapshot, cached int64, lora loraNeed, pool *ttftPrior, shrink *poolFitted, own *ownFit) Prediction {
	st := e.Load.ttft.fit.Load()
	var base, per, logPer float64
	var known bool
	if own != nil {
		base, per, logPer, known = own.base, own.per, own.logPer, own.known
		if pool != nil && !known {
			base, per = st.solve(*pool)
		}
	} else {
		pr := prior(s)
		known = measured(s, st)
		if pool != nil && !known {
			pr = *pool
		}
		base, per = st.solve(pr)
		if shrink != nil && known {
			logPer = math.Log(max(per, minPerToken))
		}
	}
	if shrink != nil && known {
		n := 0.0
		if st != nil {
			n = st.n
		}
		a := n / (n + shrinkObservations)
		base = a*base + (1-a)*shrink.base
		per = shrink.perToken
		if a > 0 {
			per = math.Exp(a*logPer + (1-a)*shrink.logPer)
		}
	}
	p := Prediction{Tokens: req.Tokens, PerToken: per, measured: known}
	if st != nil {
		p.Observed = st.n
	}
	p.Uncached = max(req.Tokens-cached, 0)
	p.Queued = e.Load.queuedPrefill(req.Now)
	p.Ahead = int64(p.Queued.Seconds() / per)
	hold := holdTime(s, st)
	slot := max(slotWait(e, s, req.Now, hold), kvWait(e, s, hold, p.Uncached))
	if st != nil && st.slotN > 0 {
		slot *= st.slotScale
	}
	p.SlotWait = secs(slot)
	p.Wait = max(p.SlotWait, p.Queued)
	p.Base = secs(base)
	p.Prefill = secs(float64(p.Uncached) * per)
	if s != nil {
		p.Waiting = s.Waiting
		p.Rate = s.Perf.Rate
	}
	p.Delay = secs(p.Rate * p.Prefill.Seconds() * p.Prefill.Seconds() / 2)
	switch lora {
	case loraLoad:
		p.LoRA = DefaultLoRALoad
		if st != nil && st.loraN > 0 {
			p.LoRA = secs(st.lora)
		}
	case loraWaitSlot:
		p.LoRA = secs(hold)
	}
	p.Total = max(p.Base+p.Wait+p.Prefill+p.LoRA, time.Microsecond)
	return p
}

// holdTime is how long a running request holds its slot: the server's
// mean running time, else the picker's observed request time.
func holdTime(s *metrics.Snapshot, st *ttftStats) float64 {
	switch {
	case s != nil && s.Perf.Inference > 0:
		return s.Perf.Inference
	case st != nil && st.hold > 0:
		return st.hold
	}
	return DefaultHold.Seconds()
}

// slotWait predicts how long a new request waits for a slot on e: the
// requests that would wait there if it were sent now, each freeing a
// slot after a share hold/batch of a hold time. Once the server's batch
// is learned (its max-num-seqs, or what its KV cache holds: see
// Load.MarkScrape) that count is waitingIfSent's, the same the queue
// scorer and the admission queue use; until then the batch is taken as
// DefaultMaxNumSeqs and the server holds its scraped running and waiting
// requests, or the picker's in-flight ones when more; a server whose
// scrape shows requests waiting is at its limit whatever its batch.
func slotWait(e *Endpoint, s *metrics.Snapshot, now time.Time, hold float64) float64 {
	if s != nil {
		if n, exact := waitingIfSent(e, s, now); exact {
			return n * hold / float64(e.Load.batch.Load())
		}
		if s.Waiting > 0 {
			// Requests wait there, so it is at its limit, though its
			// batch is not learned (it reports nothing running, or the
			// scrape is not marked yet): the new request waits behind
			// them for the running ones' slots.
			return float64(s.Waiting+1) * hold / float64(max(s.Running, 1))
		}
	}
	inflight := e.Load.InFlightRequests.Load()
	occupied := inflight
	if s != nil {
		occupied = max(int64(s.Running+s.Waiting), inflight)
	}
	over := occupied + 1 - DefaultMaxNumSeqs
	if over <= 0 {
		return 0
	}
	return float64(over) * hold / DefaultMaxNumSeqs
}

// StartPrefill counts a request's prefill work on the endpoint: tokens to
// compute, taking d, from now. The work queues behind what is counted
// already (the endpoint's prefill clock moves on by d from the later of
// now and where it stood), so the wait a new request is predicted is
// what remains of the queued work at its time, and work finishing as it
// goes needs no correction. EndPrefill takes it off again, at the first
// token; with nothing counted the clock restarts from the next request.
func (l *Load) StartPrefill(tokens int64, d time.Duration, now time.Time) {
	busy := l.PrefillRequests.Add(1) > 1
	l.PrefillTokens.Add(tokens)
	t := now.UnixNano()
	for {
		cur := l.prefillUntil.Load()
		start := t
		if busy && cur > t {
			start = cur
		}
		if l.prefillUntil.CompareAndSwap(cur, start+int64(d)) {
			return
		}
	}
}

// EndPrefill takes back work StartPrefill counted.
func (l *Load) EndPrefill(tokens int64) {
	l.PrefillRequests.Add(-1)
	l.PrefillTokens.Add(-tokens)
}

// queuedPrefill is what remains at now of the prefill work counted on the
// endpoint.
func (l *Load) queuedPrefill(now time.Time) time.Duration {
	if l.PrefillRequests.Load() <= 0 {
		return 0
	}
	return max(time.Duration(l.prefillUntil.Load()-now.UnixNano()), 0)
}

// kvWait predicts how long a request of uncached prompt tokens waits for
// KV blocks on e: the blocks it and the prefill work already counted there
// need beyond the free ones (as of the scrape) come free as running
// requests end, a share hold/used of a hold time per block. A server that
// does not report its block count is never predicted to wait for blocks.
// Tokens are the picker's estimate (4 characters a token; prompts of
// English text run a little under that), so the demand errs large.
func kvWait(e *Endpoint, s *metrics.Snapshot, hold float64, uncached int64) float64 {
	if s == nil || s.NumBlocks <= 0 || s.BlockSize <= 0 {
		return 0
	}
	total := float64(s.NumBlocks)
	used := s.KVUsage * total
	free := total - used
	need := float64(uncached+max(e.Load.PrefillTokens.Load(), 0)) / float64(s.BlockSize)
	if need <= free || used < 1 {
		return 0
	}
	return min(need-free, used) * hold / used
}

// loraNeed says what a request's adapter needs on an endpoint.
type loraNeed int

const (
	loraNone     loraNeed = iota // base model, or the adapter is running
	loraLoad                     // a free adapter slot: load it
	loraWaitSlot                 // every slot taken by other adapters
)

// cost is what TTFTScorer ranks by: the request's predicted TTFT plus
// the delay its prefill is predicted to add to others, plus (when the
// scorer prices eviction) the prefill its evictions will cost others.
func (p Prediction) cost() time.Duration { return p.Total + p.Delay + p.Eviction }

// TTFTScorer ranks endpoints by predicted time to first token (see
// Prediction), counting what the request's prefill will add to the
// requests that arrive behind it (Prediction.Delay): each candidate
// scores min(cost)/cost, so the best scores 1 and the picker's order is
// the predicted order. Matching the prompt's
// blocks against the prefix index tells what each endpoint holds; Picked
// records the blocks on the chosen endpoint, like prefixScorer. The
// predictions stay in the Scratch (Scratch.Prediction) for the caller to
// account the pick's prefill work and, once the first token is seen,
// teach the endpoint's model (Load.ObserveTTFT).
type TTFTScorer struct {
	Index *prefix.Index
	// Residency tells what each endpoint holds and what a pick would
	// evict; nil: the estimating Index (IndexResidency).
	Residency Residency
	// EvictionCost prices eviction: a candidate whose cache is full pays
	// for the prefixes in use whose only copy the pick would evict
	// (Prediction.Eviction).
	EvictionCost bool
	// Shrink pulls each endpoint's learned fit towards the pool's (see
	// predict), and predicts an endpoint not measured yet by the pool's.
	Shrink bool
}

// residency is t.Residency, or the estimating index.
func (t *TTFTScorer) residency() Residency {
	if t.Residency != nil {
		return t.Residency
	}
	return IndexResidency{Index: t.Index}
}

// evictionMargin widens the candidates whose evictions are looked up
// beyond those that could win on cost alone (cost below the best final
// cost): other scorers of the profile (session 0.2) can lift a candidate
// up to a quarter more expensive over the best.
const evictionMargin = 1.25

// Name implements Scorer.
func (*TTFTScorer) Name() string { return ScorerTTFT }

// Score implements Scorer.
func (t *TTFTScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	res := t.residency()
	m := req.matchPrefixes(res, eps)
	sc := req.scratch
	if sc == nil {
		sc = new(Scratch)
	}
	adapter := isAdapter(req, eps)
	need := func(i int) loraNeed {
		if adapter {
			switch loraAffinityOf(req, req.freshAt(eps, i)) {
			case loraFreeSlot:
				return loraLoad
			case loraNoSlot:
				return loraWaitSlot
			}
		}
		return loraNone
	}
	if cap(sc.preds) < len(eps) {
		sc.preds = make([]Prediction, len(eps))
	}
	sc.preds = sc.preds[:len(eps)]
	var fit *poolFitted
	var pool *ttftPrior
	var fits []ownFit
	if t.Shrink {
		if cap(sc.fits) < len(eps) {
			sc.fits = make([]ownFit, len(eps))
		}
		fits = sc.fits[:len(eps)]
		if f, ok := poolFitOf(req, eps, fits); ok {
			fit, pool = &f, &f.ttftPrior
		}
	}
	unmeasured := 0
	for i, e := range eps {
		cached, _ := req.cachedTokens(i, m)
		var own *ownFit
		if fits != nil {
			own = &fits[i]
		}
		sc.preds[i] = predictWith(req, e, req.freshAt(eps, i), cached, need(i), pool, fit, own)
		if !sc.preds[i].measured {
			unmeasured++
		}
	}
	// Candidates not measured yet are predicted again like their
	// measured peers (the pool's prior is worked out only for them).
	if unmeasured > 0 && fit == nil {
		if pool, ok := poolPrior(sc.preds); ok {
			for i, e := range eps {
				if !sc.preds[i].measured {
					cached, _ := req.cachedTokens(i, m)
					sc.preds[i] = predictWith(req, e, req.freshAt(eps, i), cached, need(i), &pool, nil, nil)
				}
			}
		}
	}
	if t.EvictionCost {
		priceEvictions(req, res, eps, sc.preds, fit)
	}
	best := time.Duration(math.MaxInt64)
	for i := range eps {
		best = min(best, sc.preds[i].cost())
	}
	for i := range eps {
		scores[i] = float64(best) / float64(sc.preds[i].cost())
	}
	sc.predsOK = true
}

// priceEvictions adds to the predictions the prefill their evictions
// will cost others (Prediction.Eviction). The cheapest candidate is
// priced first; then only those whose cost before eviction is within
// evictionMargin of the best after it, as eviction only adds to a cost
// (the others keep a cost too low, which only matters to their place
// among the fallbacks). An evicted block is priced at the pool's prefill
// per token (fit) when known: its next request computes it wherever it
// goes.
func priceEvictions(req *Request, res Residency, eps []*Endpoint, preds []Prediction, fit *poolFitted) {
	bt := int64(req.BlockTokens)
	if bt <= 0 {
		bt = prefix.DefaultBlockTokens
	}
	price := func(i int) {
		p := &preds[i]
		blocks := int((p.Uncached + bt - 1) / bt)
		if blocks <= 0 {
			return
		}
		ev := res.Evicts(req, eps[i].Address, blocks)
		per := p.PerToken
		if fit != nil {
			per = fit.perToken
		}
		p.Evicts, p.Lost = ev.Blocks, ev.Lost
		p.Eviction = secs(float64(int64(ev.Lost)*bt) * per)
	}
	first := 0
	for i := range preds {
		if preds[i].cost() < preds[first].cost() {
			first = i
		}
	}
	price(first)
	final := preds[first].cost()
	for i := range preds {
		if i != first && float64(preds[i].cost()) < evictionMargin*float64(final) {
			price(i)
			final = min(final, preds[i].cost())
		}
	}
}

// Picked implements Observer: the prompt's blocks are now on primary.
func (t *TTFTScorer) Picked(req *Request, primary *Endpoint) {
	(&prefixScorer{Index: t.Index}).Picked(req, primary)
}

// explain implements explainer.
func (t *TTFTScorer) explain(sc *Scratch, addr string) string {
	if p, ok := sc.Prediction(addr); ok {
		return p.String()
	}
	return ""
}

// Predict returns the request's predicted TTFT on e alone, matching the
// prompt against the index first (call it before the pick is recorded).
// It is how a replica prices a pick another replica made.
func (t *TTFTScorer) Predict(req *Request, e *Endpoint) Prediction {
	m := [1]int{}
	if req.Now.IsZero() {
		req.Now = time.Now()
	}
	t.residency().Held(req, []string{e.Address}, m[:])
	bt := int64(req.BlockTokens)
	if bt <= 0 {
		bt = prefix.DefaultBlockTokens
	}
	return predict(req, e, int64(m[0])*bt, loraNone, nil, nil)
}

// Prediction returns the TTFT scorer's prediction for addr in the last
// Rank; ok is false when it did not run or addr was not a candidate.
func (sc *Scratch) Prediction(addr string) (Prediction, bool) {
	if !sc.predsOK {
		return Prediction{}, false
	}
	for i, n := range sc.names {
		if n == addr && i < len(sc.preds) {
			return sc.preds[i], true
		}
	}
	return Prediction{}, false
}

// Predictor returns the profile's TTFT scorer, or nil when it has none.
func (p *Profile) Predictor() *TTFTScorer {
	for _, ws := range p.Scorers {
		if t, ok := ws.Scorer.(*TTFTScorer); ok && ws.Weight != 0 {
			return t
		}
	}
	return nil
}

// explainer is implemented by scorers that add a per-candidate detail to
// decision explanations.
type explainer interface {
	explain(sc *Scratch, addr string) string
}

func explainDetail(p *Profile, sc *Scratch, addr string) string {
	var parts []string
	for _, ws := range p.Scorers {
		if x, ok := ws.Scorer.(explainer); ok && ws.Weight != 0 {
			if d := x.explain(sc, addr); d != "" {
				parts = append(parts, d)
			}
		}
	}
	return strings.Join(parts, " ")
}
