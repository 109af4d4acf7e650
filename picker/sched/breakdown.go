package sched

// filterCount is one filter of a decision and the candidates it left.
type filterCount struct {
	Name string
	Left int
}

// Breakdown is what a decision made with Request.Record looked like: the
// candidates before filtering, what each filter left, and every scorer's
// score of every remaining candidate. It aliases the Scratch and is valid
// until the Scratch is used again; copy what you keep.
type Breakdown struct {
	// Pool is the number of endpoints the filters started from.
	Pool int
	// Filters are the filters that ran, in order (a filter that left no
	// candidate is the last).
	Filters []filterCount
	// Ranked is false when Rank did not run (no candidate, or the
	// request stopped after filtering); the fields below are then empty.
	Ranked bool
	// Candidates are the filtered candidates in the order they were
	// scored, and Totals their weighted sums (what the picker ranked).
	Candidates []*Endpoint
	Totals     []float64
	// Scorers are the profile's scorers that ran (weight != 0), and
	// Scores[j][i] scorer j's score, in [0, 1] before its weight, of
	// Candidates[i].
	Scorers []weightedScorer
	Scores  [][]float64
	// Predictions are the TTFT scorer's predictions for Candidates, in
	// their order (empty unless the profile predicts TTFT).
	Predictions []Prediction
}

// Breakdown returns the latest decision's breakdown when its request had
// Record set (the zero Breakdown otherwise).
func (sc *Scratch) Breakdown() Breakdown {
	r := &sc.rec
	if !r.on {
		return Breakdown{}
	}
	b := Breakdown{Pool: r.pool, Filters: r.filters, Ranked: r.ranked}
	if r.ranked {
		b.Candidates, b.Totals, b.Scorers, b.Scores = r.cands, r.totals, r.scorers, sc.per
		if sc.predsOK && len(sc.preds) == len(r.cands) {
			b.Predictions = sc.preds
		}
	}
	return b
}

// recorded is the Scratch's memory of a Record decision; its slices are
// reused from one decision to the next.
type recorded struct {
	on      bool
	ranked  bool
	pool    int
	filters []filterCount
	cands   []*Endpoint
	totals  []float64
	scorers []weightedScorer
}

// reset starts a decision over pool endpoints (on: Record is set).
func (r *recorded) reset(on bool, pool int) {
	r.on, r.ranked, r.pool = on, false, pool
	r.filters = r.filters[:0]
	clear(r.cands) // drop references to the previous pool's endpoints
	r.cands = r.cands[:0]
}

// keepScores appends the scores in sc.tmp as scorer ws's row, reusing the
// row's memory from earlier decisions.
func (sc *Scratch) keepScores(ws weightedScorer) {
	k := len(sc.per)
	if k < cap(sc.per) {
		sc.per = sc.per[:k+1]
		sc.per[k] = append(sc.per[k][:0], sc.tmp...)
	} else {
		sc.per = append(sc.per, append([]float64(nil), sc.tmp...))
	}
	sc.rec.scorers = append(sc.rec.scorers, ws)
}
