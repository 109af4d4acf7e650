package picker

import (
	"fmt"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/sched"
)

// The chain: the optional stages of a request's path (tracing, decision
// records, tenants, replica sharing, the KV-event cache view,
// prefill/decode disaggregation, TTFT accounting, the pool's upstream key)
// and the hook points where the request's driver (request.go) calls them.
// A stage is a small type that implements only the hook interfaces
// it needs; its per-request state is a field of request (one allocation
// per request whatever the chain). Stages are called in chain order at
// each hook point. A stage that is not configured is not in the chain.

// reply is a stage's local answer to a request: the HTTP status and its
// message, and for the admission queue's answers the reason header and a
// retry hint. The zero reply lets the request go on.
type reply struct {
	code       int
	msg        string
	reason     string        // x-switchyard-admission value ("" none)
	retryAfter time.Duration // with reason
}

// pickOutcome is what one pick decided, as the decided and picked hooks
// see it: the pool and target, the scheduler's request and scratch (the
// breakdown, predictions and prompt hashes; valid only during the hook),
// the local reply code (0 picked, codeQueue waits) and the destination
// list. It lives in the request, so passing it costs no allocation.
type pickOutcome struct {
	pool     *poolView
	target   string
	req      *sched.Request
	sc       *sched.Scratch
	code     int
	dest     []byte
	streamed bool // the body asks for an event stream

	// The destination split into primary and fallbacks (destination).
	split     bool
	primary   string
	fallbacks []string
}

// destination returns the pick's primary and fallbacks, with the pool's
// own address strings ("" and nil when nothing was picked); the split is
// made once however many stages ask.
func (o *pickOutcome) destination() (string, []string) {
	if !o.split {
		o.split = true
		o.primary, o.fallbacks = destination(o.pool, o.dest, o.code)
	}
	return o.primary, o.fallbacks
}

// requestHeadersStage runs when the request headers have been read,
// before the size limit: observers start their notes, tenants
// authenticate.
type requestHeadersStage interface {
	requestHeaders(r *request) reply
}

// resolvedStage runs once the model is resolved, before the pool is
// checked (and again when a request the admission queue held is decided
// again): a tenant's model access and budgets. It may replace the body
// sent upstream.
type resolvedStage interface {
	resolved(r *request) reply
}

// modelsStage narrows the picker's own GET /v1/models answer to what
// the request may see.
type modelsStage interface {
	listModels(r *request, ids []string) []string
}

// decisionStage notes a decision: every outcome of a pick once the
// scheduler ran (for requests an observer asked details of, see
// request.detailed), and the admission queue's wait.
type decisionStage interface {
	decided(r *request, o *pickOutcome)
	queued(r *request)
	admitted(r *request, waited time.Duration, outcome string)
}

// rankStage runs inside schedule, between the filters (and admission)
// and the scorers: rank may prepare what the scorers read from the
// candidates (the request's exact cache view, sched.Request.Cache).
// ranked runs once the scorers have ranked them, whether or not one was
// picked (primary nil), while the scratch holds their results.
type rankStage interface {
	rank(r *request, req *sched.Request, cands []*sched.Endpoint)
	ranked(r *request, req *sched.Request, sc *sched.Scratch, primary *sched.Endpoint)
}

// pickedStage runs once the request is picked and counted in flight on
// r.primary.
type pickedStage interface {
	picked(r *request, o *pickOutcome)
}

// answerStage adds to the answer that sends the request upstream.
type answerStage interface {
	answer(r *request, d *decisionBlock)
}

// replyStage sees a local reply before it is sent, and may add to it.
type replyStage interface {
	replied(r *request, rep reply, resp *extprocv3.ProcessingResponse)
}

// servedStage runs when Envoy first reports the endpoint that served the
// request; moved: it is not the primary, and the request's in-flight
// accounting moved there (r.primary is now that endpoint).
type servedStage interface {
	served(r *request, addr string, moved bool)
}

// responseHeadersStage sees the response headers, and may add to their
// answer.
type responseHeadersStage interface {
	responseHeaders(r *request, h *extprocv3.HttpHeaders, resp *extprocv3.ProcessingResponse)
}

// responseBodyStage sees each response body chunk, in order, and may
// change it (changed: out may differ from data); eos: the body ends.
type responseBodyStage interface {
	responseBody(r *request, data []byte, eos bool) (out []byte, changed bool)
}

// releasedStage runs when the request ends upstream (its response ended,
// or its stream did). It may run more than once, and for requests that
// were never picked: a stage releases what it holds once.
type releasedStage interface {
	released(r *request)
}

// doneStage runs once, when the request's stream ends.
type doneStage interface {
	done(r *request, now time.Time)
}

// chain is the stages of one chain, by hook point, in chain order.
type chain struct {
	requestHeaders  []requestHeadersStage
	resolved        []resolvedStage
	models          []modelsStage
	decided         []decisionStage
	rank            []rankStage
	picked          []pickedStage
	answer          []answerStage
	replied         []replyStage
	served          []servedStage
	responseHeaders []responseHeadersStage
	responseBody    []responseBodyStage
	released        []releasedStage
	done            []doneStage
}

// add appends st at every hook point it implements.
func (c *chain) add(st any) {
	n := 0
	if h, ok := st.(requestHeadersStage); ok {
		c.requestHeaders = append(c.requestHeaders, h)
		n++
	}
	if h, ok := st.(resolvedStage); ok {
		c.resolved = append(c.resolved, h)
		n++
	}
	if h, ok := st.(modelsStage); ok {
		c.models = append(c.models, h)
		n++
	}
	if h, ok := st.(decisionStage); ok {
		c.decided = append(c.decided, h)
		n++
	}
	if h, ok := st.(rankStage); ok {
		c.rank = append(c.rank, h)
		n++
	}
	if h, ok := st.(pickedStage); ok {
		c.picked = append(c.picked, h)
		n++
	}
	if h, ok := st.(answerStage); ok {
		c.answer = append(c.answer, h)
		n++
	}
	if h, ok := st.(replyStage); ok {
		c.replied = append(c.replied, h)
		n++
	}
	if h, ok := st.(servedStage); ok {
		c.served = append(c.served, h)
		n++
	}
	if h, ok := st.(responseHeadersStage); ok {
		c.responseHeaders = append(c.responseHeaders, h)
		n++
	}
	if h, ok := st.(responseBodyStage); ok {
		c.responseBody = append(c.responseBody, h)
		n++
	}
	if h, ok := st.(releasedStage); ok {
		c.released = append(c.released, h)
		n++
	}
	if h, ok := st.(doneStage); ok {
		c.done = append(c.done, h)
		n++
	}
	if n == 0 {
		// A programming error (a hook method misspelled): every test
		// that builds a picker finds it.
		panic(fmt.Sprintf("picker: stage %T implements no hook point", st))
	}
}

// stageDef names an optional stage and builds it, or returns nil when it
// is not configured. A server stage is built once per snapshot (pv nil)
// and joins every chain; a pool stage is built for each pool.
type stageDef struct {
	name    string
	perPool bool
	build   func(s *Server, snap *snapshot, pv *poolView) any
}

// stages is the optional stages of the request path, in chain order. A
// new capability is one entry here, its stage type in its own file, and
// its per-request state in request.
func stages() []stageDef {
	return []stageDef{
		{name: "tracing", build: traceStageFor},
		{name: "decisions", build: recordStageFor},
		{name: "tenants", build: tenantStageFor},
		{name: "replicas", build: replicaStageFor},
		{name: "kv-events", perPool: true, build: kvStageFor},
		{name: "pd", perPool: true, build: pdStageFor}, // before ttft: a split's prefill is not the primary's
		{name: "ttft", perPool: true, build: ttftStageFor},
		{name: "upstream-key", perPool: true, build: upstreamKeyStageFor},
	}
}

// buildChains builds snap's chains from s.stages: the server's chain
// (every request until its pool is known) and each pool's (the server's
// stages and the pool's own, in chain order).
func (s *Server) buildChains(snap *snapshot) {
	shared := make([]any, len(s.stages))
	snap.chain = chain{}
	for i, d := range s.stages {
		if d.perPool {
			continue
		}
		if st := d.build(s, snap, nil); st != nil {
			shared[i] = st
			snap.chain.add(st)
		}
	}
	for _, pv := range snap.pools {
		pv.chain = chain{}
		for i, d := range s.stages {
			st := shared[i]
			if d.perPool {
				st = d.build(s, snap, pv)
			}
			if st != nil {
				pv.chain.add(st)
			}
		}
	}
}
