package picker

import "time"

// The account stage: when the request ends upstream (its response ended,
// or its stream did) its in-flight request and tokens go back, once, and
// the pool's admission queue is told there is room; when its stream ends
// the router-measured latency goes into the model's and the endpoint's
// histograms. The stages release and finish first.

// release returns the in-flight request and tokens exactly once, after
// the stages' released hooks (a tenant settles, the TTFT accounting and
// the replicas' shared pick end).
func (r *request) release() {
	for _, h := range r.ch.released {
		h.released(r)
	}
	if r.primary == nil || r.released {
		return
	}
	r.released = true
	r.primary.Load.InFlightRequests.Add(-1)
	r.primary.Load.InFlightTokens.Add(-r.tokens)
	if r.running != nil {
		r.running.Add(-1)
	}
	if q := r.pool.state.queue.Load(); q != nil {
		// Capacity freed: the next waiting request may go.
		q.Kick()
	}
}

// finish closes the request when its stream ends: the latency
// histograms, then the stages' done hooks (a record is added, a span
// ends).
func (r *request) finish() {
	if r.finished {
		return
	}
	r.finished = true
	now := time.Now()
	m, ok := r.lat.measure(r.start, now)
	if ok && r.primary != nil {
		if r.obj != nil {
			r.obj.latency.observe(m)
		}
		r.s.endpointLatency(r.primary.Pool, r.primary.Address).observe(m)
	}
	for _, h := range r.ch.done {
		h.done(r, now)
	}
}
