package sched

import (
	"math"
	"slices"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
)

// Spans below which load differences are treated as small: a scorer maps
// the least loaded candidate to 1 and a candidate span above it (or the
// most loaded, if further) to 0, so one extra queued request does not swing
// a whole weight.
const (
	queueSpan   = 4     // requests
	RunningSpan = 16    // requests
	TokenSpan   = 16384 // prompt tokens in flight
)

// queueLoad estimates the requests queued at e: the scraped waiting count
// plus the requests this picker sent that the latest scrape cannot show yet
// (in flight beyond scraped running + waiting). Without fresh metrics it is
// the in-flight count.
func queueLoad(e *Endpoint, now time.Time) float64 {
	return queueLoadOf(e, e.fresh(now))
}

// queueLoadOf is queueLoad given e's fresh snapshot (nil: none).
func queueLoadOf(e *Endpoint, s *metrics.Snapshot) float64 {
	inflight := e.Load.InFlightRequests.Load()
	if s == nil {
		return float64(inflight)
	}
	excess := inflight - int64(s.Running+s.Waiting)
	return float64(s.Waiting) + float64(max(excess, 0))
}

// probeAfter is how long a learned batch goes unconfirmed before a probe
// tests whether it grew.
const probeAfter = 5 * time.Second

// waitingIfSent estimates how many requests would wait in e's server
// queue if one more were sent now; exact reports that the estimate is
// this one, and not, without a learned batch, how many wait now.
//
// The estimate uses the fresh snapshot s and what the picker sent and saw
// finish since that scrape (the in-flight change since MarkScrape): the
// server holds its scraped running and waiting plus that change, or the
// picker's own in-flight count when larger (requests still in the
// server's front end, sent but not yet queued, are in neither gauge).
// What it would hold beyond its batch waits. A finished request thus
// frees its slot as soon as it ends, not at the next scrape, and the
// admission queue dispatches into it at once. When the latest scrape
// showed the batch exactly full and nothing waiting, and no scrape
// confirmed the batch for probeAfter, one request beyond it is allowed,
// a probe: it runs if the batch has grown (a shorter mix of prompts
// leaves KV for more), and the next scrape learns that; if not, it waits
// first in the server's queue, so probes stay rare (each delays one
// higher-priority request by one slot).
//
// Until the batch is known (a scrape with requests waiting), the server
// has taken everything so far: the estimate is the scraped waiting count
// (0). Without a mark for s, it is queueLoad.
func waitingIfSent(e *Endpoint, s *metrics.Snapshot, now time.Time) (n float64, exact bool) {
	m := e.Load.mark.Load()
	if m == nil || !m.at.Equal(s.LastSuccess) {
		return queueLoad(e, now), false
	}
	b := e.Load.batch.Load()
	if b <= 0 {
		return float64(s.Waiting), false
	}
	inFlight := e.Load.InFlightRequests.Load()
	held := max(int64(s.Running+s.Waiting)+inFlight-m.inFlight, inFlight)
	if s.Waiting == 0 && int64(s.Running) >= b && now.UnixNano()-e.Load.batchSeen.Load() > int64(probeAfter) {
		held-- // the probe
	}
	return float64(max(held+1-b, 0)), true
}

// QueueIfSent is how many requests would wait in e's server queue if one
// more were sent now, as the saturation rule counts them (Thresholds):
// from a fresh scrape and what the picker sent and saw finish since, and
// for an endpoint never scraped 0 (it is not judged); with its freshness,
// so that a caller can leave out endpoints whose scrapes fail.
func (e *Endpoint) QueueIfSent(now time.Time) (float64, Freshness) {
	f, s := e.Freshness(now)
	if f != Fresh {
		return 0, f
	}
	n, _ := waitingIfSent(e, s, now)
	return n, f
}

// staleWaitingIfSent is waitingIfSent for an endpoint whose metrics are
// stale: what the picker itself sent and saw finish since the last good
// scrape (its values and mark are kept while scrapes fail), against the
// batch learned before. known is false when no batch was learned: then
// nothing says how much the server takes.
func staleWaitingIfSent(e *Endpoint) (n float64, known bool) {
	b := e.Load.batch.Load()
	if b <= 0 {
		return 0, false
	}
	inFlight := e.Load.InFlightRequests.Load()
	held := inFlight
	if s, m := e.Snapshot(), e.Load.mark.Load(); s != nil && m != nil && m.at.Equal(s.LastSuccess) {
		held = max(int64(s.Running+s.Waiting)+inFlight-m.inFlight, inFlight)
	}
	return float64(max(held+1-b, 0)), true
}

// lowerIsBetter turns the loads in scores (NaN = unknown) into
// 1 - (v-lo)/max(hi-lo, span); unknown entries get the mean of the known
// scores, or 1 when none is known.
func lowerIsBetter(scores []float64, span float64) {
	lo, hi, known := math.Inf(1), math.Inf(-1), 0
	for _, v := range scores {
		if math.IsNaN(v) {
			continue
		}
		known++
		lo, hi = min(lo, v), max(hi, v)
	}
	d := max(hi-lo, span)
	if d <= 0 {
		d = 1
	}
	sum := 0.0
	for i, v := range scores {
		if math.IsNaN(v) {
			continue
		}
		scores[i] = 1 - (v-lo)/d
		sum += scores[i]
	}
	fillUnknown(scores, known, sum)
}

// fillUnknown replaces NaN scores with the mean of the known ones (1 when
// none is known).
func fillUnknown(scores []float64, known int, sum float64) {
	if known == len(scores) {
		return
	}
	neutral := 1.0
	if known > 0 {
		neutral = sum / float64(known)
	}
	for i, v := range scores {
		if math.IsNaN(v) {
			scores[i] = neutral
		}
	}
}

// queueScorer prefers short queues: scraped waiting requests plus the
// requests sent since the scrape (see queueLoad), normalised with a span of
// queueSpan requests.
type queueScorer struct{}

// Name implements Scorer.
func (queueScorer) Name() string { return "queue" }

// Score implements Scorer.
func (queueScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	for i, e := range eps {
		scores[i] = queueLoadOf(e, req.freshAt(eps, i))
	}
	lowerIsBetter(scores[:len(eps)], queueSpan)
}

// runningScorer prefers fewer running requests (scraped), normalised with a
// span of RunningSpan; neutral without fresh metrics.
type runningScorer struct{}

// Name implements Scorer.
func (runningScorer) Name() string { return "running" }

// Score implements Scorer.
func (runningScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	for i := range eps {
		scores[i] = math.NaN()
		if s := req.freshAt(eps, i); s != nil {
			scores[i] = float64(s.Running)
		}
	}
	lowerIsBetter(scores[:len(eps)], RunningSpan)
}

// kvKnee is the KV-cache utilisation below which kvCacheScorer sees no
// difference between endpoints.
const kvKnee = 0.6

// kvCacheScorer steers away from nearly full KV caches: 1 up to kvKnee
// utilisation (scraped), then falling linearly to 0 at a full cache;
// neutral without fresh metrics. Below the knee utilisation does not delay
// a request (admission and preemption only bite near full), and a stale
// fine-grained KV score would override the random tie-breaks that spread
// simultaneous requests.
type kvCacheScorer struct{}

// Name implements Scorer.
func (kvCacheScorer) Name() string { return "kv-cache" }

// Score implements Scorer.
func (kvCacheScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	known, sum := 0, 0.0
	for i := range eps {
		scores[i] = math.NaN()
		if s := req.freshAt(eps, i); s != nil {
			scores[i] = min(max((1-s.KVUsage)/(1-kvKnee), 0), 1)
			known++
			sum += scores[i]
		}
	}
	fillUnknown(scores[:len(eps)], known, sum)
}

// leastInFlight scores endpoints by the requests this picker has in flight
// to them, fewest best, with in-flight tokens as a strict tie-breaker: the
// key requests+tokens/(maxTokens+1) orders lexicographically and is min-max
// normalised into [0,1]. It needs no metrics.
type leastInFlight struct{}

// Name implements Scorer.
func (leastInFlight) Name() string { return "in-flight" }

// Score implements Scorer.
func (leastInFlight) Score(_ *Request, eps []*Endpoint, scores []float64) {
	var maxTok int64
	for _, e := range eps {
		if t := e.Load.InFlightTokens.Load(); t > maxTok {
			maxTok = t
		}
	}
	for i, e := range eps {
		scores[i] = float64(e.Load.InFlightRequests.Load()) + float64(e.Load.InFlightTokens.Load())/float64(maxTok+1)
	}
	lowerIsBetter(scores[:len(eps)], 0)
}

// inFlightTokensScorer prefers endpoints with fewer estimated prompt tokens
// in flight from this picker (outstanding prefill work is what delays a new
// request's first token), normalised with a span of TokenSpan.
type inFlightTokensScorer struct{}

// Name implements Scorer.
func (inFlightTokensScorer) Name() string { return "in-flight-tokens" }

// Score implements Scorer.
func (inFlightTokensScorer) Score(_ *Request, eps []*Endpoint, scores []float64) {
	for i, e := range eps {
		scores[i] = float64(e.Load.InFlightTokens.Load())
	}
	lowerIsBetter(scores[:len(eps)], TokenSpan)
}

// loadGuard bounds affinity scorers: an endpoint whose queue (queueLoad)
// exceeds the least loaded candidate's by Queue requests, or whose
// in-flight prompt tokens exceed the least's by Tokens, loses its affinity;
// between half the threshold and the threshold the affinity fades
// linearly. Zero fields disable that check.
type loadGuard struct {
	Queue  float64
	Tokens float64
}

// DefaultLoadGuard is the guard the default profile uses.
var DefaultLoadGuard = loadGuard{Queue: 8, Tokens: 32768}

// factors writes each candidate's affinity multiplier in [0,1] into out.
func (g loadGuard) factors(req *Request, eps []*Endpoint, out []float64) {
	if g.Queue <= 0 && g.Tokens <= 0 {
		for i := range eps {
			out[i] = 1
		}
		return
	}
	qlo, tlo := math.Inf(1), int64(math.MaxInt64)
	for i, e := range eps {
		out[i] = queueLoadOf(e, req.freshAt(eps, i))
		qlo = min(qlo, out[i])
		tlo = min(tlo, e.Load.InFlightTokens.Load())
	}
	for i, e := range eps {
		f := 1.0
		if g.Queue > 0 {
			f = fade(out[i]-qlo, g.Queue)
		}
		if g.Tokens > 0 {
			f = min(f, fade(float64(e.Load.InFlightTokens.Load()-tlo), g.Tokens))
		}
		out[i] = f
	}
}

// fade is 1 up to limit/2, then falls linearly to 0 at limit.
func fade(x, limit float64) float64 {
	return min(max((limit-x)/(limit/2), 0), 1)
}

// prefixScorer prefers endpoints that likely hold the prompt's leading KV
// blocks: the fraction of the request's block hashes (Request.Hashes) the
// endpoint matches in Index, times the load guard's factor, so a hot prefix
// spills to other endpoints once its holder queues up. Picked records the
// hashes on the chosen endpoint and sizes its LRU from the scraped KV
// block count.
type prefixScorer struct {
	Index *prefix.Index
	Guard loadGuard
}

// matchPrefixes records, for each of eps in order, how many of the
// request's leading blocks res says it holds (all 0 without one), in the
// request's scratch (a throwaway one when it has none), so PrefixMatch
// can report them; it returns the counts. Where the request's exact view
// (Request.Cache) knows a candidate, the count is its cached tokens in
// blocks of BlockTokens, and cachedTokens reports them.
func (req *Request) matchPrefixes(res Residency, eps []*Endpoint) []int {
	sc := req.scratch
	if sc == nil {
		sc = new(Scratch)
		req.scratch = sc // outside Rank (tests, Predict): the request's own
	}
	sc.names = sc.names[:0]
	for _, e := range eps {
		sc.names = append(sc.names, e.Address)
	}
	if cap(sc.matched) < len(eps) {
		sc.matched = make([]int, len(eps))
	}
	m := sc.matched[:len(eps)]
	if res != nil {
		res.Held(req, sc.names, m)
	} else {
		clear(m)
	}
	sc.cached, sc.exact = sc.cached[:0], sc.exact[:0]
	if req.Cache != nil {
		// The estimate before the exact view overrides it: where the
		// prompt was sent, for prefixScorer when no server holds any.
		sc.estimated = append(sc.estimated[:0], m...)
		if cap(sc.cached) < len(eps) {
			sc.cached, sc.exact = make([]int, len(eps)), make([]bool, len(eps))
		}
		sc.cached, sc.exact = sc.cached[:len(eps)], sc.exact[:len(eps)]
		req.Cache.CachedTokens(sc.names, sc.cached, sc.exact)
		bt := req.BlockTokens
		if bt <= 0 {
			bt = prefix.DefaultBlockTokens
		}
		for i, ok := range sc.exact {
			if ok {
				m[i] = sc.cached[i] / bt
			}
		}
	}
	sc.matchedOK = true
	return m
}

// cachedTokens is what the last matchPrefixes believes candidate i holds
// of the prompt, in tokens, and how much of the prompt that is (0..1):
// exact where Request.Cache knows it, else the estimate (m[i] blocks).
func (req *Request) cachedTokens(i int, m []int) (tokens int64, share float64) {
	if sc := req.scratch; sc != nil && i < len(sc.exact) && sc.exact[i] {
		return int64(sc.cached[i]), float64(sc.cached[i]) / float64(max(req.Cache.Tokens(), 1))
	}
	bt := int64(req.BlockTokens)
	if bt <= 0 {
		bt = prefix.DefaultBlockTokens
	}
	if len(req.Hashes) > 0 {
		share = float64(m[i]) / float64(len(req.Hashes))
	}
	return int64(m[i]) * bt, share
}

// Name implements Scorer.
func (*prefixScorer) Name() string { return "prefix" }

// Score implements Scorer.
func (p *prefixScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	if (p.Index == nil || len(req.Hashes) == 0) && req.Cache == nil {
		return // all zero: no preference
	}
	m := req.matchPrefixes(IndexResidency{Index: p.Index}, eps)
	any := false
	for i := range m {
		_, share := req.cachedTokens(i, m)
		any = any || share > 0
	}
	if !any {
		// No server holds any of the prompt (by the exact view where
		// there is one): every candidate computes it all. Where the
		// estimate remembers sending it (stale: evicted since) keeps a
		// prompt's group on its server, so that its miss evicts that
		// server's own prompts rather than another's.
		sc := req.scratch
		if req.Cache == nil || len(req.Hashes) == 0 || sc == nil || len(sc.estimated) < len(eps) || !slices.ContainsFunc(sc.estimated[:len(eps)], func(n int) bool { return n > 0 }) {
			return
		}
		p.Guard.factors(req, eps, scores)
		for i := range eps {
			scores[i] *= float64(sc.estimated[i]) / float64(len(req.Hashes))
		}
		return
	}
	p.Guard.factors(req, eps, scores)
	for i := range eps {
		_, share := req.cachedTokens(i, m)
		scores[i] *= share
	}
}

// Picked implements Observer.
func (p *prefixScorer) Picked(req *Request, primary *Endpoint) {
	if p.Index == nil || len(req.Hashes) == 0 {
		return
	}
	LearnPrefix(p.Index, primary, req.Hashes)
}

// LearnPrefix records in idx that e holds the prompt blocks hashes, after
// sizing e's LRU from its scraped KV block count when that changed: what
// a server computed or received is in its cache.
func LearnPrefix(idx *prefix.Index, e *Endpoint, hashes []uint64) {
	if s := e.Snapshot(); s != nil && s.NumBlocks > 0 {
		if old := e.Load.cacheBlocks.Load(); old != int64(s.NumBlocks) &&
			e.Load.cacheBlocks.CompareAndSwap(old, int64(s.NumBlocks)) {
			idx.SetCapacity(e.Address, s.NumBlocks)
		}
	}
	idx.Add(e.Address, hashes)
}

// LoRA affinity levels.
const (
	loraUnknown  = -1.0
	loraNoSlot   = 0.0
	loraFreeSlot = 0.5
	loraRunning  = 1.0
)

func target(req *Request) string {
	if req.TargetModel != "" {
		return req.TargetModel
	}
	return req.Model
}

// isAdapter reports whether the request's target model is a LoRA adapter:
// some candidate with fresh LoRA metrics (vllm:lora_requests_info) lists it
// as running or waiting. An adapter no server has run recently is not
// recognised and scheduled like a base model.
func isAdapter(req *Request, eps []*Endpoint) bool {
	t := target(req)
	for _, e := range eps {
		// Freshness last: most servers run no adapters at all.
		if s := e.Snapshot(); s != nil && s.MaxLoras > 0 &&
			(slices.Contains(s.RunningAdapters, t) || slices.Contains(s.WaitingAdapters, t)) && isFresh(s, req.Now) {
			return true
		}
	}
	return false
}

// loraAffinity rates e for the request's adapter: running there 1, a free
// adapter slot 0.5, otherwise (only waiting, or every slot taken by other
// adapters) 0; -1 without fresh LoRA metrics.
func loraAffinity(req *Request, e *Endpoint) float64 {
	return loraAffinityOf(req, e.fresh(req.Now))
}

// loraAffinityOf is loraAffinity given the endpoint's fresh snapshot.
func loraAffinityOf(req *Request, s *metrics.Snapshot) float64 {
	if s == nil || s.MaxLoras <= 0 {
		return loraUnknown
	}
	if slices.Contains(s.RunningAdapters, target(req)) {
		return loraRunning
	}
	if len(s.RunningAdapters) < s.MaxLoras {
		return loraFreeSlot
	}
	return loraNoSlot
}

// loraScorer prefers, for adapter requests, endpoints already running the
// adapter, then endpoints with a free adapter slot; base-model requests
// get a neutral score.
type loraScorer struct{}

// Name implements Scorer.
func (loraScorer) Name() string { return "lora" }

// Score implements Scorer.
func (loraScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	if !isAdapter(req, eps) {
		for i := range eps {
			scores[i] = 1
		}
		return
	}
	known, sum := 0, 0.0
	for i := range eps {
		scores[i] = math.NaN()
		if a := loraAffinityOf(req, req.freshAt(eps, i)); a != loraUnknown {
			scores[i] = a
			known++
			sum += a
		}
	}
	fillUnknown(scores[:len(eps)], known, sum)
}

// sessionScorer keeps a session (Request.Session) on the endpoint that
// served its previous request: that endpoint scores 1, others 0. When the
// endpoint is gone, filtered out (unhealthy, draining) or overloaded per
// Guard.Queue, no one scores and normal scoring decides; Picked then
// rebinds the session.
type sessionScorer struct {
	Table *Sessions
	Guard loadGuard
}

// Name implements Scorer.
func (*sessionScorer) Name() string { return "session" }

// Score implements Scorer.
func (s *sessionScorer) Score(req *Request, eps []*Endpoint, scores []float64) {
	if s.Table == nil || req.Session == "" {
		return
	}
	addr, ok := s.Table.Get(req.Session, req.Now)
	if !ok {
		return
	}
	for i, e := range eps {
		if e.Address != addr {
			continue
		}
		if s.Guard.Queue > 0 {
			lo := math.Inf(1)
			for j, o := range eps {
				lo = min(lo, queueLoadOf(o, req.freshAt(eps, j)))
			}
			if queueLoadOf(e, req.freshAt(eps, i))-lo >= s.Guard.Queue {
				return // overloaded: let load decide
			}
		}
		scores[i] = 1
		return
	}
}

// Picked implements Observer.
func (s *sessionScorer) Picked(req *Request, primary *Endpoint) {
	if s.Table != nil && req.Session != "" {
		s.Table.Put(req.Session, primary.Address, req.Now)
	}
}
