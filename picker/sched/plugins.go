package sched

import (
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
)

// Filter names (Filter.Name), e.g. for Scratch.EmptiedBy.
const (
	filterNotDraining = "not-draining"
	FilterHealthy     = "healthy"
	FilterSubset      = "subset-hint"
	FilterModel       = "model"
	FilterLoRASlot    = "lora-slot"
	FilterRole        = "role"
)

// RoleFilter keeps the endpoints of a disaggregated pool that may receive
// a client's request: those whose role decodes (decode, or both). The
// picker puts it first in such a pool's profile, so a prefill server is
// never a destination, and the pool's other filters (health above all)
// judge the decode servers alone, as EDS, which has only them, does.
type RoleFilter struct{}

// Name implements Filter.
func (RoleFilter) Name() string { return FilterRole }

// Filter implements Filter.
func (RoleFilter) Filter(_ *Request, eps []*Endpoint) []*Endpoint {
	out := eps[:0]
	for _, e := range eps {
		if e.Role.Decodes() {
			out = append(out, e)
		}
	}
	return out
}

// drainingFilter drops endpoints that are draining.
type drainingFilter struct{}

// Name implements Filter.
func (drainingFilter) Name() string { return filterNotDraining }

// Filter implements Filter.
func (drainingFilter) Filter(_ *Request, eps []*Endpoint) []*Endpoint {
	out := eps[:0]
	for _, e := range eps {
		if !e.Draining {
			out = append(out, e)
		}
	}
	return out
}

// modelFilter keeps the endpoints that serve the request's target model
// (or the client's model name): those that advertise it (a models list in
// the configuration or Consul meta), or, advertising nothing, whose server
// lists it in GET /v1/models, or whose server has not answered that yet.
// It never falls back to servers known not to serve the name: such a
// server would answer its own 404, so no candidate is the honest answer
// (503, no ready endpoint serves the model). AnyAdapter, for pools whose
// servers load LoRA adapters on demand, keeps every endpoint.
type modelFilter struct {
	AnyAdapter bool
}

// Name implements Filter.
func (modelFilter) Name() string { return FilterModel }

// Filter implements Filter.
func (f modelFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
	if f.AnyAdapter || (req.TargetModel == "" && req.Model == "") {
		return eps
	}
	out := eps[:0]
	for _, e := range eps {
		if servesRequest(e, req) {
			out = append(out, e)
		}
	}
	return out
}

func servesRequest(e *Endpoint, req *Request) bool {
	return e.serves(req.TargetModel, true) || (req.Model != req.TargetModel && e.serves(req.Model, true))
}

// subsetFilter keeps only endpoints named in the request's subset hint when
// one is present.
type subsetFilter struct{}

// Name implements Filter.
func (subsetFilter) Name() string { return FilterSubset }

// Filter implements Filter.
func (subsetFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
	if !req.HasSubset {
		return eps
	}
	out := eps[:0]
	for _, e := range eps {
		for _, a := range req.Subset {
			if a == e.Address {
				out = append(out, e)
				break
			}
		}
	}
	return out
}

// healthFilter drops endpoints whose metrics are stale (scrapes failing or
// too old) as long as at least one endpoint is fresh or not yet scraped;
// when every one is stale it keeps the least stale (leastStale), never
// none, so a broken metrics path degrades scheduling instead of failing
// every request. Profiles run it on
// the whole pool (after draining endpoints left), before any per-request
// filter: that is the rule EDS follows (xds keeps a pool's unhealthy
// endpoints only when all are unhealthy), so the picker never chooses an
// endpoint Envoy no longer has while a healthy one exists, and a model
// served only by stale endpoints has no candidate rather than a wrong one.
type healthFilter struct{}

// Name implements Filter.
func (healthFilter) Name() string { return FilterHealthy }

// Filter implements Filter.
func (healthFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
	ok := 0
	for _, e := range eps {
		if f, _ := e.Freshness(req.Now); f != Stale {
			ok++
		}
	}
	if ok == len(eps) {
		return eps
	}
	if ok == 0 {
		return leastStale(eps)
	}
	out := eps[:0]
	for _, e := range eps {
		if f, _ := e.Freshness(req.Now); f != Stale {
			out = append(out, e)
		}
	}
	return out
}

// leastStale is what healthFilter keeps of a pool whose every endpoint is
// stale. When the picker itself falls behind (a pause, a starved CPU,
// readings from a peer replica delayed) every reading ages at once, but an
// endpoint that died went silent before the others last answered: its
// last success is older than theirs by more than its MaxAge. So it keeps
// the endpoints not marked failing (or all, when every one is) whose last
// success is within their MaxAge of the newest last success among them.
// When none ever succeeded, or the snapshots changed under it and nothing
// would be left, it keeps them all.
func leastStale(eps []*Endpoint) []*Endpoint {
	failing := 0
	for _, e := range eps {
		if s := e.Snapshot(); s != nil && s.Failing {
			failing++
		}
	}
	allFailing := failing == len(eps)
	considered := func(s *metrics.Snapshot) bool { return s != nil && (allFailing || !s.Failing) }
	var newest time.Time
	for _, e := range eps {
		if s := e.Snapshot(); considered(s) && s.LastSuccess.After(newest) {
			newest = s.LastSuccess
		}
	}
	if newest.IsZero() {
		return eps
	}
	out := eps[:0]
	for _, e := range eps {
		if s := e.Snapshot(); considered(s) && !s.LastSuccess.IsZero() && newest.Sub(s.LastSuccess) <= s.MaxAge {
			out = append(out, e)
		}
	}
	if len(out) == 0 {
		return eps // nothing was appended: eps is as it came
	}
	return out
}

// loraFilter, for requests whose target model is a LoRA adapter (see
// loraAffinity), keeps the endpoints that run the adapter or have a free
// adapter slot, when any exist: elsewhere the request would wait for a
// slot behind other adapters.
type loraFilter struct{}

// Name implements Filter.
func (loraFilter) Name() string { return FilterLoRASlot }

// Filter implements Filter.
func (loraFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
	if !isAdapter(req, eps) {
		return eps
	}
	ok := 0
	for _, e := range eps {
		if loraAffinity(req, e) >= loraFreeSlot {
			ok++
		}
	}
	if ok == 0 || ok == len(eps) {
		return eps
	}
	out := eps[:0]
	for _, e := range eps {
		if loraAffinity(req, e) >= loraFreeSlot {
			out = append(out, e)
		}
	}
	return out
}

// maxScore picks the highest total scores, breaking exact ties uniformly at
// random; fallbacks follow in score order.
type maxScore struct{}

// Name implements Picker.
func (maxScore) Name() string { return "max-score" }

// Pick implements Picker. It runs n selection passes, which is cheaper than
// sorting for the small fallback counts the picker uses.
func (maxScore) Pick(eps []*Endpoint, scores []float64, n int, dst []*Endpoint) []*Endpoint {
	return maxScorePick(eps, scores, 0, n, dst)
}

// maxScorePick selects positions from..n-1 of eps by descending score.
func maxScorePick(eps []*Endpoint, scores []float64, from, n int, dst []*Endpoint) []*Endpoint {
	if n > len(eps) {
		n = len(eps)
	}
	// One runtime random draw seeds a local splitmix64 sequence for the
	// reservoir tie-breaks (a draw per tie would dominate the pick).
	seed := rand.Uint64()
	next := func() uint64 {
		seed += 0x9e3779b97f4a7c15
		z := seed
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		return z ^ z>>31
	}
	for k := from; k < n; k++ {
		best, ties := -1, 0
		for i := k; i < len(eps); i++ {
			switch {
			case best < 0 || scores[i] > scores[best]:
				best, ties = i, 1
			case scores[i] == scores[best]:
				ties++
				if next()%uint64(ties) == 0 {
					best = i
				}
			}
		}
		// Move the winner to position k so later passes skip it.
		eps[k], eps[best] = eps[best], eps[k]
		scores[k], scores[best] = scores[best], scores[k]
		dst = append(dst, eps[k])
	}
	return dst
}

// weightedRandom draws the primary with probability proportional to its
// score (uniformly when every score is zero), then orders the fallbacks by
// score. It spreads load more evenly than maxScore when scores are close,
// at the cost of sometimes skipping the best endpoint.
type weightedRandom struct{}

// Name implements Picker.
func (weightedRandom) Name() string { return "weighted-random" }

// Pick implements Picker.
func (weightedRandom) Pick(eps []*Endpoint, scores []float64, n int, dst []*Endpoint) []*Endpoint {
	if len(eps) == 0 || n <= 0 {
		return dst
	}
	total := 0.0
	for _, s := range scores[:len(eps)] {
		total += max(s, 0)
	}
	w := 0
	if total <= 0 {
		w = rand.IntN(len(eps))
	} else {
		x := rand.Float64() * total
		w = len(eps) - 1
		for i, s := range scores[:len(eps)] {
			if x -= max(s, 0); x < 0 {
				w = i
				break
			}
		}
	}
	eps[0], eps[w] = eps[w], eps[0]
	scores[0], scores[w] = scores[w], scores[0]
	dst = append(dst, eps[0])
	return maxScorePick(eps, scores, 1, n, dst)
}

// roundRobin ignores scores and walks the candidates in order, one step per
// request; fallbacks are the next candidates. Counter is shared by every
// request of a pool (nil: a package-level draw is used instead).
type roundRobin struct {
	Counter *atomic.Uint64
}

// Name implements Picker.
func (roundRobin) Name() string { return "round-robin" }

// Pick implements Picker.
func (r roundRobin) Pick(eps []*Endpoint, _ []float64, n int, dst []*Endpoint) []*Endpoint {
	if len(eps) == 0 {
		return dst
	}
	var c uint64
	if r.Counter != nil {
		c = r.Counter.Add(1) - 1
	} else {
		c = rand.Uint64()
	}
	start := int(c % uint64(len(eps)))
	for k := 0; k < min(n, len(eps)); k++ {
		dst = append(dst, eps[(start+k)%len(eps)])
	}
	return dst
}

// Saturation decides whether a pool is saturated: new requests wait in the
// admission queue (or, with admission off, sheddable ones are shed).
type Saturation interface {
	Saturated(now time.Time, eps []*Endpoint) bool
}

// Default saturation thresholds (registry.Scheduling zero values). A
// queue threshold of 2 lets each server hold one request on deck in its
// own queue and no more: with the admission queue, the rest wait in the
// picker, in priority and fairness order, rather than in a server's
// first-come-first-served queue. 1 is strict (send only where a request
// starts at once): the best priority order, but every server idles for a
// round trip between a finished request and the next (on the quality
// experiment, 95 % load had a p90 TTFT 15x worse than with 2). The
// reference picker's 5 was chosen for shedding, not for holding requests
// back.
const (
	DefaultQueueThreshold = 2
	DefaultKVThreshold    = 0.8
)

// Thresholds is the scraped-metrics saturation rule: the pool is saturated
// when every candidate has a queue of at least Queue requests, or its KV
// cache use is at least KV. Once a server's batch is learned, the queue
// counted is the one it would have if sent one more request now (see
// waitingIfSent), so with Queue 1 an endpoint has room exactly when a
// request sent now starts at once; before that, it is the queue it has
// now, counting what the picker sent since the scrape. An endpoint with
// stale metrics (scrapes failing or too old) counts as saturated, unless
// every candidate is stale (frozen or overloaded servers, a stalled
// picker, or a broken metrics path): stale is not idle, so each is then
// judged by what the picker itself sent since its last good scrape
// against its learned batch (staleWaitingIfSent), which keeps the
// admission queue's bounds, priority and fairness while the view is old;
// an endpoint whose batch was never learned is not judged (as
// healthFilter keeps them all), so scraping that never worked degrades
// scheduling instead of queueing every request. An endpoint never
// scraped is not judged either, so a pool without metrics is never
// saturated by this rule.
type Thresholds struct {
	Queue int
	KV    float64
}

// Saturated implements Saturation.
func (t Thresholds) Saturated(now time.Time, eps []*Endpoint) bool {
	if len(eps) == 0 {
		return false
	}
	stale := 0
	for _, e := range eps {
		f, s := e.Freshness(now)
		switch f {
		case Unscraped:
			return false
		case Fresh:
			if n, _ := waitingIfSent(e, s, now); n < float64(t.Queue) && s.KVUsage < t.KV {
				return false
			}
		default:
			stale++
		}
	}
	if stale < len(eps) {
		return true
	}
	for _, e := range eps {
		if n, known := staleWaitingIfSent(e); !known || n < float64(t.Queue) {
			return false
		}
	}
	return true
}

// inFlightLimit reports saturation when every candidate already has at
// least Max requests in flight through this picker. Max <= 0 disables it.
type inFlightLimit struct{ Max int64 }

// Saturated implements Saturation.
func (l inFlightLimit) Saturated(_ time.Time, eps []*Endpoint) bool {
	if l.Max <= 0 || len(eps) == 0 {
		return false
	}
	for _, e := range eps {
		if e.Load.InFlightRequests.Load() < l.Max {
			return false
		}
	}
	return true
}

// anySaturated is saturated when any of its rules is.
type anySaturated []Saturation

// Saturated implements Saturation.
func (a anySaturated) Saturated(now time.Time, eps []*Endpoint) bool {
	return slices.ContainsFunc(a, func(s Saturation) bool { return s != nil && s.Saturated(now, eps) })
}
