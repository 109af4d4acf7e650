package picker

import (
	"fmt"
	"time"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
)

// The schedule stage: the pool's profile filters its endpoints, the
// admission stage (admit.go) says whether the request may go now, the
// rank hooks prepare what the scorers read (kvstage.go), the scorers
// rank the candidates and the picker chooses the primary and the
// fallbacks; the pick is counted in flight on the primary and the
// profile's memory (prefix index, sessions) learns it. No candidate is
// 503. Observers see every outcome (decided hooks), stages the pick
// (picked hooks).

// codeQueue is schedule's answer for a request that must wait in the
// pool's admission queue (r.pool and r.waiting say where and as what).
const codeQueue = -1

// schedule runs pool pv's profile for the request (mv: its declared
// model, nil if none; parsed: the model's and prompt's place in the
// body), and accounts the pick. A non-zero reply is a local answer.
func (r *request) schedule(pv *poolView, mv *modelView, parsed openai.Request) (rep reply) {
	s := r.s
	r.dest = nil
	sc := s.scratch.Get().(*sched.Scratch)
	defer s.scratch.Put(sc)
	// The request lives in the scratch: plug-ins take it by pointer
	// through interfaces, so a local one would be a heap allocation.
	sreq := &sc.Req
	*sreq = sched.Request{
		Model: r.clientModel, TargetModel: r.target,
		Tokens: openai.EstimateTokens(r.upstream), Subset: r.subset, HasSubset: r.hasSubset, Body: r.upstream,
		Now: time.Now(), Explain: s.debug, Record: r.detailed,
	}
	defer func() { *sreq = sched.Request{} }() // drop references to this request's body
	if sreq.Record {
		defer func() {
			r.outcome = pickOutcome{pool: pv, target: r.target, req: sreq, sc: sc, code: rep.code, dest: r.dest}
			r.noteDecided(&r.outcome)
			r.outcome = pickOutcome{}
		}()
	}
	sreq.Priority = r.priority
	if pv.admission.PriorityHeader != "" {
		sreq.Priority = r.headerPriority(pv, sreq.Priority)
	}
	prof := pv.profile
	cands := prof.Filter(sreq, pv.eps, sc)
	if len(cands) == 0 && len(pv.ready) == 0 {
		if r.admit(pv, sreq, cands, true) == admitWait {
			return r.queue(pv, sreq)
		}
		return reply{code: 503, msg: fmt.Sprintf("no ready endpoint in pool %q", pv.name)}
	}
	if len(cands) == 0 {
		switch {
		case sc.EmptiedBy == sched.FilterModel:
			// Never a server that does not serve the name: it would
			// answer its own 404 in its own shape.
			return reply{code: 503, msg: fmt.Sprintf("no ready endpoint serves model %q", r.clientModel)}
		case r.hasSubset:
			return reply{code: 503, msg: fmt.Sprintf("no ready endpoint in pool %q matches the endpoint subset", pv.name)}
		}
		return reply{code: 503, msg: fmt.Sprintf("no ready endpoint in pool %q", pv.name)}
	}
	if r.admitted && len(cands) > 1 {
		cands = s.withHeadroom(pv, cands, sreq.Now)
	}
	switch r.admit(pv, sreq, cands, false) {
	case admitShed:
		r.pool = pv
		return reply{code: 429, msg: shedMessage(pv.name, r.clientModel), reason: admission.ReasonShed, retryAfter: time.Second}
	case admitWait:
		return r.queue(pv, sreq)
	}
	if pv.usesSession {
		sreq.Session = r.header(pv.sessionHeader)
	}
	if pv.usesPrefix && len(r.upstream) > 0 {
		// The prompt's bytes are the same in the original and a rewritten
		// body (only the model token differs), so the spans found in the
		// original serve both.
		ph := pv.state.hasher.Load()
		sc.Hashes = ph.h.Hash(sc.Hashes[:0], r.target, parsed.Prompt(r.body))
		sreq.Hashes = sc.Hashes
		sreq.BlockTokens = ph.blockTokens
	}
	for _, h := range r.ch.rank {
		h.rank(r, sreq, cands)
	}
	picked := prof.Rank(sreq, cands, s.opts.MaxEndpoints, sc)
	if len(r.ch.rank) > 0 {
		var primary *sched.Endpoint
		if len(picked) > 0 {
			primary = picked[0]
		}
		for _, h := range r.ch.rank {
			h.ranked(r, sreq, sc, primary)
		}
	}
	if len(picked) == 0 {
		return reply{code: 503, msg: fmt.Sprintf("no ready endpoint in pool %q", pv.name)}
	}
	prof.Picked(sreq, picked[0])
	if pv.usesPrefix {
		pv.state.learnBlockSize(picked[0])
		if len(sreq.Hashes) > 0 {
			pv.state.promptBlocks.Add(int64(len(sreq.Hashes)))
			if m, ok := sc.PrefixMatch(picked[0].Address); ok {
				pv.state.matchedBlocks.Add(int64(m))
			}
		}
	}
	n := len(picked) - 1
	for _, e := range picked {
		n += len(e.Address)
	}
	d := make([]byte, 0, n)
	for i, e := range picked {
		if i > 0 {
			d = append(d, ',')
		}
		d = append(d, e.Address...)
	}
	r.dest = d
	r.pool, r.primary, r.tokens = pv, picked[0], sreq.Tokens
	r.primary.Load.InFlightRequests.Add(1)
	r.primary.Load.InFlightTokens.Add(r.tokens)
	r.primary.Load.Picked.Add(1)
	if mv != nil {
		r.running = mv.running
		r.running.Add(1)
	}
	if len(r.ch.picked) > 0 {
		o := &r.outcome
		*o = pickOutcome{pool: pv, target: r.target, req: sreq, sc: sc, dest: r.dest, streamed: parsed.Stream}
		for _, h := range r.ch.picked {
			h.picked(r, o)
		}
		*o = pickOutcome{}
	}
	s.stats.picked.Add(1)
	if s.debug {
		s.log.Debug("picked endpoint", "pool", pv.name, "profile", prof.Name, "model", r.clientModel, "target", r.target,
			"destination", string(r.dest), "candidates", len(cands), "scores", sc.Explanation)
	}
	return reply{}
}

// noteDecided lets the observers note a decision.
func (r *request) noteDecided(o *pickOutcome) {
	for _, h := range r.ch.decided {
		h.decided(r, o)
	}
}

// queue records what the admission queue needs to hold the request.
func (r *request) queue(pv *poolView, req *sched.Request) reply {
	r.pool = pv
	r.waiting = admission.Request{Priority: req.Priority, Flow: r.flow(pv), Bytes: int64(len(r.body)), Tokens: req.Tokens}
	return reply{code: codeQueue}
}

func poolName(pv *poolView) string {
	if pv == nil {
		return ""
	}
	return pv.name
}

func (pv *poolView) lookup(addr string) *sched.Endpoint {
	if pv == nil {
		return nil
	}
	return pv.byAddr[addr]
}
