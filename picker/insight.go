package picker

import (
	"bytes"
	"cmp"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/switchyard/switchyard/picker/admission"
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
	start    time.Time // request headers reached the picker
	span     *tracing.Span
	rec      *decisions.Record
	queuedAt time.Time
	lat      respLatency
	parsed   bool // the span has its parsed event
	finished bool
}

// detailed reports whether the decision's breakdown is wanted (the
// request is traced or recorded).
func (o *observation) detailed() bool { return o.span != nil || o.rec != nil }

// noteRequest starts a request's notes when its headers arrive: the clock,
// and, if sampled, its span (a child of the trace context Envoy put in the
// stream's gRPC metadata, else of the request's own traceparent) and its
// record.
func (st *stream) noteRequest() {
	o, s := &st.obs, st.s
	o.start = time.Now()
	if s.opts.Tracer != nil {
		parent, state := st.traceContext()
		o.span = s.opts.Tracer.Start(st.ctx, parent, state, o.start)
	}
	if s.opts.Decisions.Sample() {
		o.rec = &decisions.Record{Time: o.start, RequestID: st.header("x-request-id"), TraceID: o.span.TraceID()}
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
// ran, its breakdown and the pick. code and msg are pick's answer.
func (st *stream) notePick(pv *poolView, target string, req *sched.Request, sc *sched.Scratch, code int, dest []byte) {
	o := &st.obs
	pool := poolName(pv)
	tenant := st.tenant // "" without tenants
	if o.span != nil && !o.parsed {
		o.parsed = true
		o.span.Parsed(string(st.path), st.header("x-request-id"), st.clientModel, target, pool, tenant, req.Tokens, len(st.body))
	}
	b := sc.Breakdown()
	picked, fallbacks := destination(pv, dest, code)
	if o.span != nil {
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
	if r := o.rec; r != nil {
		r.Model, r.Target, r.Pool, r.Tenant, r.Priority, r.PromptTokens = st.clientModel, target, pool, tenant, req.Priority, req.Tokens
		r.PoolSize = b.Pool
		r.Filters = r.Filters[:0]
		for _, f := range b.Filters {
			r.Filters = append(r.Filters, decisions.FilterStep{Name: f.Name, Left: f.Left})
		}
		if b.Ranked {
			recordScores(r, pv, b, st.s.opts.Decisions.MaxCandidates())
		}
		if picked != "" {
			r.Picked, r.Fallbacks = picked, fallbacks
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

// recordScores copies the candidates and their scores into r: every
// candidate up to max, else the max best totals.
func recordScores(r *decisions.Record, pv *poolView, b sched.Breakdown, max int) {
	t := pv.recordTables()
	n, k := len(b.Candidates), len(b.Scorers)
	if len(t.scorers) == k {
		r.Scorers = t.scorers
	} else { // a profile whose scorers changed: describe them afresh
		r.Scorers = make([]decisions.Scorer, k)
		for j, ws := range b.Scorers {
			r.Scorers[j] = decisions.Scorer{Name: ws.Scorer.Name(), Weight: ws.Weight}
		}
	}
	r.Endpoints = t.addrs
	var order []int
	if n > max {
		// A large pool: keep the best. Sorting is rare (pools over max).
		order = make([]int, n)
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(x, y int) int { return cmp.Compare(b.Totals[y], b.Totals[x]) })
		order = order[:max]
		r.Omitted = n - max
		n = max
	}
	r.Candidates = make([]int32, n)
	r.Totals = make([]float32, n)
	r.Scores = make([]uint16, n*k)
	if order == nil {
		indexIn(r.Candidates, b.Candidates, pv.eps)
		for i, v := range b.Totals[:n] {
			r.Totals[i] = float32(v)
		}
		for j := range k {
			row := r.Scores[j*n : (j+1)*n]
			for i, v := range b.Scores[j][:n] {
				row[i] = decisions.QuantizeScore(v)
			}
		}
		if len(b.Predictions) >= n {
			r.Predicted = make([]decisions.PredictedTTFT, n)
			for i := range n {
				r.Predicted[i] = predicted(b.Predictions[i])
			}
		}
		return
	}
	picked := make([]*sched.Endpoint, n)
	for c, i := range order {
		picked[c], r.Totals[c] = b.Candidates[i], float32(b.Totals[i])
		for j := range k {
			r.Scores[j*n+c] = decisions.QuantizeScore(b.Scores[j][i])
		}
	}
	indexIn(r.Candidates, picked, pv.eps)
	if len(b.Predictions) == len(b.Candidates) {
		r.Predicted = make([]decisions.PredictedTTFT, n)
		for c, i := range order {
			r.Predicted[c] = predicted(b.Predictions[i])
		}
	}
}

// predicted is what a decision record keeps of a TTFT prediction.
func predicted(p sched.Prediction) decisions.PredictedTTFT {
	return decisions.PredictedTTFT{Wait: p.Wait, Prefill: p.Prefill, Total: p.Total, Uncached: p.Uncached}
}

// indexIn writes each candidate's index in pool into dst. Filters keep
// the pool's order, so one walk finds them all; a candidate out of order
// is looked up from the start.
func indexIn(dst []int32, cands, pool []*sched.Endpoint) {
	j := 0
	for c, e := range cands {
		for j < len(pool) && pool[j] != e {
			j++
		}
		if j == len(pool) {
			j = slices.Index(pool, e)
			if j < 0 {
				j = 0 // not in the pool (cannot happen): the first
			}
		}
		dst[c] = int32(j)
	}
}

// noteDecisionTime notes how long the decision took.
func (st *stream) noteDecisionTime(d time.Duration) {
	if r := st.obs.rec; r != nil {
		r.DecisionTime += d
	}
}

// noteQueued notes that the request waits in its pool's admission queue.
func (st *stream) noteQueued() {
	o := &st.obs
	o.queuedAt = time.Now()
	o.span.Queued(st.waiting.Priority, st.waiting.Flow)
	if o.rec != nil {
		o.rec.Queued = true
	}
}

// noteAdmitted notes how the admission wait ended (err: the queue's).
func (st *stream) noteAdmitted(err error) {
	o := &st.obs
	waited := time.Since(o.queuedAt)
	outcome := admission.OutcomeDispatched
	var rej *admission.Rejection
	switch {
	case errors.As(err, &rej):
		outcome = rej.Reason
	case errors.Is(err, admission.ErrCancelled):
		outcome = "cancelled"
	case err != nil:
		outcome = "error"
	}
	o.span.Admitted(waited, outcome)
	if o.rec != nil {
		o.rec.QueueWait, o.rec.QueueOutcome = waited, outcome
	}
}

// noteReject notes a local reply.
func (st *stream) noteReject(code int, msg string) {
	o := &st.obs
	o.span.Rejected(code, msg)
	if o.rec != nil {
		o.rec.Status, o.rec.Error = code, msg
		if o.rec.Model == "" {
			o.rec.Model, o.rec.Target = st.clientModel, st.clientModel
		}
	}
}

// noteServed notes the endpoint Envoy reports as having served the
// request.
func (st *stream) noteServed(addr string) {
	o := &st.obs
	o.span.Served(addr)
	if o.rec != nil {
		o.rec.Served = addr
	}
}

// finish closes the request's notes when its stream ends: the latency
// histograms, the record and the span.
func (st *stream) finish() {
	o := &st.obs
	if o.finished {
		return
	}
	o.finished = true
	now := time.Now()
	m, ok := o.lat.measure(o.start, now)
	if ok && st.primary != nil {
		if st.obj != nil {
			st.obj.latency.observe(m)
		}
		st.s.endpointLatency(st.primary.Pool, st.primary.Address).observe(m)
	}
	end := o.lat.end
	if end.IsZero() {
		end = now
	}
	if st.obs.lat.status != 0 {
		o.span.Responded(o.lat.status)
	}
	if r := o.rec; r != nil {
		if r.Status == 0 {
			r.Status = o.lat.status
		}
		if !o.lat.first.IsZero() {
			r.TTFT = o.lat.first.Sub(o.start)
			r.OutputTokens = o.lat.tokens()
		}
		r.Duration = end.Sub(o.start)
		st.s.opts.Decisions.Add(r)
	}
	if o.span != nil {
		ttft := time.Duration(0)
		if !o.lat.first.IsZero() {
			ttft = o.lat.first.Sub(o.start)
		}
		o.span.End(end, ttft, o.lat.tokens())
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
