package picker

import (
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/openai"
)

// The observe-the-response stage: the router's latency measurement
// (latency.go), the endpoint Envoy reports as having served the request
// (a fallback that served takes over the in-flight accounting), and the
// rewrite of the upstream model name back to the client's in JSON and
// event-stream bodies; the stages see the response headers and every body
// chunk after it.

// responseHeaders notes the response headers and returns their answer:
// content-length dropped when the body will be rewritten, plus the
// stages' additions (a tenant's rate-limit headers).
func (r *request) responseHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	r.lat.headers(h, time.Now())
	r.recordServed(md)
	dropLength := false
	if r.rewritten && r.respBody && !h.GetEndOfStream() {
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
			r.rw = openai.NewResponseRewriter(kind, r.clientModel, r.s.opts.MaxBodyBytes)
			dropLength = true
		}
	}
	resp := newResponseHeaders(dropLength)
	for _, hk := range r.ch.responseHeaders {
		hk.responseHeaders(r, h, resp)
	}
	return resp
}

// responseBodyMessage notes a response body message as it arrives (the
// message, before its bytes are filtered).
func (r *request) responseBodyMessage(md *corev3.Metadata, b *extprocv3.HttpBody) {
	r.s.stats.responseBodies.Add(1)
	r.lat.body(b.GetBody(), b.GetEndOfStream(), time.Now())
	r.recordServed(md)
}

// responseFilter runs a response body chunk through the model rewriter
// and the stages (the TTFT accounting, a tenant's usage tap); changed
// reports whether any may have altered it. The protocol adapter calls it
// once per body message (eos: the body ends) and, in
// FULL_DUPLEX_STREAMED, once more at the trailers to flush.
func (r *request) responseFilter(data []byte, eos bool) (out []byte, changed bool) {
	out = data
	if r.rw != nil {
		out, changed = r.rw.Write(out, eos), true
	}
	for _, h := range r.ch.responseBody {
		var c bool
		out, c = h.responseBody(r, out, eos)
		changed = changed || c
	}
	return out, changed
}

// recordServed notes the endpoint Envoy reports (in md) as having served
// the request, and moves the in-flight accounting there when a fallback
// served.
func (r *request) recordServed(md *corev3.Metadata) {
	if r.servedSeen {
		return
	}
	v, ok := metadataFields(md, MetadataNamespace)[MetadataServed]
	if !ok {
		return
	}
	r.servedSeen = true
	addr := v.GetStringValue()
	if l := v.GetListValue(); l != nil && len(l.GetValues()) > 0 {
		addr = l.GetValues()[0].GetStringValue()
	}
	if r.s.debug {
		r.s.log.Debug("served endpoint reported", "served", addr, "pool", poolName(r.pool))
	}
	moved := r.moveServed(addr)
	for _, h := range r.ch.served {
		h.served(r, addr, moved)
	}
}

// moveServed counts the request as served by addr and, when that is a
// fallback and the request is in flight, moves its in-flight accounting
// there (moved).
func (r *request) moveServed(addr string) (moved bool) {
	if r.pool == nil || r.primary == nil {
		return false
	}
	ep := r.s.snap.Load().pools[r.pool.name].lookup(addr)
	if ep == nil {
		return false
	}
	ep.Load.Served.Add(1)
	if ep.Address == r.primary.Address {
		return false
	}
	r.s.stats.fallbackServed.Add(1)
	if r.released {
		return false
	}
	r.primary.Load.InFlightRequests.Add(-1)
	r.primary.Load.InFlightTokens.Add(-r.tokens)
	ep.Load.InFlightRequests.Add(1)
	ep.Load.InFlightTokens.Add(r.tokens)
	r.primary = ep
	return true
}
