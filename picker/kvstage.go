package picker

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/picker/sched"
)

// kvStage routes a pool's requests by what its servers' KV-cache events
// say they hold (picker/kvevents), in the chain of a pool that declares
// kv_events and whose profile ranks by cached prefixes (the prefix or
// TTFT scorer). Before the scorers rank, the request's prompt becomes an
// exact cache view (sched.Request.Cache) from the pool's token cache,
// never waiting for a server: servers whose view is synced are ranked by
// what they hold, the others (and requests whose prompt is not known
// yet) by the estimating prefix index. After the pick the prompt's blocks
// count as on their way to the primary until its events announce them
// (kvevents.Query.Routed: requests sharing the prompt follow it instead
// of scattering while it is computed), and the stage keeps what the view
// predicted for the primary, which the response's
// usage.prompt_tokens_details.cached_tokens (JSON answers, and streams
// that ask for usage) checks (switchyard_kv_events_predictions_total).
// Its per-request state is request.kv.
type kvStage struct {
	kv   *kvevents.Manager
	pool string
}

var (
	_ rankStage            = (*kvStage)(nil)
	_ servedStage          = (*kvStage)(nil)
	_ responseHeadersStage = (*kvStage)(nil)
	_ responseBodyStage    = (*kvStage)(nil)
	_ releasedStage        = (*kvStage)(nil)
)

// kvStageFor is in the chain of a pool with KV events whose profile
// reads cached prefixes.
func kvStageFor(s *Server, _ *snapshot, pv *poolView) any {
	if pv == nil || !pv.usesPrefix {
		return nil
	}
	kv := s.kv.Load()
	if kv == nil || kv.Index(pv.name) == nil {
		return nil
	}
	return &kvStage{kv: kv, pool: pv.name}
}

// kvReq is a request's KV-event state: the view while it is ranked, then
// the prediction for its primary and the response's usage, read from the
// tail of its body.
type kvReq struct {
	q *kvevents.Query
	// The prediction: addr holds predicted of the prompt's tokens
	// (exactly, or at least with bound); ok while it stands (the primary
	// served).
	addr      string
	predicted int
	bound     bool
	ok        bool
	watch     bool    // the response's usage is read
	tail      *[]byte // the body's last usageTail bytes
}

// usageTail is how much of a response's end is kept to find its usage
// in: vLLM puts it at the end of a JSON answer, and in the last event
// before [DONE] of a stream that asks for it.
const usageTail = 4 << 10

var (
	addrBufs = sync.Pool{New: func() any { return new([]string) }}
	tailBufs = sync.Pool{New: func() any { b := make([]byte, 0, usageTail); return &b }}
)

// kvAPI says whether path is chat or text completions (the requests the
// exact view can key).
func kvAPI(path []byte) (chat, ok bool) {
	p := string(path)
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	switch strings.TrimSuffix(p, "/") {
	case "/v1/chat/completions":
		return true, true
	case "/v1/completions":
		return false, true
	}
	return false, false
}

// rank sets the request's exact cache view when the pool's token cache
// knows its prompt (or a stable prefix of it).
func (st *kvStage) rank(r *request, req *sched.Request, cands []*sched.Endpoint) {
	chat, ok := kvAPI(r.path)
	if !ok || len(r.upstream) == 0 {
		return
	}
	buf := addrBufs.Get().(*[]string)
	addrs := (*buf)[:0]
	for _, e := range cands {
		addrs = append(addrs, e.Address)
	}
	q, err := st.kv.Prepare(r.ctx, st.pool, addrs, kvevents.Prompt{Model: r.target, Chat: chat, Body: r.upstream})
	clear(addrs)
	*buf = addrs[:0]
	addrBufs.Put(buf)
	if err != nil {
		return // the estimate answers
	}
	r.kv.q = q
	req.Cache = q
}

// ranked keeps the view's prediction for the primary and releases the
// view.
func (st *kvStage) ranked(r *request, req *sched.Request, sc *sched.Scratch, primary *sched.Endpoint) {
	q := r.kv.q
	if q == nil {
		return
	}
	if primary != nil {
		// A count that leans on requests routed there whose blocks are
		// not announced yet is a routing hint, not a prediction.
		if n, ok := sc.CachedTokens(primary.Address); ok && !q.Tentative(primary.Address) {
			r.kv.addr, r.kv.predicted, r.kv.bound, r.kv.ok = primary.Address, n, q.Bounded(n), true
		}
		q.Routed(primary.Address)
	}
	req.Cache = nil
	r.kv.q = nil
	q.Release()
}

// served drops the prediction when another endpoint served.
func (st *kvStage) served(r *request, addr string, _ bool) {
	if r.kv.ok && addr != r.kv.addr {
		r.kv.ok = false
	}
}

// responseHeaders starts reading a successful response's usage.
func (st *kvStage) responseHeaders(r *request, h *extprocv3.HttpHeaders, _ *extprocv3.ProcessingResponse) {
	if !r.kv.ok || !r.respBody || h.GetEndOfStream() {
		return
	}
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch strings.ToLower(hv.GetKey()) {
		case ":status":
			if code, _ := strconv.Atoi(headerValue(hv)); code/100 != 2 {
				return
			}
		case "content-encoding":
			if v := strings.TrimSpace(headerValue(hv)); v != "" && !strings.EqualFold(v, "identity") {
				return
			}
		}
	}
	r.kv.watch = true
	r.kv.tail = tailBufs.Get().(*[]byte)
	*r.kv.tail = (*r.kv.tail)[:0]
}

// responseBody keeps the body's tail and, at its end, checks the
// prediction against the usage it reports.
func (st *kvStage) responseBody(r *request, data []byte, eos bool) ([]byte, bool) {
	k := &r.kv
	if !k.watch {
		return data, false
	}
	t := *k.tail
	switch {
	case len(data) >= usageTail:
		t = append(t[:0], data[len(data)-usageTail:]...)
	case len(t)+len(data) > usageTail:
		drop := len(t) + len(data) - usageTail
		t = append(t[:copy(t, t[drop:])], data...)
	default:
		t = append(t, data...)
	}
	*k.tail = t
	if !eos {
		return data, false
	}
	k.watch = false
	if cached, ok := cachedTokens(t); ok {
		if x := st.kv.Index(st.pool); x != nil {
			if k.bound {
				x.ObserveBound(k.addr, k.predicted, cached)
			} else {
				x.Observe(k.addr, k.predicted, cached)
			}
		}
	}
	return data, false
}

// released returns the request's buffers.
func (st *kvStage) released(r *request) {
	k := &r.kv
	if k.q != nil {
		k.q.Release()
		k.q = nil
	}
	if k.tail != nil {
		tailBufs.Put(k.tail)
		k.tail = nil
	}
	k.watch, k.ok = false, false
}

// cachedTokens reads usage.prompt_tokens_details.cached_tokens from the
// last usage object in the tail of a response body (a JSON answer or an
// event stream); ok is false when there is none (the server does not
// report cached tokens: vLLM needs --enable-prompt-tokens-details).
func cachedTokens(tail []byte) (int, bool) {
	i := bytes.LastIndex(tail, []byte(`"usage"`))
	if i < 0 {
		return 0, false
	}
	rest := bytes.TrimLeft(tail[i+len(`"usage"`):], " \t\r\n")
	if len(rest) == 0 || rest[0] != ':' {
		return 0, false
	}
	var u struct {
		Details *struct {
			Cached *int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	}
	if json.NewDecoder(bytes.NewReader(rest[1:])).Decode(&u) != nil || u.Details == nil || u.Details.Cached == nil {
		return 0, false
	}
	return *u.Details.Cached, true
}
