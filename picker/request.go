package picker

import (
	"context"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
)

// request is one request's life through the picker, apart from Envoy's
// protocol (stream): what was read, the decision, and what is noted about
// the response.
type request struct {
	s *Server
	// ctx ends when Envoy (or the client) gives up on the request.
	ctx context.Context
	// ch is the request's chain of optional stages: its snapshot's until
	// its pool is known, then the pool's.
	ch *chain

	// Request side (method and path alias Envoy's header bytes).
	method, path  []byte
	headers       []*corev3.HeaderValue // all request headers (session lookup)
	contentLength int
	headerOnly    bool
	remove        []string // client-sent protocol headers present
	subset        []string
	hasSubset     bool
	body          []byte
	bodyOwned     bool // body is our buffer, not a received message's bytes
	// missing: the body names a model nobody declared and no default
	// pool takes (404).
	missing bool

	// Decision.
	pool        *poolView
	primary     *sched.Endpoint
	tokens      int64
	released    bool
	clientModel string
	rewritten   bool
	obj         *objectiveCounters // the declared model/target, nil otherwise
	running     *atomic.Int64      // the model's in-flight gauge once picked

	// upstream is the body as it goes upstream; bodyRewritten: it differs
	// from the client's (a rewritten model, stream_options added for a
	// tenant).
	upstream      []byte
	bodyRewritten bool
	// outcome is the pick the decided and picked hooks see (chain.go).
	outcome pickOutcome

	// peerID names the pick shared with the other replicas (0: none).
	peerID uint64
	// ttft is the pick's TTFT accounting (profiles that predict it).
	ttft ttftState

	// Admission: waiting is the request as the pool's queue sees it (set
	// by pick when it must wait); admitted once the queue let it go, so
	// the next pick does not judge saturation again.
	waiting  admission.Request
	admitted bool
	// tenant is the request's tenant, set when the request headers
	// arrive, before the decision ("" without tenants): the admission
	// queue takes it as the request's flow. ten is the tenant stage's
	// state (tenants.go).
	tenant string
	ten    tenantReq
	// snap is the snapshot the request was last resolved in; priority its
	// default priority band (the model's, or its tenant's).
	snap     *snapshot
	priority int

	// Response side. respBody: the picker sees the response body (its
	// processing mode is not NONE).
	respBody   bool
	servedSeen bool
	rw         *openai.ResponseRewriter

	// start: the request headers reached the picker. lat is the
	// router's measurement of the response (latency.go); finished: the
	// stream's end was noted.
	start    time.Time
	lat      respLatency
	finished bool
	// detailed: an observer (a trace, a decision record) wants the
	// decision's breakdown; decisionTime is how long its picks took.
	detailed     bool
	decisionTime time.Duration

	// span is the request's trace span (trace.go; nil: none);
	// spanParsed: it has its parsed event.
	span       *tracing.Span
	spanParsed bool
	// rec is the request's decision record (records.go; nil: none).
	rec *decisions.Record
}

// header returns the value of request header name (lower case), or "".
func (r *request) header(name string) string {
	for _, hv := range r.headers {
		if hv.GetKey() == name {
			return string(headerBytes(hv))
		}
	}
	return ""
}
