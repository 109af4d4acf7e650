package picker

import (
	"bytes"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
)

// What the picker notes about each request beyond routing it: its trace
// span (Options.Tracer), its decision record (Options.Decisions) and its
// latency as the router measures it (latency.go). stream.go calls the
// note* hooks below at a few points; a request that is neither traced
// nor recorded only pays for the latency measurement.

// maxSpanCandidates bounds the candidates a span's scores event lists
// (a decision record lists them all).
const maxSpanCandidates = 3

// observation is one stream's notes.
type observation struct {
	span   *tracing.Span
	parsed bool // the span has its parsed event
}

// noteRequest starts a request's notes when its headers arrive: if
// sampled, its span (a child of the trace context Envoy put in the
// stream's gRPC metadata, else of the request's own traceparent).
func (st *stream) noteRequest() {
	o, s := &st.obs, st.s
	if s.opts.Tracer != nil {
		parent, state := st.traceContext()
		o.span = s.opts.Tracer.Start(st.ctx, parent, state, st.start)
		st.detailed = o.span != nil
	}
}

// traceContext returns the request's W3C trace context (traceparent,
// tracestate): from the ext_proc stream's gRPC metadata (Envoy's span for
// the ext_proc call) when it has one, else from the request's headers.
func (st *stream) traceContext() (string, string) {
	if md, ok := metadata.FromIncomingContext(st.ctx); ok {
		if p := md.Get("traceparent"); len(p) > 0 {
			state := ""
			if s := md.Get("tracestate"); len(s) > 0 {
				state = s[0]
			}
			return p[0], state
		}
	}
	return st.header("traceparent"), st.header("tracestate")
}

// notePick notes a decision: the parsed request and, when the scheduler
// ran, its breakdown and the pick.
func (st *stream) notePick(po *pickOutcome) {
	pv, target, req := po.pool, po.target, po.req
	o := &st.obs
	pool := poolName(pv)
	tenant := st.tenant // "" without tenants
	if o.span != nil && !o.parsed {
		o.parsed = true
		o.span.Parsed(string(st.path), st.header("x-request-id"), st.clientModel, target, pool, tenant, req.Tokens, len(st.body))
	}
	if o.span != nil {
		b := po.sc.Breakdown()
		picked, fallbacks := po.destination()
		buf := make([]byte, 0, 64)
		for i, f := range b.Filters {
			if i > 0 {
				buf = append(buf, ' ')
			}
			buf = strconv.AppendInt(append(append(buf, f.Name...), '='), int64(f.Left), 10)
		}
		if b.Ranked {
			o.span.Scheduled(b.Pool, string(buf), len(b.Candidates), pv.recordTables().scorerList, spanScores(b))
		} else {
			o.span.Scheduled(b.Pool, string(buf), 0, "", "")
		}
		if picked != "" {
			o.span.Picked(picked, strings.Join(fallbacks, ","))
		}
	}
}

// noteUnknownModel notes a request for a model nobody declared, answered
// 404 before any pool is chosen: its span names the client's model (its
// record takes it from st.clientModel), and its tenant usage is filed
// under the name's label.
func (st *stream) noteUnknownModel(snap *snapshot) {
	if st.ten != nil {
		st.ten.label = st.ten.labelFor(snap, st.clientModel)
	}
	o := &st.obs
	if o.span != nil && !o.parsed {
		o.parsed = true
		o.span.Parsed(string(st.path), st.header("x-request-id"), st.clientModel, st.clientModel, "", st.tenant,
			openai.EstimateTokens(st.body), len(st.body))
	}
}

// destination splits a decision's destination list into the primary and
// the fallbacks, with the pool's own address strings (no copies).
func destination(pv *poolView, dest []byte, code int) (string, []string) {
	if code != 0 || len(dest) == 0 || pv == nil {
		return "", nil
	}
	var picked string
	var fallbacks []string
	for len(dest) > 0 {
		part := dest
		if i := bytes.IndexByte(dest, ','); i >= 0 {
			part, dest = dest[:i], dest[i+1:]
		} else {
			dest = nil
		}
		var addr string
		if e := pv.byAddr[string(part)]; e != nil {
			addr = e.Address
		} else {
			addr = string(part)
		}
		if picked == "" {
			picked = addr
		} else {
			fallbacks = append(fallbacks, addr)
		}
	}
	return picked, fallbacks
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

// recordTables are a pool view's tables that its decision records
// share: the endpoints' addresses (candidates are indexes into it) and
// the profile's scorers that run.
type recordTables struct {
	once    sync.Once
	addrs   []string
	scorers []decisions.Scorer
	// scorerList is the scorers as a span names them: "prefix*3 queue*2".
	scorerList string
}

func (pv *poolView) recordTables() *recordTables {
	t := &pv.tables
	t.once.Do(func() {
		t.addrs = make([]string, len(pv.eps))
		for i, e := range pv.eps {
			t.addrs[i] = e.Address
		}
		var list []string
		for _, ws := range pv.profile.Scorers {
			if ws.Weight != 0 {
				t.scorers = append(t.scorers, decisions.Scorer{Name: ws.Scorer.Name(), Weight: ws.Weight})
				list = append(list, ws.Scorer.Name()+"*"+strconv.FormatFloat(ws.Weight, 'g', -1, 64))
			}
		}
		t.scorerList = strings.Join(list, " ")
	})
	return t
}

// noteQueued notes that the request waits in its pool's admission queue.
func (st *stream) noteQueued() {
	o := &st.obs
	o.span.Queued(st.waiting.Priority, st.waiting.Flow)
}

// noteAdmitted notes how the admission wait ended.
func (st *stream) noteAdmitted(waited time.Duration, outcome string) {
	o := &st.obs
	o.span.Admitted(waited, outcome)
}

// noteReject notes a local reply.
func (st *stream) noteReject(code int, msg string) {
	o := &st.obs
	o.span.Rejected(code, msg)
}

// noteServed notes the endpoint Envoy reports as having served the
// request.
func (st *stream) noteServed(addr string) {
	o := &st.obs
	o.span.Served(addr)
}

// finish closes the request's notes when its stream ends: the latency
// histograms and the span, and the stages' done hooks.
func (st *stream) finish() {
	o := &st.obs
	if st.finished {
		return
	}
	st.finished = true
	now := time.Now()
	m, ok := st.lat.measure(st.start, now)
	if ok && st.primary != nil {
		if st.obj != nil {
			st.obj.latency.observe(m)
		}
		st.s.endpointLatency(st.primary.Pool, st.primary.Address).observe(m)
	}
	if st.lat.status != 0 {
		o.span.Responded(st.lat.status)
	}
	if o.span != nil {
		ttft := time.Duration(0)
		if !st.lat.first.IsZero() {
			ttft = st.lat.first.Sub(st.start)
		}
		o.span.End(st.lat.endAt(now), ttft, st.lat.tokens())
	}
	for _, h := range st.ch.done {
		h.done(&st.request, now)
	}
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
