package sched

// DrainingFilter drops endpoints that are draining.
type DrainingFilter struct{}

// Name implements Filter.
func (DrainingFilter) Name() string { return "not-draining" }

// Filter implements Filter.
func (DrainingFilter) Filter(_ *Request, eps []*Endpoint) []*Endpoint {
	out := eps[:0]
	for _, e := range eps {
		if !e.Draining {
			out = append(out, e)
		}
	}
	return out
}

// ModelFilter keeps endpoints that advertise the request's target model (or
// the client's model name), or advertise no models at all.
type ModelFilter struct{}

// Name implements Filter.
func (ModelFilter) Name() string { return "model" }

// Filter implements Filter.
func (ModelFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
	if req.TargetModel == "" && req.Model == "" {
		return eps
	}
	out := eps[:0]
	for _, e := range eps {
		if e.Serves(req.TargetModel) || (req.Model != req.TargetModel && e.Serves(req.Model)) {
			out = append(out, e)
		}
	}
	return out
}

// SubsetFilter keeps only endpoints named in the request's subset hint when
// one is present.
type SubsetFilter struct{}

// Name implements Filter.
func (SubsetFilter) Name() string { return "subset-hint" }

// Filter implements Filter.
func (SubsetFilter) Filter(req *Request, eps []*Endpoint) []*Endpoint {
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

// LeastInFlight scores endpoints by in-flight requests, fewest best, with
// in-flight tokens as a strict tie-breaker: the key requests+tokens/(maxTokens+1)
// orders lexicographically and is min-max normalised into [0,1].
type LeastInFlight struct{}

// Name implements Scorer.
func (LeastInFlight) Name() string { return "least-request" }

// Score implements Scorer.
func (LeastInFlight) Score(_ *Request, eps []*Endpoint, scores []float64) {
	var maxTok int64
	for _, e := range eps {
		if t := e.Load.InFlightTokens.Load(); t > maxTok {
			maxTok = t
		}
	}
	lo, hi := 0.0, 0.0
	for i, e := range eps {
		k := float64(e.Load.InFlightRequests.Load()) + float64(e.Load.InFlightTokens.Load())/float64(maxTok+1)
		scores[i] = k
		if i == 0 || k < lo {
			lo = k
		}
		if i == 0 || k > hi {
			hi = k
		}
	}
	for i := range scores[:len(eps)] {
		if hi == lo {
			scores[i] = 1
		} else {
			scores[i] = 1 - (scores[i]-lo)/(hi-lo)
		}
	}
}

// DefaultProfile is the scheduling used until scraped metrics exist: skip
// draining endpoints, honour the subset hint and endpoint model lists, then
// least in-flight requests (ties: fewest tokens, then random).
func DefaultProfile() *Profile {
	return &Profile{
		Name:    "least-request",
		Filters: []Filter{SubsetFilter{}, DrainingFilter{}, ModelFilter{}},
		Scorers: []WeightedScorer{{Scorer: LeastInFlight{}, Weight: 1}},
		Picker:  MaxScore{},
	}
}

// Saturation decides whether a pool is too loaded for sheddable requests.
// The next issue replaces InFlightLimit with scraped queue/KV thresholds.
type Saturation interface {
	Saturated(eps []*Endpoint) bool
}

// InFlightLimit reports saturation when every candidate already has at
// least Max requests in flight. Max <= 0 disables it.
type InFlightLimit struct{ Max int64 }

// Saturated implements Saturation.
func (l InFlightLimit) Saturated(eps []*Endpoint) bool {
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
