package picker

import (
	"bytes"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/contract"
	pdwire "github.com/switchyard/switchyard/internal/pd"
	pdpick "github.com/switchyard/switchyard/picker/pd"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

// The P/D stage: prefill/decode disaggregation, in the chain of a pool
// with a disaggregation block. The pool's profile has chosen the decode
// server (its role filter keeps prefill servers out); for a completions
// or chat request whose model's policy is on, the stage decides whether
// to split it (picker/pd.Decide: the prompt's tokens not cached on the
// decode server, the policy's thresholds) and which prefill server runs
// the prefill (the least prefill work there: the prompt's tokens it does
// not hold plus the prefills the picker sent it, among those under the
// prefill queue and KV thresholds). A split request goes to the decode
// server's sidecar as any request does, naming the prefill server in
// x-prefiller-host-port (signed with Options.PDSigner), with the decision
// in the switchyard.pd metadata. The prefill counts on its server (a
// request in flight, and prefill work) until the sidecar answers, which
// it does once the prefill is over; both servers learn the prompt's
// blocks in the prefix index (the prefill server computed them, the
// decode server received them). Its per-request state is request.pd.

// pdPool is a disaggregated pool's policies, built with its snapshot.
type pdPool struct {
	// pool is the policy of the pool's requests (nil: off), models the
	// policies of the pool's models that have their own block.
	pool   *pdpick.Policy
	models map[string]*pdpick.Policy
}

// newPDPool reads pool p's policies from st, with the pool's saturation
// thresholds standing in for what a block leaves unset.
func newPDPool(st *registry.State, p *registry.Pool) *pdPool {
	qt, kv := sched.DefaultQueueThreshold, sched.DefaultKVThreshold
	if sc := p.Scheduling; sc != nil {
		if sc.QueueThreshold > 0 {
			qt = sc.QueueThreshold
		}
		if sc.KVThreshold > 0 {
			kv = sc.KVThreshold
		}
	}
	policy := func(d *registry.Disaggregation) *pdpick.Policy {
		if d == nil {
			return nil
		}
		pol := pdpick.PolicyFrom(d, qt, kv)
		return &pol
	}
	pp := &pdPool{pool: policy(registry.DisaggregationFor(p, nil))}
	for name, m := range st.Models {
		if m.Pool != p.Name || m.Disaggregation == nil {
			continue
		}
		if pp.models == nil {
			pp.models = map[string]*pdpick.Policy{}
		}
		pp.models[name] = policy(registry.DisaggregationFor(p, m))
	}
	return pp
}

// policyFor returns the policy of a request for model (nil: off).
func (pp *pdPool) policyFor(model string) *pdpick.Policy {
	if pol, ok := pp.models[model]; ok {
		return pol
	}
	return pp.pool
}

// pdStage is the P/D stage of one pool in one snapshot.
type pdStage struct {
	cfg *pdPool
	// prefill lists the pool's endpoints whose role prefills, names
	// their addresses (raw: as header values, shared read-only), sigs
	// their latest signatures (a signature is the same for a second).
	prefill []*sched.Endpoint
	names   []string
	raw     [][]byte
	sigs    []atomic.Pointer[pdSig]
	index   *prefix.Index
	// learnDecode: the profile does not record picks in the prefix index,
	// so the stage records the decode server's.
	learnDecode bool
	// predictor prices the prefill on its server for a profile that
	// predicts TTFT (nil otherwise).
	predictor *sched.TTFTScorer
	signer    *pdwire.Signer
	counts    *[len(pdpick.Reasons) + 1]atomic.Int64
	scratch   sync.Pool // *pdScratch
}

var (
	_ pickedStage          = (*pdStage)(nil)
	_ answerStage          = (*pdStage)(nil)
	_ responseHeadersStage = (*pdStage)(nil)
	_ releasedStage        = (*pdStage)(nil)
)

// pdScratch is one decision's working memory.
type pdScratch struct {
	cands   []pdpick.Candidate
	matched []int
}

// pdStageFor is in the chain of a pool with a disaggregation block.
func pdStageFor(s *Server, _ *snapshot, pv *poolView) any {
	if pv == nil || pv.pd == nil {
		return nil
	}
	ps := &pdStage{cfg: pv.pd, index: pv.state.index, learnDecode: !pv.profileLearns, predictor: pv.predictor,
		signer: s.opts.PDSigner, counts: &pv.state.pdDecisions}
	for _, e := range pv.eps {
		if e.Role.Prefills() {
			ps.prefill = append(ps.prefill, e)
			ps.names = append(ps.names, e.Address)
			ps.raw = append(ps.raw, []byte(e.Address))
		}
	}
	ps.sigs = make([]atomic.Pointer[pdSig], len(ps.prefill))
	ps.scratch.New = func() any { return new(pdScratch) }
	return ps
}

// pdSig is a prefill server's signature made in one second (Unix time).
type pdSig struct {
	unix int64
	sig  []byte
}

// sign returns prefill server i's signature, made at most once a second
// (a signature names its second, so one made this second is the same).
func (ps *pdStage) sign(i int) []byte {
	now := time.Now().Unix()
	if c := ps.sigs[i].Load(); c != nil && c.unix == now {
		return c.sig
	}
	c := &pdSig{unix: now, sig: []byte(ps.signer.Sign(ps.names[i]))}
	ps.sigs[i].Store(c)
	return c.sig
}

// pdAnswer is what a decision adds to the answer to Envoy, in one
// allocation: the prefill headers and the switchyard.pd metadata.
type pdAnswer struct {
	set                 [2]corev3.HeaderValueOption
	vals                [2]corev3.HeaderValue
	ns                  structpb.Value
	nsKind              structpb.Value_StructValue
	md                  structpb.Struct
	decision, prefill   structpb.Value
	decisionK, prefillK structpb.Value_StringValue
	uncached            structpb.Value
	uncachedK           structpb.Value_NumberValue
}

// pdState is a request's P/D decision.
type pdState struct {
	// reason is the decision ("" when none was made: not a completions or
	// chat request, or not picked); split names the prefill server in
	// prefill; uncached is the prompt's tokens not cached on the decode
	// server.
	reason   pdpick.Reason
	split    bool
	prefill  string
	uncached int
	// idx is the prefill server's index in the stage's list.
	idx int
	// work is the prefill's accounting on its server until the sidecar
	// answers (nil: none).
	work *prefillWork
	// result is the sidecar's x-switchyard-pd on its answer (split,
	// fallback, local; "" when it sent none).
	result string
}

// splitPath reports whether a request path is one the sidecar splits.
func splitPath(p []byte) bool {
	if i := bytes.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	return string(p) == "/v1/completions" || string(p) == "/v1/chat/completions"
}

// picked decides the request and, for a split, starts the prefill's
// accounting on its server.
func (ps *pdStage) picked(r *request, o *pickOutcome) {
	st := &r.pd
	*st = pdState{}
	if string(r.method) != "POST" || !splitPath(r.path) {
		return
	}
	pol := ps.cfg.policyFor(r.clientModel)
	if pol == nil {
		st.reason = pdpick.Off
		ps.counts[pdpick.Off.Index()].Add(1)
		return
	}
	req, primary := o.req, r.primary
	prompt := int(req.Tokens)
	if req.Cache != nil {
		prompt = req.Cache.Tokens()
	}
	bt := req.BlockTokens
	if bt <= 0 {
		bt = prefix.DefaultBlockTokens
	}
	sc := ps.scratch.Get().(*pdScratch)
	defer ps.scratch.Put(sc)
	dec := pdpick.Candidate{Address: primary.Address, Role: primary.Role, Ready: true, CachedTokens: ps.decodeCached(o, primary.Address, bt, prompt)}
	n := len(ps.prefill)
	sc.cands = slices.Grow(sc.cands[:0], n)[:n]
	sc.matched = slices.Grow(sc.matched[:0], n)[:n]
	if len(req.Hashes) > 0 {
		ps.index.MatchInto(req.Hashes, ps.names, sc.matched)
	} else {
		clear(sc.matched)
	}
	for i, e := range ps.prefill {
		q, f := e.QueueIfSent(req.Now)
		c := &sc.cands[i]
		*c = pdpick.Candidate{Address: e.Address, Role: e.Role, Ready: !e.Draining && f != sched.Stale && !prefillFailed(e, req.Now),
			CachedTokens: cachedOf(sc.matched[i], len(req.Hashes), bt, prompt), Waiting: int(q), PendingPrefillTokens: int(e.Load.PrefillTokens.Load())}
		if f == sched.Fresh {
			if s := e.Snapshot(); s != nil {
				c.KVUsage = s.KVUsage
			}
		}
	}
	d := pdpick.Decide(prompt, dec, sc.cands, *pol)
	st.reason, st.uncached = d.Reason, d.Uncached
	ps.counts[d.Reason.Index()].Add(1)
	if d.Split {
		i := slices.Index(ps.names, d.Prefill)
		pe := ps.prefill[i]
		st.split, st.prefill, st.idx = true, pe.Address, i
		ps.startPrefill(st, pe, req, max(0, prompt-sc.cands[i].CachedTokens), o.streamed)
		if len(req.Hashes) > 0 {
			sched.LearnPrefix(ps.index, pe, req.Hashes)
		}
	}
	if ps.learnDecode && len(req.Hashes) > 0 {
		sched.LearnPrefix(ps.index, primary, req.Hashes)
	}
}

// prefillFailed reports whether a sidecar reported e's latest prefill
// failed and no scrape of e has succeeded since: a server that died or
// restarted is not chosen again in the scrapes it takes to go stale (at
// 50 ms scrapes, some 250 ms: under load, hundreds of requests that
// would each try it first). A server that is not scraped is left out for
// prefillRetry after the failure.
func prefillFailed(e *sched.Endpoint, now time.Time) bool {
	at := e.Load.PrefillFailed.Load()
	if at == 0 {
		return false
	}
	if s := e.Snapshot(); s != nil {
		return s.LastSuccess.UnixNano() <= at
	}
	return now.UnixNano()-at < int64(prefillRetry)
}

// prefillRetry is how long a prefill server that is not scraped is left
// out after a failed prefill.
const prefillRetry = time.Second

// decodeCached is how many of the prompt's tokens the decode server (the
// primary) holds: the exact view's or the prefix scorer's figure from the
// ranking (the profile has recorded the pick since), else the index's.
func (ps *pdStage) decodeCached(o *pickOutcome, addr string, bt, prompt int) int {
	if n, ok := o.sc.CachedTokens(addr); ok {
		return n
	}
	hashed := len(o.req.Hashes)
	if m, ok := o.sc.PrefixMatch(addr); ok {
		return cachedOf(m, hashed, bt, prompt)
	}
	if hashed == 0 {
		return 0
	}
	var m [1]int
	ps.index.MatchInto(o.req.Hashes, []string{addr}, m[:])
	return cachedOf(m[0], hashed, bt, prompt)
}

// cachedOf is the prompt tokens a server holds whose index entry matches
// the first matched of the prompt's hashed blocks (bt tokens each). A
// prompt is hashed up to maxHashBlocks (4,096 tokens at 16-token blocks):
// a server holding all of them is taken to hold the whole prompt, which
// the index cannot tell but is the likely case (it served this prompt
// before); counting the unhashed tail as uncached would split every long
// prompt, however cached.
func cachedOf(matched, hashed, bt, prompt int) int {
	if hashed >= maxHashBlocks && matched == hashed {
		return max(prompt, matched*bt)
	}
	return matched * bt
}

// startPrefill counts a split request's prefill on its server pe: a
// request in flight there, and its prefill tokens (with the prefill's
// predicted time, for a profile that predicts TTFT), until the sidecar
// answers. An answer that is not streamed comes only at the end of the
// decode, so that prefill ends after the server's mean time to first
// token (what its prefills take, by its own measure) when known.
func (ps *pdStage) startPrefill(st *pdState, pe *sched.Endpoint, req *sched.Request, uncached int, streamed bool) {
	tokens, d := int64(uncached), time.Duration(0)
	if ps.predictor != nil {
		pr := sched.Request{Tokens: req.Tokens, Hashes: req.Hashes, BlockTokens: req.BlockTokens, Now: req.Now}
		pred := ps.predictor.Predict(&pr, pe)
		tokens, d = pred.Uncached, pred.Prefill
	}
	var expire time.Duration
	if !streamed {
		if s := pe.Snapshot(); s != nil && s.Perf.Requests > 0 && s.Perf.TTFT > 0 {
			expire = time.Duration(s.Perf.TTFT * float64(time.Second))
		}
	}
	w := &prefillWork{load: pe.Load, tokens: tokens, inFlight: true}
	w.start(d, req.Now, expire)
	st.work = w
}

// answer names the prefill server of a split request and puts the
// decision in the switchyard.pd metadata.
func (ps *pdStage) answer(r *request, d *decisionBlock) {
	st := &r.pd
	if st.reason == "" {
		return
	}
	a := new(pdAnswer)
	a.decisionK.StringValue, a.decision.Kind = string(st.reason), &a.decisionK
	a.uncachedK.NumberValue, a.uncached.Kind = float64(st.uncached), &a.uncachedK
	a.md.Fields = make(map[string]*structpb.Value, 3)
	a.md.Fields["decision"], a.md.Fields["uncached_tokens"] = &a.decision, &a.uncached
	a.nsKind.StructValue, a.ns.Kind = &a.md, &a.nsKind
	d.md.Fields[contract.PDNamespace] = &a.ns
	if !st.split {
		return
	}
	a.prefillK.StringValue, a.prefill.Kind = st.prefill, &a.prefillK
	a.md.Fields["prefill"] = &a.prefill
	// Set below: removing them as well would leave Envoy's order of
	// operations to decide.
	d.hm.RemoveHeaders = slices.DeleteFunc(d.hm.RemoveHeaders, func(k string) bool {
		return k == pdwire.PrefillerHeader || k == pdwire.SignatureHeader
	})
	set := func(i int, k string, v []byte) {
		a.vals[i] = corev3.HeaderValue{Key: k, RawValue: v}
		a.set[i] = corev3.HeaderValueOption{Header: &a.vals[i], AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
		d.hm.SetHeaders = append(d.hm.SetHeaders, &a.set[i])
	}
	set(0, pdwire.PrefillerHeader, ps.raw[st.idx])
	if ps.signer != nil {
		set(1, pdwire.SignatureHeader, ps.sign(st.idx))
	}
}

// responseHeaders ends the prefill's accounting: the sidecar answers once
// the prefill is over (or failed). It notes what the sidecar did; a
// prefill that failed keeps its server from being chosen until a scrape
// shows it up.
func (ps *pdStage) responseHeaders(r *request, h *extprocv3.HttpHeaders, _ *extprocv3.ProcessingResponse) {
	st := &r.pd
	if !st.split {
		return
	}
	st.work.finish()
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.GetKey() == pdwire.ResultHeader {
			switch v := headerBytes(hv); string(v) { // the constants, not a copy
			case pdwire.ResultSplit:
				st.result = pdwire.ResultSplit
			case pdwire.ResultFallback:
				st.result = pdwire.ResultFallback
			case pdwire.ResultLocal:
				st.result = pdwire.ResultLocal
			default:
				st.result = string(v)
			}
			break
		}
	}
	if st.result == pdwire.ResultFallback {
		st.work.load.PrefillFailed.Store(time.Now().UnixNano())
	}
}

// released ends the prefill's accounting if the answer did not.
func (ps *pdStage) released(r *request) {
	r.pd.work.finish()
}

// pdDecisions returns pv's decision counts by reason (nil for a pool
// without a disaggregation block).
func pdDecisions(pv *poolView) map[string]int64 {
	if pv.pd == nil {
		return nil
	}
	out := make(map[string]int64, len(pdpick.Reasons))
	for i, r := range pdpick.Reasons {
		out[string(r)] = pv.state.pdDecisions[i].Load()
	}
	return out
}
