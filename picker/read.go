package picker

import (
	"fmt"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	pdwire "github.com/switchyard/switchyard/internal/pd"
)

// The read stage: the request's headers (method, path, declared length,
// the client-sent protocol headers that must not reach a server, the
// endpoint subset hint from Envoy's metadata) and its body, gathered from
// the body messages, within Options.MaxBodyBytes (413).

// readHeaders reads the request headers and the subset hint in md.
func (r *request) readHeaders(md *corev3.Metadata, h *extprocv3.HttpHeaders) {
	r.readSubset(md)
	r.headers = h.GetHeaders().GetHeaders()
	for _, hv := range r.headers {
		k := hv.GetKey()
		switch {
		case k == ":path":
			r.path = headerBytes(hv)
		case k == ":method":
			r.method = headerBytes(hv)
		case k == "content-length":
			r.contentLength = parseLength(headerBytes(hv))
		case len(k) > 2 && (k[0] == 'x' || k[0] == 'X') && k[1] == '-':
			if k = strings.ToLower(k); isProtocolHeader(k) {
				r.remove = append(r.remove, k)
			}
		}
	}
}

// checkLength refuses a request whose declared length exceeds the limit.
func (r *request) checkLength() reply {
	if r.contentLength > r.s.opts.MaxBodyBytes {
		return reply{code: 413, msg: fmt.Sprintf("request body of %d bytes exceeds the %d byte limit", r.contentLength, r.s.opts.MaxBodyBytes)}
	}
	return reply{}
}

// readBody adds a piece of the request body, or refuses the request when
// the body exceeds the limit.
func (r *request) readBody(data []byte) reply {
	if len(r.body)+len(data) > r.s.opts.MaxBodyBytes {
		return reply{code: 413, msg: fmt.Sprintf("request body exceeds the %d byte limit", r.s.opts.MaxBodyBytes)}
	}
	switch {
	case len(data) == 0:
	case r.body == nil:
		// Use the message's bytes as they are (each received message is
		// ours; nothing mutates it): Envoy often sends the whole body in
		// one message, followed by an empty one ending the stream.
		r.body = data
	default:
		if !r.bodyOwned {
			// A second piece: gather them into our own buffer.
			buf := make([]byte, len(r.body), max(r.contentLength, len(r.body)+len(data)))
			copy(buf, r.body)
			r.body, r.bodyOwned = buf, true
		}
		r.body = append(r.body, data...)
	}
	return reply{}
}

// header returns the value of request header name (lower case), or "".
func (r *request) header(name string) string {
	for _, hv := range r.headers {
		if hv.GetKey() == name {
			return string(headerBytes(hv))
		}
	}
	return ""
}

func (r *request) readSubset(md *corev3.Metadata) {
	v, ok := metadataFields(md, SubsetNamespace)[MetadataSubset]
	if !ok {
		return
	}
	r.hasSubset = true
	add := func(s string) {
		for _, a := range strings.Split(s, ",") {
			if a = strings.TrimSpace(a); a != "" {
				r.subset = append(r.subset, a)
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

// isProtocolHeader reports whether a client-sent header (lower case) is
// one only switchyard may set: the destination headers, switchyard's own
// (x-switchyard-*), and the prefill/decode routing headers a decode
// server's sidecar acts on (pd.ClientHeaders), removed from every request
// of every pool so that no client names a server.
func isProtocolHeader(k string) bool {
	return strings.HasPrefix(k, HeaderDestination) || strings.HasPrefix(k, "x-switchyard-") || slices.Contains(pdwire.ClientHeaders, k)
}
