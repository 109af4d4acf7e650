package picker

import (
	"context"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
)

// request is one request's life through the picker, apart from Envoy's
// protocol (stream.go): the facts its stages share, each written by one
// stage and read by the later ones, and every stage's own state, held by
// value so that a request is one allocation (pooled with its stream)
// whatever its chain. Its methods here are the driver: the fixed sequence
// of core stages, with the chain's hook points between them (chain.go).
type request struct {
	s *Server
	// ctx ends when Envoy (or the client) gives up on the request.
	ctx context.Context
	// ch is the request's chain of optional stages: its snapshot's until
	// its pool is known, then the pool's.
	ch *chain

	// read (read.go): method and path alias Envoy's header bytes; remove
	// lists the client-sent protocol headers (and the tenant's key
	// headers) not to forward; body is the whole request body, bodyOwned
	// when it is our buffer rather than a received message's bytes.
	method, path  []byte
	headers       []*corev3.HeaderValue
	contentLength int
	headerOnly    bool
	remove        []string
	subset        []string
	hasSubset     bool
	body          []byte
	bodyOwned     bool
	// start: the request headers reached the picker.
	start time.Time

	// authenticate (tenants.go): the request's tenant ("" without
	// tenants); the admission queue takes it as the request's flow.
	tenant string

	// resolve (resolve.go): the snapshot the request was last resolved
	// in, the client's model and the name sent upstream, missing when no
	// model or default pool takes the name (404), the model's counters
	// (nil when undeclared; counted: the request is in them, so a second
	// resolution after an admission wait does not count it again),
	// rewritten when responses name the client's
	// model again, the body as it goes upstream (bodyRewritten: it
	// differs from the client's), and the default priority band (the
	// model's, raised by a tenant's).
	snap          *snapshot
	clientModel   string
	target        string
	missing       bool
	obj           *objectiveCounters
	counted       bool
	rewritten     bool
	upstream      []byte
	bodyRewritten bool
	priority      int

	// admit (admit.go): waiting is the request as the pool's queue sees
	// it (set when it must wait); admitted once the queue let it go, so
	// the next pick does not judge saturation again.
	waiting  admission.Request
	admitted bool

	// schedule (schedule.go): the pool and the primary the request is
	// counted on (pool also when it waits or is shed), its tokens, the
	// destination list, the model's in-flight gauge. detailed: an
	// observer wants the decision's breakdown; decisionTime is how long
	// the picks took; outcome is the pick the hooks see.
	pool         *poolView
	primary      *sched.Endpoint
	tokens       int64
	dest         []byte
	running      *atomic.Int64
	detailed     bool
	decisionTime time.Duration
	outcome      pickOutcome

	// observe the response (response.go): respBody: the picker sees the
	// response body (its processing mode is not NONE); servedSeen: Envoy
	// reported the endpoint; rw rewrites the model name back; lat is the
	// router's measurement of the response (latency.go).
	respBody   bool
	servedSeen bool
	rw         *openai.ResponseRewriter
	lat        respLatency

	// account (account.go): the in-flight counts were returned; the
	// stream's end was noted.
	released bool
	finished bool

	// The optional stages' state (chain.go lists the stages).
	span       *tracing.Span     // trace.go (nil: not traced)
	spanParsed bool              // trace.go: the span has its parsed event
	rec        *decisions.Record // records.go (nil: not recorded)
	ten        tenantReq         // tenants.go
	peerID     uint64            // replicas.go: the shared pick (0: none)
	ttft       ttftState         // ttft.go
	kv         kvReq             // kvstage.go
	pd         pdState           // pd.go
}

// begin starts the request's life once its headers are read: the clock,
// then the request-headers hooks (observers' notes, authentication).
func (r *request) begin() reply {
	r.start = time.Now()
	for _, h := range r.ch.requestHeaders {
		if rep := h.requestHeaders(r); rep.code != 0 {
			return rep
		}
	}
	return reply{}
}

// decide decides where the complete request goes: a non-zero reply is a
// local answer, codeQueue when the pool's admission queue must hold the
// request (then the protocol adapter lets Envoy know and calls wait).
func (r *request) decide() reply {
	r.s.stats.requests.Add(1)
	t0 := time.Now()
	rep := r.pick()
	d := time.Since(t0)
	r.s.stats.decision.observe(d)
	r.decisionTime += d
	return rep
}

// wait holds the request in its pool's admission queue until the
// dispatcher lets it go, then picks again with what the dispatcher saw
// free (the pool view may be newer). An error means no answer is to be
// sent: admission.ErrCancelled when Envoy or the client gave up.
func (r *request) wait() (reply, error) {
	pv := r.pool
	r.pool = nil
	tk, err := r.queueWait(pv)
	if err != nil {
		return r.admissionReply(err)
	}
	r.admitted = true
	t1 := time.Now()
	rep := r.pick()
	r.decisionTime += time.Since(t1)
	tk.Done()
	return rep, nil
}

// pick resolves the request's model and pool, lets the stages check it
// (a tenant's access and budgets), then schedules it. A non-zero reply is
// a local answer (codeQueue: wait).
func (r *request) pick() reply {
	pv, mv, parsed, rep := r.resolve()
	if rep.code != 0 {
		return rep
	}
	for _, h := range r.ch.resolved {
		if rep := h.resolved(r); rep.code != 0 {
			return rep
		}
	}
	if pv == nil {
		return reply{code: 503, msg: "no pool is configured for this request"}
	}
	return r.schedule(pv, mv, parsed)
}

// localReply builds a local reply: counted, given the admission queue's
// reason header and retry hint when it has one, and shown to the stages
// (observers note it, a tenant adds its rate-limit headers).
func (r *request) localReply(rep reply) *extprocv3.ProcessingResponse {
	i := rejectIndex(rep.code)
	r.s.stats.rejected[i].Add(1)
	if r.obj != nil {
		r.obj.errors[i].Add(1)
	}
	if r.s.debug {
		r.s.log.Debug("request rejected", "status", rep.code, "reason", rep.msg, "path", string(r.path))
	}
	resp := immediate(rep.code, rep.msg)
	if rep.reason != "" {
		hm := resp.GetImmediateResponse().GetHeaders()
		hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderAdmission, rep.reason), setHeader("retry-after", retryAfter(rep.retryAfter)))
	}
	for _, h := range r.ch.replied {
		h.replied(r, rep, resp)
	}
	return resp
}
