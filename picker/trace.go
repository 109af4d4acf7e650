package picker

import (
	"strconv"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/metadata"

	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
)

// traceStage traces requests (Options.Tracer; picker/tracing owns the
// provider, the sampling and the span's events): a sampled request's span
// starts with its headers, as a child of the trace context Envoy put in
// the stream's gRPC metadata (else of the request's own traceparent), takes
// the parsed request and the decision, the admission wait, a local reply
// and the served endpoint, and ends with the stream. Its per-request
// state is request.span (nil: not sampled) and request.spanParsed.
type traceStage struct {
	tr *tracing.Tracer
}

var (
	_ requestHeadersStage = (*traceStage)(nil)
	_ decisionStage       = (*traceStage)(nil)
	_ replyStage          = (*traceStage)(nil)
	_ servedStage         = (*traceStage)(nil)
	_ doneStage           = (*traceStage)(nil)
)

// traceStageFor is in the chain when tracing is on.
func traceStageFor(s *Server, _ *snapshot, _ *poolView) any {
	if s.opts.Tracer != nil {
		return &traceStage{tr: s.opts.Tracer}
	}
	return nil
}

// maxSpanCandidates bounds the candidates a span's scores event lists
// (a decision record lists them all).
const maxSpanCandidates = 3

// requestHeaders starts the span of a sampled request.
func (ts *traceStage) requestHeaders(r *request) reply {
	parent, state := traceContext(r)
	r.span = ts.tr.Start(r.ctx, parent, state, r.start)
	if r.span != nil {
		r.detailed = true
	}
	return reply{}
}

// traceContext returns the request's W3C trace context (traceparent,
// tracestate): from the ext_proc stream's gRPC metadata (Envoy's span for
// the ext_proc call) when it has one, else from the request's headers.
func traceContext(r *request) (string, string) {
	if md, ok := metadata.FromIncomingContext(r.ctx); ok {
		if p := md.Get("traceparent"); len(p) > 0 {
			state := ""
			if s := md.Get("tracestate"); len(s) > 0 {
				state = s[0]
			}
			return p[0], state
		}
	}
	return r.header("traceparent"), r.header("tracestate")
}

// decided notes a decision: the parsed request and, when the scheduler
// ran, its breakdown and the pick.
func (ts *traceStage) decided(r *request, o *pickOutcome) {
	sp := r.span
	if sp == nil {
		return
	}
	if !r.spanParsed {
		r.spanParsed = true
		sp.Parsed(string(r.path), r.header("x-request-id"), r.clientModel, o.target, poolName(o.pool), r.tenant, o.req.Tokens, len(r.body))
	}
	b := o.sc.Breakdown()
	picked, fallbacks := o.destination()
	buf := make([]byte, 0, 64)
	for i, f := range b.Filters {
		if i > 0 {
			buf = append(buf, ' ')
		}
		buf = strconv.AppendInt(append(append(buf, f.Name...), '='), int64(f.Left), 10)
	}
	if b.Ranked {
		sp.Scheduled(b.Pool, string(buf), len(b.Candidates), o.pool.recordTables().scorerList, spanScores(b))
	} else {
		sp.Scheduled(b.Pool, string(buf), 0, "", "")
	}
	if picked != "" {
		sp.Picked(picked, strings.Join(fallbacks, ","))
	}
	if pd := &r.pd; pd.reason != "" {
		sp.PD(string(pd.reason), pd.prefill, pd.uncached)
	}
}

// queued notes that the request waits in its pool's admission queue.
func (ts *traceStage) queued(r *request) {
	r.span.Queued(r.waiting.Priority, r.waiting.Flow)
}

// admitted notes how the admission wait ended.
func (ts *traceStage) admitted(r *request, waited time.Duration, outcome string) {
	r.span.Admitted(waited, outcome)
}

// replied notes a local reply. A request for a model nobody declared,
// answered 404 before any pool is chosen, first gets its parsed event,
// naming the client's model.
func (ts *traceStage) replied(r *request, rep reply, _ *extprocv3.ProcessingResponse) {
	sp := r.span
	if sp == nil {
		return
	}
	if r.missing && !r.spanParsed {
		r.spanParsed = true
		sp.Parsed(string(r.path), r.header("x-request-id"), r.clientModel, r.clientModel, "", r.tenant,
			openai.EstimateTokens(r.body), len(r.body))
	}
	sp.Rejected(rep.code, rep.msg)
}

// served notes the endpoint Envoy reports as having served the request.
func (ts *traceStage) served(r *request, addr string, _ bool) {
	r.span.Served(addr)
}

// done ends the span with the response as measured.
func (ts *traceStage) done(r *request, now time.Time) {
	sp := r.span
	if sp == nil {
		return
	}
	lat := &r.lat
	if lat.status != 0 {
		sp.Responded(lat.status)
	}
	ttft := time.Duration(0)
	if !lat.first.IsZero() {
		ttft = lat.first.Sub(r.start)
	}
	sp.PDResult(r.pd.result)
	sp.End(lat.endAt(now), ttft, lat.tokens())
}

// spanScores renders a span's scores event: the best candidates, each
// with its total and every scorer's score.
func spanScores(b sched.Breakdown) string {
	order := bestFirst(b.Totals, maxSpanCandidates)
	buf := make([]byte, 0, 64*len(order)*(1+len(b.Scorers))/4+64)
	for c, i := range order {
		if c > 0 {
			buf = append(buf, "; "...)
		}
		buf = append(append(buf, b.Candidates[i].Address...), " total="...)
		buf = appendFixed3(buf, b.Totals[i])
		for j, ws := range b.Scorers {
			buf = append(append(append(buf, ' '), ws.Scorer.Name()...), '=')
			buf = appendFixed3(buf, b.Scores[j][i])
		}
	}
	return string(buf)
}

// appendFixed3 appends v with 3 decimals (v >= 0; scores and totals),
// without the general float formatter.
func appendFixed3(buf []byte, v float64) []byte {
	if !(v >= 0) || v > 1e12 {
		return strconv.AppendFloat(buf, v, 'f', 3, 64)
	}
	n := int64(v*1000 + 0.5)
	buf = strconv.AppendInt(buf, n/1000, 10)
	f := n % 1000
	return append(buf, '.', byte('0'+f/100), byte('0'+f/10%10), byte('0'+f%10))
}

// bestFirst returns the indexes of the n largest totals, largest first
// (n is small: a span's handful).
func bestFirst(totals []float64, n int) []int {
	n = min(n, len(totals))
	top := make([]int, 0, n+1)
	for i, t := range totals {
		j := len(top)
		for j > 0 && totals[top[j-1]] < t {
			j--
		}
		if j >= n {
			continue
		}
		top = append(top, 0)
		copy(top[j+1:], top[j:])
		top[j] = i
		if len(top) > n {
			top = top[:n]
		}
	}
	return top
}
