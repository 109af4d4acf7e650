package picker

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/sched"
)

type bodyMode = extprocfilterv3.ProcessingMode_BodySendMode

const (
	modeNone     = extprocfilterv3.ProcessingMode_NONE
	modeStreamed = extprocfilterv3.ProcessingMode_STREAMED
	modeBuffered = extprocfilterv3.ProcessingMode_BUFFERED
	modePartial  = extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL
	modeDuplex   = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

type sendFunc func(*extprocv3.ProcessingResponse) error

// stream is the state of one ext_proc stream, i.e. one HTTP request. It is
// owned by a single Process goroutine.
type stream struct {
	s *Server
	// ctx ends when Envoy (or the client) gives up on the request.
	ctx context.Context

	modesKnown        bool
	reqMode, respMode bodyMode
	// bodyEarly: Envoy sends body chunks before the headers are answered
	// (always so in FULL_DUPLEX_STREAMED).
	bodyEarly bool

	// Request side (method and path alias Envoy's header bytes).
	method, path  []byte
	headers       []*corev3.HeaderValue // all request headers (session lookup)
	contentLength int
	headerOnly    bool
	trailers      bool
	decided       bool
	remove        []string // client-sent protocol headers present
	subset        []string
	hasSubset     bool
	body          []byte
	bodyOwned     bool  // body is our buffer, not a received message's bytes
	chunkLens     []int // STREAMED mode: original chunk sizes

	// Decision.
	pool        *poolView
	primary     *sched.Endpoint
	tokens      int64
	released    bool
	clientModel string
	rewritten   bool
	obj         *objectiveCounters // the declared model/target, nil otherwise
	running     *atomic.Int64      // the model's in-flight gauge once picked

	// bodyRewritten: the body going upstream differs from the client's
	// (a rewritten model, stream_options added for a tenant).
	bodyRewritten bool

	// peerID names the pick shared with the other replicas (0: none).
	peerID uint64
	// ttft is the pick's TTFT accounting (profiles that predict it).
	ttft ttftState

	// Admission: waiting is the request as the pool's queue sees it (set
	// by pick when it must wait); admitted once the queue let it go, so
	// the next pick does not judge saturation again.
	waiting  admission.Request
	admitted bool
	// Tenant, set by authenticate when the request headers arrive, before
	// the decision (tenants.go): the admission queue takes tenant as the
	// request's flow and tenantPriority as its default priority. Empty
	// and nil without tenants.
	tenant         string
	tenantPriority *int
	ten            *tenantReq

	// Response side.
	servedSeen bool
	rw         *openai.ResponseRewriter

	// obs is what the picker notes for traces, decision records and
	// latency (insight.go, latency.go).
	obs observation
}

func (s *Server) newStream(ctx context.Context) *stream {
	return &stream{s: s, ctx: ctx, reqMode: s.opts.RequestBodyMode, respMode: s.opts.ResponseBodyMode}
}

// release returns the in-flight request and tokens exactly once (and
// settles the request's tenant accounting).
func (st *stream) release() {
	st.finishTenant()
	if st.primary == nil || st.released {
		return
	}
	st.released = true
	st.ttftRelease()
	st.unpublish()
	st.primary.Load.InFlightRequests.Add(-1)
	st.primary.Load.InFlightTokens.Add(-st.tokens)
	if st.running != nil {
		st.running.Add(-1)
	}
	if q := st.pool.state.queue.Load(); q != nil {
		// Capacity freed: the next waiting request may go.
		q.Kick()
	}
}

// handle processes one message; done means the stream is finished (an
// immediate response was sent).
func (st *stream) handle(req *extprocv3.ProcessingRequest, send sendFunc) (bool, error) {
	if !st.modesKnown {
		st.modesKnown = true
		st.bodyEarly = true
		if pc := req.GetProtocolConfig(); pc != nil {
			st.reqMode, st.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
			st.bodyEarly = pc.GetSendBodyWithoutWaitingForHeaderResponse()
		}
	}
	if req.GetObservabilityMode() {
		send = func(*extprocv3.ProcessingResponse) error { return nil }
	}
	switch v := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.onRequestHeaders(req, v.RequestHeaders, send)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.onRequestBody(v.RequestBody, send)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.onRequestTrailers(send)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		st.obs.lat.headers(v.ResponseHeaders, time.Now())
		st.recordServed(req)
		return false, st.onResponseHeaders(v.ResponseHeaders, send)
	case *extprocv3.ProcessingRequest_ResponseBody:
		st.s.stats.responseBodies.Add(1)
		st.obs.lat.body(v.ResponseBody.GetBody(), v.ResponseBody.GetEndOfStream(), time.Now())
		st.recordServed(req)
		return false, st.onResponseBody(v.ResponseBody, send)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		st.recordServed(req)
		return false, st.onResponseTrailers(send)
	case nil:
		// Flow-control-only message: nothing to answer.
		return false, nil
	default:
		return false, status.Errorf(codes.InvalidArgument, "unexpected ext_proc request %T", v)
	}
}

func (st *stream) wrapSend(send sendFunc, r *extprocv3.ProcessingResponse) error {
	if err := send(r); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	return nil
}

// headerBytes returns a header's value bytes (raw_value preferred).
func headerBytes(h *corev3.HeaderValue) []byte {
	if len(h.GetRawValue()) > 0 {
		return h.GetRawValue()
	}
	return []byte(h.GetValue())
}

// parseLength parses a decimal Content-Length; -1 if malformed.
func parseLength(b []byte) int {
	if len(b) == 0 || len(b) > 18 {
		return -1
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return -1
		}
		n = n*10 + int(c-'0')
	}
	return n
}

func isProtocolHeader(k string) bool {
	return strings.HasPrefix(k, HeaderDestination) || strings.HasPrefix(k, "x-switchyard-")
}

func (st *stream) onRequestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders, send sendFunc) (bool, error) {
	st.readSubset(req)
	st.headers = h.GetHeaders().GetHeaders()
	st.noteRequest()
	for _, hv := range st.headers {
		k := hv.GetKey()
		switch {
		case k == ":path":
			st.path = headerBytes(hv)
		case k == ":method":
			st.method = headerBytes(hv)
		case k == "content-length":
			st.contentLength = parseLength(headerBytes(hv))
		case len(k) > 2 && (k[0] == 'x' || k[0] == 'X') && k[1] == '-':
			if k = strings.ToLower(k); isProtocolHeader(k) {
				st.remove = append(st.remove, k)
			}
		}
	}
	if done, err := st.authenticate(send); done || err != nil {
		return done, err
	}
	if st.contentLength > st.s.opts.MaxBodyBytes {
		return st.reject(413, fmt.Sprintf("request body of %d bytes exceeds the %d byte limit", st.contentLength, st.s.opts.MaxBodyBytes), send)
	}
	if h.GetEndOfStream() || st.reqMode == modeNone {
		st.headerOnly = true
		return st.decide(send)
	}
	if st.reqMode == modeBuffered || st.reqMode == modePartial {
		// Envoy buffers the body only after the headers are answered; the
		// destination goes into the body response's header mutation.
		cr := &extprocv3.CommonResponse{}
		if len(st.remove) > 0 {
			cr.HeaderMutation = &extprocv3.HeaderMutation{RemoveHeaders: st.remove}
		}
		return false, st.wrapSend(send, requestHeadersResponse(cr))
	}
	if st.reqMode == modeStreamed && !st.bodyEarly {
		// STREAMED mode would withhold the body until the headers are
		// answered, but the destination depends on the body: ask Envoy to
		// switch this request to FULL_DUPLEX_STREAMED (the one transition a
		// standalone mode_override allows; needs allow_mode_override).
		override := &extprocv3.ProcessingResponse{ModeOverride: &extprocfilterv3.ProcessingMode{
			RequestBodyMode:    modeDuplex,
			RequestTrailerMode: extprocfilterv3.ProcessingMode_SEND,
			ResponseBodyMode:   st.respMode,
		}}
		if err := st.wrapSend(send, override); err != nil {
			return false, err
		}
		st.reqMode = modeDuplex
	}
	// FULL_DUPLEX_STREAMED / STREAMED: hold the headers until the body is
	// complete.
	return false, nil
}

func (st *stream) onRequestBody(b *extprocv3.HttpBody, send sendFunc) (bool, error) {
	if st.decided {
		// Not expected (body after a header-only decision); pass it on.
		return false, st.passRequestBody(b, send)
	}
	data := b.GetBody()
	if len(st.body)+len(data) > st.s.opts.MaxBodyBytes {
		return st.reject(413, fmt.Sprintf("request body exceeds the %d byte limit", st.s.opts.MaxBodyBytes), send)
	}
	switch {
	case len(data) == 0:
	case st.body == nil:
		// Use the message's bytes as they are (each received message is
		// ours; nothing mutates it): Envoy often sends the whole body in
		// one message, followed by an empty one ending the stream.
		st.body = data
	default:
		if !st.bodyOwned {
			// A second piece: gather them into our own buffer.
			buf := make([]byte, len(st.body), max(st.contentLength, len(st.body)+len(data)))
			copy(buf, st.body)
			st.body, st.bodyOwned = buf, true
		}
		st.body = append(st.body, data...)
	}
	if st.reqMode == modeStreamed {
		st.chunkLens = append(st.chunkLens, len(data))
	}
	if b.GetEndOfStream() || st.reqMode == modeBuffered || st.reqMode == modePartial {
		return st.decide(send)
	}
	return false, nil
}

func (st *stream) passRequestBody(b *extprocv3.HttpBody, send sendFunc) error {
	if st.reqMode == modeDuplex {
		return st.wrapSend(send, newStreamedChunk(true, b.GetBody(), b.GetEndOfStream()))
	}
	return st.wrapSend(send, requestBodyResponse(&extprocv3.CommonResponse{}))
}

func (st *stream) onRequestTrailers(send sendFunc) (bool, error) {
	if !st.decided {
		st.trailers = true
		if done, err := st.decide(send); done || err != nil {
			return done, err
		}
	}
	return false, st.wrapSend(send, requestTrailersResponse())
}

// reject sends a local reply and ends the stream.
func (st *stream) reject(code int, msg string, send sendFunc) (bool, error) {
	return st.rejectWith(code, msg, send, "", 0)
}

// rejectWith is reject with the admission queue's reason header and a
// retry-after hint (when reason is set).
func (st *stream) rejectWith(code int, msg string, send sendFunc, reason string, after time.Duration) (bool, error) {
	st.decided = true
	st.noteReject(code, msg)
	i := rejectIndex(code)
	st.s.stats.rejected[i].Add(1)
	if st.obj != nil {
		st.obj.errors[i].Add(1)
	}
	if st.s.debug {
		st.s.log.Debug("request rejected", "status", code, "reason", msg, "path", string(st.path))
	}
	r := immediate(code, msg)
	if reason != "" {
		hm := r.GetImmediateResponse().GetHeaders()
		hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderAdmission, reason), setHeader("retry-after", retryAfter(after)))
	}
	st.replyHeaders(r, code)
	return true, st.wrapSend(send, r)
}

// decide picks the endpoint(s) once the request is complete and releases
// the held request messages.
func (st *stream) decide(send sendFunc) (bool, error) {
	st.decided = true
	if r := st.answerModels(); r != nil {
		return true, st.wrapSend(send, r)
	}
	st.s.stats.requests.Add(1)
	t0 := time.Now()
	code, msg, body, dest := st.pick()
	st.s.stats.decision.observe(time.Since(t0))
	st.noteDecisionTime(time.Since(t0))
	if code == codeQueue {
		// Saturated: wait in the pool's admission queue, then pick again
		// with what the dispatcher saw free (the pool view may be newer).
		pv := st.pool
		st.pool = nil
		tk, err := st.queueWait(pv, send)
		if err != nil {
			return st.rejectAdmission(err, send)
		}
		st.admitted = true
		t1 := time.Now()
		code, msg, body, dest = st.pick()
		st.noteDecisionTime(time.Since(t1))
		tk.Done()
	}
	if code != 0 {
		if code == 429 && msg == "" {
			return st.rejectWith(code, shedMessage(poolName(st.pool), st.clientModel), send, admission.ReasonShed, time.Second)
		}
		return st.reject(code, msg, send)
	}
	var remove []string
	for _, k := range st.remove {
		if k != HeaderDestination && k != HeaderPool {
			remove = append(remove, k)
		}
	}
	clen := len(body)
	if st.headerOnly {
		clen = -1
	}
	asBody := !st.headerOnly && (st.reqMode == modeBuffered || st.reqMode == modePartial)
	d := newDecision(dest, string(dest), st.pool.nameBytes, clen, remove, asBody)
	st.upstreamKey(d)

	if st.headerOnly {
		return false, st.wrapSend(send, &d.pr)
	}
	switch st.reqMode {
	case modeBuffered, modePartial:
		if st.bodyRewritten {
			d.cr.BodyMutation = replaceBody(body)
		}
		return false, st.wrapSend(send, &d.pr)
	case modeStreamed:
		if err := st.wrapSend(send, &d.pr); err != nil {
			return false, err
		}
		// One answer per received chunk, the rewritten body laid over the
		// original chunk boundaries (the last chunk absorbs the size change).
		off := 0
		for i, n := range st.chunkLens {
			cr := &extprocv3.CommonResponse{}
			if st.bodyRewritten {
				lo, hi := min(off, len(body)), min(off+n, len(body))
				if i == len(st.chunkLens)-1 {
					hi = len(body)
				}
				cr.BodyMutation = replaceBody(body[lo:hi])
			}
			off += n
			if err := st.wrapSend(send, requestBodyResponse(cr)); err != nil {
				return false, err
			}
		}
		return false, nil
	default: // FULL_DUPLEX_STREAMED
		if err := st.wrapSend(send, &d.pr); err != nil {
			return false, err
		}
		chunk := st.s.opts.StreamChunkBytes
		for off := 0; ; off += chunk {
			end := min(off+chunk, len(body))
			last := end == len(body)
			if err := st.wrapSend(send, newStreamedChunk(true, body[off:end], last && !st.trailers)); err != nil {
				return false, err
			}
			if last {
				return false, nil
			}
		}
	}
}

// pick resolves pool and model, runs the scheduler and accounts the pick.
// A non-zero code is a local reply.
func (st *stream) pick() (code int, msg string, body []byte, dest []byte) {
	s := st.s
	snap := s.snap.Load()
	body = st.body
	var (
		pv     *poolView
		mv     *modelView
		target string
		r      openai.Request // the body's model and prompt spans
	)
	inference := openai.IsInferencePath(string(st.path))
	if len(body) == 0 {
		if inference && string(st.method) == "POST" {
			return 400, "request body is empty: a JSON object with a \"model\" field is required", nil, nil
		}
		pv = snap.headerOnlyPool
	} else if req, tok, err := openai.ModelSpan(body); err != nil {
		if inference {
			return 400, err.Error(), nil, nil
		}
		pv, r = snap.headerOnlyPool, req
	} else {
		r = req
		// Look the model up without materialising the name when possible.
		if !openai.NeedsDecode(tok) {
			mv = snap.models[string(tok[1:len(tok)-1])]
		} else if name := openai.DecodeString(tok); name != "" {
			mv = snap.models[name]
			r.Model = name
		}
		if mv == nil {
			if r.Model == "" {
				r.Model = string(tok[1 : len(tok)-1])
			}
			st.clientModel, target = r.Model, r.Model
			if snap.unknownPool == nil {
				st.noteUnknownModel(snap)
				return 404, fmt.Sprintf("model %q does not exist", r.Model), nil, nil
			}
			pv = snap.unknownPool
		} else {
			st.clientModel = mv.model.Name
			pv = mv.pool
			target, st.obj = mv.target(randN)
			st.obj.requests.Add(1)
			if target != mv.model.Name {
				body = openai.RewriteModel(body, r, target)
				st.rewritten, st.bodyRewritten = true, true
				s.stats.rewritten.Add(1)
			}
		}
	}
	if st.ten != nil {
		if code, msg := st.tenantAdmit(snap, &body); code != 0 {
			return code, msg, nil, nil
		}
	}
	if pv == nil {
		return 503, "no pool is configured for this request", nil, nil
	}
	sc := s.scratch.Get().(*sched.Scratch)
	defer s.scratch.Put(sc)
	// The request lives in the scratch: plug-ins take it by pointer
	// through interfaces, so a local one would be a heap allocation.
	sreq := &sc.Req
	*sreq = sched.Request{
		Model: st.clientModel, TargetModel: target,
		Tokens: openai.EstimateTokens(body), Subset: st.subset, HasSubset: st.hasSubset, Body: body,
		Now: time.Now(), Explain: s.debug, Record: st.obs.detailed(),
	}
	defer func() { *sreq = sched.Request{} }() // drop references to this request's body
	if sreq.Record {
		defer func() { st.notePick(pv, target, sreq, sc, code, dest) }()
	}
	if mv != nil {
		sreq.Priority = mv.model.Priority
	}
	if st.tenantPriority != nil {
		sreq.Priority = *st.tenantPriority
	}
	if pv.admission.PriorityHeader != "" {
		sreq.Priority = st.priority(pv, sreq.Priority)
	}
	prof := pv.profile
	cands := prof.Filter(sreq, pv.eps, sc)
	if len(cands) == 0 && len(pv.ready) == 0 {
		if st.admit(pv, sreq, cands, true) == admitWait {
			return st.queue(pv, sreq)
		}
		return 503, fmt.Sprintf("no ready endpoint in pool %q", pv.name), nil, nil
	}
	if len(cands) == 0 {
		switch {
		case sc.EmptiedBy == sched.FilterModel:
			// Never a server that does not serve the name: it would
			// answer its own 404 in its own shape.
			return 503, fmt.Sprintf("no ready endpoint serves model %q", st.clientModel), nil, nil
		case st.hasSubset:
			return 503, fmt.Sprintf("no ready endpoint in pool %q matches the endpoint subset", pv.name), nil, nil
		}
		return 503, fmt.Sprintf("no ready endpoint in pool %q", pv.name), nil, nil
	}
	if st.admitted && len(cands) > 1 {
		cands = s.withHeadroom(pv, cands, sreq.Now)
	}
	switch st.admit(pv, sreq, cands, false) {
	case admitShed:
		st.pool = pv
		return 429, "", nil, nil
	case admitWait:
		return st.queue(pv, sreq)
	}
	if pv.usesSession {
		sreq.Session = st.header(pv.sessionHeader)
	}
	if pv.usesPrefix && len(body) > 0 {
		// The prompt's bytes are the same in the original and a rewritten
		// body (only the model token differs), so the spans found in the
		// original serve both.
		ph := pv.state.hasher.Load()
		sc.Hashes = ph.h.Hash(sc.Hashes[:0], target, r.Prompt(st.body))
		sreq.Hashes = sc.Hashes
		sreq.BlockTokens = ph.blockTokens
	}
	picked := prof.Rank(sreq, cands, s.opts.MaxEndpoints, sc)
	if len(picked) == 0 {
		return 503, fmt.Sprintf("no ready endpoint in pool %q", pv.name), nil, nil
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
	dest = d
	st.pool, st.primary, st.tokens = pv, picked[0], sreq.Tokens
	if pv.predictor != nil {
		if pred, ok := sc.Prediction(st.primary.Address); ok {
			st.trackTTFT(st.primary, pred, sreq.Now, r.Stream)
		}
	}
	st.primary.Load.InFlightRequests.Add(1)
	st.primary.Load.InFlightTokens.Add(st.tokens)
	st.publish(pv.name, st.primary.Address, st.tokens, sreq.Hashes, sreq.Session)
	st.primary.Load.Picked.Add(1)
	if mv != nil {
		st.running = mv.running
		st.running.Add(1)
	}
	s.stats.picked.Add(1)
	if s.debug {
		s.log.Debug("picked endpoint", "pool", pv.name, "profile", prof.Name, "model", st.clientModel, "target", target,
			"destination", string(dest), "candidates", len(cands), "scores", sc.Explanation)
	}
	return 0, "", body, dest
}

// codeQueue is pick's answer for a request that must wait in the pool's
// admission queue (st.pool and st.waiting say where and as what).
const codeQueue = -1

// queue records what the admission queue needs to hold the request.
func (st *stream) queue(pv *poolView, req *sched.Request) (int, string, []byte, []byte) {
	st.pool = pv
	st.waiting = admission.Request{Priority: req.Priority, Flow: st.flow(pv), Bytes: int64(len(st.body)), Tokens: req.Tokens}
	return codeQueue, "", nil, nil
}

// header returns the value of request header name (lower case), or "".
func (st *stream) header(name string) string {
	for _, hv := range st.headers {
		if hv.GetKey() == name {
			return string(headerBytes(hv))
		}
	}
	return ""
}

func (st *stream) readSubset(req *extprocv3.ProcessingRequest) {
	v, ok := metadataFields(req.GetMetadataContext(), SubsetNamespace)[MetadataSubset]
	if !ok {
		return
	}
	st.hasSubset = true
	add := func(s string) {
		for _, a := range strings.Split(s, ",") {
			if a = strings.TrimSpace(a); a != "" {
				st.subset = append(st.subset, a)
			}
		}
	}
	if l := v.GetListValue(); l != nil {
		for _, e := range l.GetValues() {
			add(e.GetStringValue())
		}
		return
	}
	add(v.GetStringValue())
}

// recordServed notes the endpoint Envoy reports as having served the
// request, and moves the in-flight accounting there when a fallback served.
func (st *stream) recordServed(req *extprocv3.ProcessingRequest) {
	if st.servedSeen {
		return
	}
	v, ok := metadataFields(req.GetMetadataContext(), MetadataNamespace)[MetadataServed]
	if !ok {
		return
	}
	st.servedSeen = true
	addr := v.GetStringValue()
	if l := v.GetListValue(); l != nil && len(l.GetValues()) > 0 {
		addr = l.GetValues()[0].GetStringValue()
	}
	st.noteServed(addr)
	if st.s.debug {
		st.s.log.Debug("served endpoint reported", "served", addr, "pool", poolName(st.pool))
	}
	if st.pool == nil || st.primary == nil {
		return
	}
	ep := st.s.snap.Load().pools[st.pool.name].lookup(addr)
	if ep == nil {
		return
	}
	ep.Load.Served.Add(1)
	if ep.Address != st.primary.Address {
		st.s.stats.fallbackServed.Add(1)
		if !st.released {
			st.primary.Load.InFlightRequests.Add(-1)
			st.primary.Load.InFlightTokens.Add(-st.tokens)
			ep.Load.InFlightRequests.Add(1)
			ep.Load.InFlightTokens.Add(st.tokens)
			st.primary = ep
			st.moveTTFT(ep)
			// The other replicas move it too.
			st.unpublish()
			st.publish(st.pool.name, ep.Address, st.tokens, nil, "")
		}
	}
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

func (st *stream) onResponseHeaders(h *extprocv3.HttpHeaders, send sendFunc) error {
	st.ttftHeaders()
	dropLength := false
	if st.rewritten && st.respMode != modeNone && !h.GetEndOfStream() {
		ct, encoded := "", false
		for _, hv := range h.GetHeaders().GetHeaders() {
			switch strings.ToLower(hv.GetKey()) {
			case "content-type":
				ct = headerValue(hv)
			case "content-encoding":
				// Compressed bodies cannot be rewritten; pass them through.
				v := strings.TrimSpace(headerValue(hv))
				encoded = v != "" && !strings.EqualFold(v, "identity")
			}
		}
		if kind := openai.KindOf(ct); kind != openai.Passthrough && !encoded {
			st.rw = openai.NewResponseRewriter(kind, st.clientModel, st.s.opts.MaxBodyBytes)
			dropLength = true
		}
	}
	r := newResponseHeaders(dropLength)
	if st.ten != nil {
		st.tenantResponseHeaders(h, r)
	}
	if err := st.wrapSend(send, r); err != nil {
		return err
	}
	if h.GetEndOfStream() {
		st.release()
	}
	return nil
}

func (st *stream) onResponseBody(b *extprocv3.HttpBody, send sendFunc) error {
	data, eos := b.GetBody(), b.GetEndOfStream()
	st.ttftBody()
	var r *extprocv3.ProcessingResponse
	switch st.respMode {
	case modeDuplex:
		out, _ := st.responseFilter(data, eos)
		if len(out) > 0 || eos {
			r = newStreamedChunk(false, out, eos)
		}
	case modeBuffered, modePartial:
		cr := &extprocv3.CommonResponse{}
		if out, changed := st.responseFilter(data, true); changed {
			cr.BodyMutation = replaceBody(out)
			cr.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setHeader("content-length", strconv.Itoa(len(out))),
			}}
		}
		r = responseBodyResponse(cr)
	default: // STREAMED: exactly one answer per chunk
		cr := &extprocv3.CommonResponse{}
		if out, changed := st.responseFilter(data, eos); changed {
			cr.BodyMutation = replaceBody(out)
		}
		r = responseBodyResponse(cr)
	}
	if r != nil {
		if err := st.wrapSend(send, r); err != nil {
			return err
		}
	}
	if eos {
		st.release()
	}
	return nil
}

func (st *stream) onResponseTrailers(send sendFunc) error {
	defer st.release()
	if st.respMode == modeDuplex {
		if out, _ := st.responseFilter(nil, true); len(out) > 0 {
			if err := st.wrapSend(send, newStreamedChunk(false, out, false)); err != nil {
				return err
			}
		}
	}
	return st.wrapSend(send, responseTrailersResponse())
}
