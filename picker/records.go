package picker

import (
	"cmp"
	"slices"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/sched"
)

// recordStage keeps decision records (Options.Decisions, picker/decisions
// owns the ring and the file): a sampled request's record starts when its
// headers arrive, takes the decision's breakdown, the admission wait, a
// local reply and the served endpoint, and is added when the stream ends.
// Its per-request state is request.rec (nil: not sampled).
type recordStage struct {
	rec *decisions.Recorder
}

var (
	_ requestHeadersStage = (*recordStage)(nil)
	_ decisionStage       = (*recordStage)(nil)
	_ replyStage          = (*recordStage)(nil)
	_ servedStage         = (*recordStage)(nil)
	_ doneStage           = (*recordStage)(nil)
)

// recordStageFor is in the chain when decision records are on.
func recordStageFor(s *Server, _ *snapshot, _ *poolView) any {
	if d := s.opts.Decisions; d != nil && !d.Options().Disabled {
		return &recordStage{rec: d}
	}
	return nil
}

// requestHeaders starts the record of a sampled request.
func (rs *recordStage) requestHeaders(r *request) reply {
	if rs.rec.Sample() {
		r.rec = &decisions.Record{Time: r.start, RequestID: r.header("x-request-id"), TraceID: r.span.TraceID()}
		r.detailed = true
	}
	return reply{}
}

// decided notes a decision: the request as parsed and, when the
// scheduler ran, its breakdown and the pick.
func (rs *recordStage) decided(r *request, o *pickOutcome) {
	rec := r.rec
	if rec == nil {
		return
	}
	b := o.sc.Breakdown()
	rec.Model, rec.Target, rec.Pool, rec.Tenant, rec.Priority, rec.PromptTokens = r.clientModel, o.target, poolName(o.pool), r.tenant, o.req.Priority, o.req.Tokens
	rec.PoolSize = b.Pool
	rec.Filters = rec.Filters[:0]
	for _, f := range b.Filters {
		rec.Filters = append(rec.Filters, decisions.FilterStep{Name: f.Name, Left: f.Left})
	}
	if b.Ranked {
		recordScores(rec, o.pool, b, rs.rec.MaxCandidates())
	}
	if picked, fallbacks := o.destination(); picked != "" {
		rec.Picked, rec.Fallbacks = picked, fallbacks
	}
	if pd := &r.pd; pd.reason != "" {
		rec.PD = &decisions.PD{Decision: string(pd.reason), Prefill: pd.prefill, UncachedTokens: pd.uncached}
	}
}

// queued notes that the request waits in its pool's admission queue.
func (rs *recordStage) queued(r *request) {
	if r.rec != nil {
		r.rec.Queued = true
	}
}

// admitted notes how the admission wait ended.
func (rs *recordStage) admitted(r *request, waited time.Duration, outcome string) {
	if r.rec != nil {
		r.rec.QueueWait, r.rec.QueueOutcome = waited, outcome
	}
}

// replied notes a local reply.
func (rs *recordStage) replied(r *request, rep reply, _ *extprocv3.ProcessingResponse) {
	if rec := r.rec; rec != nil {
		rec.Status, rec.Error = rep.code, rep.msg
		if rec.Model == "" {
			rec.Model, rec.Target = r.clientModel, r.clientModel
		}
	}
}

// served notes the endpoint Envoy reports as having served the request.
func (rs *recordStage) served(r *request, addr string, _ bool) {
	if r.rec != nil {
		r.rec.Served = addr
	}
}

// done completes the record with the response as measured and adds it.
func (rs *recordStage) done(r *request, now time.Time) {
	rec := r.rec
	if rec == nil {
		return
	}
	lat := &r.lat
	if rec.Status == 0 {
		rec.Status = lat.status
	}
	if !lat.first.IsZero() {
		rec.TTFT = lat.first.Sub(r.start)
		rec.OutputTokens = lat.tokens()
	}
	rec.Duration = lat.endAt(now).Sub(r.start)
	rec.DecisionTime = r.decisionTime
	if rec.PD != nil {
		rec.PD.Result = r.pd.result
	}
	rs.rec.Add(rec)
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
