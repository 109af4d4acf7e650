package picker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

// The admit stage: the request's priority band (its model's or tenant's,
// or the pool's priority header) and fairness flow (its tenant, or the
// pool's flow header), and, between the scheduler's filters and its
// scorers, whether the request may go now, must wait in the pool's
// admission queue (admission/; the queues are wired here, one per pool)
// or is shed (429); the wait itself, and the queue's answers (429, 503).

// The admission queue's wire names.
const (
	// HeaderAdmission, on a local reply the admission queue caused, says
	// why: "ttl", "overflow", "no-endpoint" or "shed".
	HeaderAdmission = "x-switchyard-admission"
	// maxFlowKey bounds the flow header value kept per waiting request.
	maxFlowKey = 128
)

// admissionConfig turns a pool's admission block into the queue's config.
func admissionConfig(a *registry.Admission) admission.Config {
	if a == nil {
		return admission.Config{}
	}
	return admission.Config{
		Disabled: a.Disabled, MaxQueued: a.MaxQueued, MaxQueuedBytes: a.MaxQueuedBytes, BandMaxQueued: a.BandMaxQueued,
		TTL: a.TTL, NoEndpointWait: a.NoEndpointWait, Fairness: admission.Fairness(a.Fairness), QueueSheddable: a.QueueSheddable,
	}
}

// syncQueues gives every pool of snap its admission queue, configured from
// the pool's block, and stops the queues of pools that left (their waiting
// requests get 503). Queues live in poolState, so they and their waiting
// requests survive reloads. Without a running picker (before Run) there
// is no dispatcher, so no queue: requests are forwarded.
func (s *Server) syncQueues(st *registry.State, snap *snapshot, old *snapshot) {
	if s.runCtx == nil {
		return
	}
	for name, pv := range snap.pools {
		cfg := admissionConfig(st.Pools[name].Admission)
		if q := pv.state.queue.Load(); q != nil {
			q.Configure(cfg)
			continue
		}
		ctx, cancel := context.WithCancel(s.runCtx)
		q := admission.New(name, cfg, func() admission.Capacity { return s.capacity(name) })
		pv.state.queue.Store(q)
		pv.state.stopQueue = cancel
		s.queues.Add(1)
		go func() {
			defer s.queues.Done()
			q.Run(ctx)
		}()
	}
	if old == nil {
		return
	}
	for name, pv := range old.pools {
		if _, ok := snap.pools[name]; !ok && pv.state.stopQueue != nil {
			pv.state.stopQueue()
		}
	}
}

// capacity is the dispatcher's view of pool name: NoEndpoint when no
// endpoint is ready to take requests, Full when every one is saturated
// (the pool's saturation rule, counting what this picker sent since the
// last scrape), Room otherwise.
func (s *Server) capacity(name string) admission.Capacity {
	pv := s.snap.Load().pools[name]
	if pv == nil {
		return admission.NoEndpoint
	}
	if len(pv.ready) == 0 {
		return admission.NoEndpoint
	}
	if s.saturatedAmong(pv, pv.ready, time.Now()) {
		return admission.Full
	}
	return admission.Room
}

// saturatedAmong applies the pool's saturation rule (and
// Options.Saturation) to eps.
func (s *Server) saturatedAmong(pv *poolView, eps []*sched.Endpoint, now time.Time) bool {
	req := sched.Request{Now: now}
	return pv.profile.Saturated(&req, eps) || (s.opts.Saturation != nil && s.opts.Saturation.Saturated(now, eps))
}

// withHeadroom narrows cands (in place) to the endpoints that are not
// saturated on their own, when some are: a request the admission queue
// let go goes where the dispatcher saw room, not to a server whose own
// queue would hold it behind others (the scorers alone may prefer that
// one, e.g. for its cached prefix). When none has room, cands stay.
func (s *Server) withHeadroom(pv *poolView, cands []*sched.Endpoint, now time.Time) []*sched.Endpoint {
	room := 0
	for i := range cands {
		if !s.saturatedAmong(pv, cands[i:i+1], now) {
			room++
		}
	}
	if room == 0 || room == len(cands) {
		return cands
	}
	out := cands[:0]
	for i := range cands {
		if !s.saturatedAmong(pv, cands[i:i+1], now) {
			out = append(out, cands[i])
		}
	}
	return out
}

// admitDecision is what pick says about the admission queue.
type admitDecision int

const (
	admitGo   admitDecision = iota // forward now
	admitWait                      // wait in the queue
	admitShed                      // sheddable and saturated: 429 now
)

// admit decides whether a request for pool pv may go now. A request waits
// while the pool is saturated, or while others wait (first come, first
// served), or, when the pool has no ready endpoint at all, for the
// queue's shorter no-endpoint wait. A sheddable request (priority < 0)
// that would wait for capacity gets 429 instead, as the protocol says,
// unless the pool queues sheddable requests (QueueSheddable): others
// waiting means the pool has no room for it, and it would go last.
// Without a queue (admission off, or no dispatcher) the pre-admission
// rule holds: sheddable requests get 429 when the pool is saturated, the
// rest are forwarded.
func (r *request) admit(pv *poolView, req *sched.Request, cands []*sched.Endpoint, noEndpoint bool) admitDecision {
	if r.admitted {
		return admitGo
	}
	s := r.s
	q := pv.state.queue.Load()
	if q == nil || pv.admission.Disabled {
		if noEndpoint || req.Priority >= 0 {
			return admitGo
		}
		if pv.profile.Saturated(req, cands) || (s.opts.Saturation != nil && s.opts.Saturation.Saturated(req.Now, cands)) {
			return admitShed
		}
		return admitGo
	}
	if noEndpoint {
		return admitWait
	}
	if s.capacity(pv.name) != admission.Full && q.Len() == 0 {
		return admitGo
	}
	if req.Priority < 0 && !pv.admission.QueueSheddable {
		return admitShed
	}
	return admitWait
}

// headerPriority is the request's band: the pool's priority header
// clamped to the operator's bounds, else model (the tenant's priority,
// else the model's).
func (r *request) headerPriority(pv *poolView, model int) int {
	h := pv.admission.PriorityHeader
	if h == "" {
		return model
	}
	v := r.header(h)
	if v == "" {
		return model
	}
	p, err := strconv.Atoi(v)
	if err != nil {
		return model
	}
	return min(max(p, pv.admission.PriorityMin), pv.admission.PriorityMax)
}

// flow is the request's fairness key: its tenant, else the pool's flow
// header (truncated).
func (r *request) flow(pv *poolView) string {
	if r.tenant != "" {
		return r.tenant
	}
	if pv.admission.FlowHeader == "" {
		return ""
	}
	v := r.header(pv.admission.FlowHeader)
	if len(v) > maxFlowKey {
		v = v[:maxFlowKey]
	}
	return v
}

// maxWait is the longest the request may wait in its pool's admission
// queue (r.pool, set when it must wait): the protocol adapter asks Envoy
// to wait longer than that for the picker's answer.
func (r *request) maxWait() time.Duration {
	cfg := r.pool.state.queue.Load().Config()
	return max(cfg.TTL, cfg.NoEndpointWait)
}

// queueWait holds the request in pool pv's admission queue until the
// dispatcher lets it go (a ticket to release once picked) or rejects it.
func (r *request) queueWait(pv *poolView) (admission.Ticket, error) {
	q := pv.state.queue.Load()
	r.s.stats.queued.Add(1)
	queuedAt := time.Now()
	for _, h := range r.ch.decided {
		h.queued(r)
	}
	tk, err := q.Wait(r.ctx, r.waiting)
	waited, outcome := time.Since(queuedAt), waitOutcome(err)
	for _, h := range r.ch.decided {
		h.admitted(r, waited, outcome)
	}
	return tk, err
}

// waitOutcome names how an admission wait ended (err: the queue's), as
// traces and decision records report it.
func waitOutcome(err error) string {
	var rej *admission.Rejection
	switch {
	case errors.As(err, &rej):
		return rej.Reason
	case errors.Is(err, admission.ErrCancelled):
		return "cancelled"
	case err != nil:
		return "error"
	}
	return admission.OutcomeDispatched
}

// admissionReply answers a request the queue turned away; any other error
// (admission.ErrCancelled: Envoy or the client gave up) is returned.
func (r *request) admissionReply(err error) (reply, error) {
	var rej *admission.Rejection
	if !errors.As(err, &rej) {
		return reply{}, err
	}
	code := 429
	if rej.Reason == admission.ReasonNoEndpoint {
		code = 503
	}
	return reply{code: code, msg: rej.Error(), reason: rej.Reason, retryAfter: rej.RetryAfter}, nil
}

// retryAfter formats d as a retry-after value: whole seconds, at least 1.
func retryAfter(d time.Duration) string {
	return strconv.Itoa(max(int((d+time.Second-1)/time.Second), 1))
}

// shedMessage is the 429 of a sheddable request in a saturated pool.
func shedMessage(pool, model string) string {
	return fmt.Sprintf("pool %q is saturated and model %q is sheddable", pool, model)
}

// AdmissionStats returns every pool's admission queue counters and what
// waits now, by pool name (pools without a queue are left out).
func (s *Server) AdmissionStats() []admission.Stats {
	snap := s.snap.Load()
	out := make([]admission.Stats, 0, len(snap.pools))
	for _, name := range sortedPools(snap) {
		if q := snap.pools[name].state.queue.Load(); q != nil {
			st := q.Stats()
			st.Config = q.Config()
			out = append(out, st)
		}
	}
	return out
}

// sortedPools returns snap's pool names in order.
func sortedPools(snap *snapshot) []string {
	names := make([]string, 0, len(snap.pools))
	for n := range snap.pools {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
