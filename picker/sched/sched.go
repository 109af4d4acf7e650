// Package sched owns the picker's scheduling framework: the endpoint snapshot
// the scheduler sees, and the small plug-in interfaces (Filter, Scorer,
// Picker) a Profile chains together to choose a primary endpoint plus
// fallbacks for one request. It knows nothing about Envoy or gRPC.
//
// Hot-path rules: filters narrow a caller-owned candidate slice in place,
// scorers write into a caller-owned []float64, and nothing allocates per
// request once a Scratch has grown to the pool size.
package sched

import (
	"math/rand/v2"
	"sync/atomic"
	"time"
)

// Load holds an endpoint's live counters. One Load exists per pool+address
// and survives every state rebuild, so in-flight accounting is never lost
// when the registry publishes a new version.
type Load struct {
	// InFlightRequests counts requests picked for the endpoint whose
	// response has not finished yet.
	InFlightRequests atomic.Int64
	// InFlightTokens sums the estimated prompt tokens of those requests.
	InFlightTokens atomic.Int64
	// Picked counts every time the endpoint was chosen as primary.
	Picked atomic.Int64
	// Served counts responses Envoy reported as served by this endpoint.
	Served atomic.Int64
	// Metrics is the latest scraped model-server view; nil until a scraper
	// (picker/metrics) stores one.
	Metrics atomic.Pointer[Metrics]
}

// Metrics is a scraped model-server sample. The scraper owns its contents;
// scorers only read it.
type Metrics struct {
	Waiting      int
	Running      int
	KVUsage      float64 // 0..1
	MaxLoRA      int
	RunningLoRAs []string
	WaitingLoRAs []string
	// UpdatedAt is when the sample was taken; scorers treat stale samples
	// as absent.
	UpdatedAt time.Time
}

// Endpoint is one immutable endpoint entry of a pool snapshot.
type Endpoint struct {
	Pool    string
	Address string
	// Models the endpoint advertises; empty means it serves the whole pool.
	Models   []string
	Draining bool
	// Load is shared across snapshots (never nil).
	Load *Load
}

// Serves reports whether the endpoint advertises model (or advertises
// nothing, meaning it serves everything in its pool).
func (e *Endpoint) Serves(model string) bool {
	if len(e.Models) == 0 {
		return true
	}
	for _, m := range e.Models {
		if m == model {
			return true
		}
	}
	return false
}

// Request is what the scheduler knows about one request.
type Request struct {
	// Model is the name the client sent; TargetModel the name sent upstream
	// (equal when no rewrite applies).
	Model       string
	TargetModel string
	// Tokens is the estimated prompt size in tokens.
	Tokens   int64
	Priority int
	// Subset, when HasSubset, restricts candidates to these addresses.
	Subset    []string
	HasSubset bool
	// Body is the (possibly rewritten) request body; read-only.
	Body []byte
}

// Filter narrows the candidate set. It must return a prefix-reusing subslice
// of eps (filter in place) and must not retain it.
type Filter interface {
	Name() string
	Filter(req *Request, eps []*Endpoint) []*Endpoint
}

// Scorer rates every candidate in [0,1] (higher is better), writing
// scores[i] for eps[i]. It must not retain either slice.
type Scorer interface {
	Name() string
	Score(req *Request, eps []*Endpoint, scores []float64)
}

// Picker chooses up to n endpoints from scored candidates, best first, and
// appends them to dst.
type Picker interface {
	Name() string
	Pick(eps []*Endpoint, scores []float64, n int, dst []*Endpoint) []*Endpoint
}

// WeightedScorer is a scorer with its weight in a profile.
type WeightedScorer struct {
	Scorer Scorer
	Weight float64
}

// Profile is one scheduling strategy: filters, then weighted scorers, then a
// picker.
type Profile struct {
	Name    string
	Filters []Filter
	Scorers []WeightedScorer
	Picker  Picker
}

// Scratch is per-request working memory; reuse it (e.g. via sync.Pool) to
// keep scheduling allocation-free.
type Scratch struct {
	cands  []*Endpoint
	scores []float64
	tmp    []float64
	picked []*Endpoint
}

// Schedule runs the profile over pool and returns up to n endpoints, best
// first. The returned slice aliases sc and is valid until sc is reused.
func (p *Profile) Schedule(req *Request, pool []*Endpoint, n int, sc *Scratch) []*Endpoint {
	return p.Rank(req, p.Filter(req, pool, sc), n, sc)
}

// Filter runs only the profile's filters and returns the candidates (an
// alias of sc's buffer).
func (p *Profile) Filter(req *Request, pool []*Endpoint, sc *Scratch) []*Endpoint {
	sc.cands = append(sc.cands[:0], pool...)
	cands := sc.cands
	for _, f := range p.Filters {
		if len(cands) == 0 {
			break
		}
		cands = f.Filter(req, cands)
	}
	return cands
}

// Rank scores already-filtered candidates and picks up to n of them, best
// first. cands may be reordered.
func (p *Profile) Rank(req *Request, cands []*Endpoint, n int, sc *Scratch) []*Endpoint {
	if len(cands) == 0 {
		return sc.picked[:0]
	}
	sc.scores = grow(sc.scores, len(cands))
	sc.tmp = grow(sc.tmp, len(cands))
	clear(sc.scores)
	for _, ws := range p.Scorers {
		clear(sc.tmp)
		ws.Scorer.Score(req, cands, sc.tmp)
		for i, s := range sc.tmp {
			sc.scores[i] += ws.Weight * s
		}
	}
	sc.picked = p.Picker.Pick(cands, sc.scores, n, sc.picked[:0])
	return sc.picked
}

func grow(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	return s[:n]
}

// MaxScore picks the highest total scores, breaking exact ties uniformly at
// random.
type MaxScore struct{}

// Name implements Picker.
func (MaxScore) Name() string { return "max-score" }

// Pick implements Picker. It runs n selection passes, which is cheaper than
// sorting for the small fallback counts the picker uses.
func (MaxScore) Pick(eps []*Endpoint, scores []float64, n int, dst []*Endpoint) []*Endpoint {
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
	for k := 0; k < n; k++ {
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
