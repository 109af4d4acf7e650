// Package sidecar owns the two-step request of prefill/decode
// disaggregation: an http.Handler that sits in front of one decode server
// (a vLLM with a KV connector) and, when a request names a prefill server
// it trusts in pd.PrefillerHeader, first sends the request to that server
// as a prefill, then sends it with the prefill's kv_transfer_params to its
// decode server, streaming the answer back. Every other request, and every
// request whose prefill fails, is served by the decode server alone, so no
// request is lost. cmd/pd-sidecar runs it.
package sidecar

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/internal/pd"
)

// MaxBody caps the request bodies the sidecar reads to split.
const MaxBody = 32 << 20

// MetricsPath is where the sidecar answers its own counters; every other
// path, /metrics included, is the decode server's.
const MetricsPath = "/pd-sidecar/metrics"

// Config configures a Handler.
type Config struct {
	// Decoder is the base URL of the decode server beside the sidecar.
	Decoder *url.URL
	// Allowed reports whether a prefill server may be contacted; nil
	// allows none unless AllowAny.
	Allowed func(hostport string) bool
	// Signer, when set, makes a valid pd.SignatureHeader a requirement
	// too: only a picker holding the key can name a prefill server.
	Signer *pd.Signer
	// MaxSignatureAge bounds how old a signature may be (default 60 s).
	MaxSignatureAge time.Duration
	// AllowAny trusts any prefill server a request names, as llm-d's
	// sidecar does without SSRF protection. For tests and closed networks.
	AllowAny bool
	// PrefillTimeout bounds the prefill step (default 60 s); past it the
	// decode server prefills itself.
	PrefillTimeout time.Duration
	// Client makes the prefill and decode requests (default: a client
	// without timeout, the request context bounds it).
	Client *http.Client
	// Log receives one line per fallback and refused prefill server.
	Log *slog.Logger
}

// Counters are the sidecar's cumulative outcomes.
type Counters struct {
	Split, Fallback, Local, Refused uint64
}

// Handler is the sidecar: an http.Handler.
type Handler struct {
	cfg   Config
	proxy *httputil.ReverseProxy

	split, fallback, local, refused atomic.Uint64
}

// New returns a Handler for cfg.
func New(cfg Config) (*Handler, error) {
	if cfg.Decoder == nil || cfg.Decoder.Host == "" {
		return nil, errors.New("sidecar: the decode server's URL is required")
	}
	if cfg.Allowed == nil && cfg.Signer == nil && !cfg.AllowAny {
		return nil, errors.New("sidecar: say which prefill servers may be contacted (an allow-list, a signing key, or AllowAny)")
	}
	if cfg.MaxSignatureAge == 0 {
		cfg.MaxSignatureAge = time.Minute
	}
	if cfg.PrefillTimeout == 0 {
		cfg.PrefillTimeout = time.Minute
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second}}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	h := &Handler{cfg: cfg}
	h.proxy = &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(cfg.Decoder)
			r.Out.Host = r.In.Host
		},
		Transport:     cfg.Client.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			cfg.Log.Warn("decode server unreachable", "err", err)
			writeError(w, http.StatusBadGateway, "decode server unreachable")
		},
	}
	return h, nil
}

// Counters returns the outcomes so far.
func (h *Handler) Counters() Counters {
	return Counters{Split: h.split.Load(), Fallback: h.fallback.Load(), Local: h.local.Load(), Refused: h.refused.Load()}
}

// writeMetrics answers the counters in Prometheus' text format.
func (h *Handler) writeMetrics(w http.ResponseWriter) {
	c := h.Counters()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	fmt.Fprintf(w, "# HELP pd_sidecar_requests_total Completions and chat requests by outcome: split (prefilled remotely), fallback (split failed, served whole), local (served whole).\n")
	fmt.Fprintf(w, "# TYPE pd_sidecar_requests_total counter\n")
	for _, v := range []struct {
		result string
		n      uint64
	}{{pd.ResultSplit, c.Split}, {pd.ResultFallback, c.Fallback}, {pd.ResultLocal, c.Local}} {
		fmt.Fprintf(w, "pd_sidecar_requests_total{result=%q} %d\n", v.result, v.n)
	}
	fmt.Fprintf(w, "# HELP pd_sidecar_refused_total Prefill servers named by a request that the sidecar does not trust.\n")
	fmt.Fprintf(w, "# TYPE pd_sidecar_refused_total counter\npd_sidecar_refused_total %d\n", c.Refused)
}

// splittable reports whether a request is one the two steps apply to.
func splittable(r *http.Request) bool {
	return r.Method == http.MethodPost && (r.URL.Path == "/v1/completions" || r.URL.Path == "/v1/chat/completions")
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	named := r.Header.Get(pd.PrefillerHeader)
	sig := r.Header.Get(pd.SignatureHeader)
	for _, k := range pd.ClientHeaders {
		r.Header.Del(k)
	}
	if r.URL.Path == MetricsPath && r.Method == http.MethodGet {
		h.writeMetrics(w)
		return
	}
	if !splittable(r) {
		h.proxy.ServeHTTP(w, r)
		return
	}
	prefiller := ""
	if named != "" {
		prefiller = h.trusted(named, sig, r)
	}
	if prefiller == "" {
		h.local.Add(1)
		w.Header().Set(pd.ResultHeader, pd.ResultLocal)
		h.proxy.ServeHTTP(w, r)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "request body too large")
			return
		}
		writeError(w, http.StatusBadRequest, "cannot read the request body")
		return
	}
	h.twoStep(w, r, prefiller, body)
}

// trusted returns the first prefill server named that the sidecar may
// contact, or "".
func (h *Handler) trusted(named, sig string, r *http.Request) string {
	for _, hp := range pd.Prefillers(named) {
		if h.cfg.Signer != nil {
			if err := h.cfg.Signer.Verify(named, sig, h.cfg.MaxSignatureAge); err != nil {
				h.refuse(hp, err.Error(), r)
				return ""
			}
		}
		if !h.cfg.AllowAny && h.cfg.Allowed != nil && !h.cfg.Allowed(hp) {
			h.refuse(hp, "not an allowed prefill server", r)
			continue
		}
		return hp
	}
	return ""
}

func (h *Handler) refuse(hp, why string, r *http.Request) {
	h.refused.Add(1)
	h.cfg.Log.Warn("prefill server refused; decoding locally", "prefiller", hp, "reason", why, "client", r.RemoteAddr)
}

// twoStep runs the prefill on prefiller, then the decode here; any
// failure of the prefill step leaves the decode server to do it all.
func (h *Handler) twoStep(w http.ResponseWriter, r *http.Request, prefiller string, body []byte) {
	var req map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&req); err != nil || req == nil {
		// Not a JSON object: the decode server gives the client its 400.
		h.decode(w, r, body, nil, pd.ResultLocal)
		return
	}
	reqID := r.Header.Get("X-Request-Id")
	if reqID == "" {
		reqID = newRequestID()
		r.Header.Set("X-Request-Id", reqID)
	}
	params, err := h.prefill(r, prefiller, req)
	if err != nil {
		if r.Context().Err() != nil {
			return // the client went away
		}
		h.cfg.Log.Warn("prefill failed; decoding locally", "prefiller", prefiller, "request_id", reqID, "err", err)
		h.decode(w, r, body, nil, pd.ResultFallback)
		return
	}
	dbody, err := json.Marshal(pd.DecodeRequest(req, params))
	if err != nil {
		h.decode(w, r, body, nil, pd.ResultFallback)
		return
	}
	h.decode(w, r, dbody, body, pd.ResultSplit)
}

// prefill sends the prefill request and returns the kv_transfer_params of
// its answer (JSON null when the server sent none: a connector that keys
// the KV by prompt, such as vLLM's ExampleConnector, needs none).
func (h *Handler) prefill(r *http.Request, prefiller string, req map[string]any) (any, error) {
	pbody, err := json.Marshal(pd.PrefillRequest(req))
	if err != nil {
		return nil, fmt.Errorf("encode prefill request: %w", err)
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.PrefillTimeout)
	defer cancel()
	preq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+prefiller+r.URL.Path, bytes.NewReader(pbody))
	if err != nil {
		return nil, fmt.Errorf("prefill request: %w", err)
	}
	copyHeaders(preq.Header, r.Header)
	preq.Header.Set("Content-Type", "application/json")
	preq.Header.Del("Accept-Encoding")
	resp, err := h.cfg.Client.Do(preq)
	if err != nil {
		return nil, fmt.Errorf("prefill on %s: %w", prefiller, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
	if err != nil {
		return nil, fmt.Errorf("prefill on %s: read: %w", prefiller, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("prefill on %s answered %d: %s", prefiller, resp.StatusCode, snippet(b))
	}
	var out struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("prefill on %s: answer is not JSON: %w", prefiller, err)
	}
	if len(out.KV) == 0 {
		return nil, nil
	}
	return out.KV, nil
}

// decode sends body to the decode server and streams its answer to w.
// When the body carries a prefill's KV (fallbackBody non-nil) and the
// decode server fails before answering anything (a 5xx, or a stream whose
// first event is an error: vLLM's kv_load_failure_policy "fail" when the
// blocks are gone), it retries once with fallbackBody, without the KV.
func (h *Handler) decode(w http.ResponseWriter, r *http.Request, body, fallbackBody []byte, result string) {
	resp, first, err := h.send(r, body)
	if fallbackBody != nil && err == nil && failedBeforeOutput(resp, first) {
		resp.Body.Close()
		h.cfg.Log.Warn("decode could not load the prefill's KV; decoding locally", "status", resp.StatusCode, "request_id", r.Header.Get("X-Request-Id"))
		result = pd.ResultFallback
		resp, first, err = h.send(r, fallbackBody)
	}
	switch result {
	case pd.ResultSplit:
		h.split.Add(1)
	case pd.ResultFallback:
		h.fallback.Add(1)
	default:
		h.local.Add(1)
	}
	if err != nil {
		if r.Context().Err() == nil {
			h.cfg.Log.Warn("decode server unreachable", "err", err)
			writeError(w, http.StatusBadGateway, "decode server unreachable")
		}
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		if hopByHop[http.CanonicalHeaderKey(k)] {
			continue
		}
		w.Header()[k] = vs
	}
	w.Header().Del("Content-Length")
	w.Header().Set(pd.ResultHeader, result)
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	if len(first) > 0 {
		if _, err := w.Write(first); err != nil {
			return
		}
		if flusher != nil {
			flusher.Flush()
		}
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
		if err != nil {
			return
		}
	}
}

// send posts body to the decode server. For an event stream it also
// reads the first event, returned in first (and no longer in the body).
func (h *Handler) send(r *http.Request, body []byte) (*http.Response, []byte, error) {
	u := *h.cfg.Decoder
	u.Path = strings.TrimSuffix(u.Path, "/") + r.URL.Path
	u.RawQuery = r.URL.RawQuery
	dreq, err := http.NewRequestWithContext(r.Context(), http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return nil, nil, err
	}
	copyHeaders(dreq.Header, r.Header)
	dreq.Header.Set("Content-Type", "application/json")
	// Plain bytes, so that the first event can be read.
	dreq.Header.Del("Accept-Encoding")
	resp, err := h.cfg.Client.Do(dreq)
	if err != nil {
		return nil, nil, err
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return resp, nil, nil
	}
	br := bufio.NewReaderSize(resp.Body, 4096)
	var first []byte
	for {
		line, err := br.ReadBytes('\n')
		first = append(first, line...)
		if err != nil || len(bytes.TrimSpace(line)) == 0 && len(bytes.TrimSpace(first)) > 0 {
			break
		}
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{br, resp.Body}
	return resp, first, nil
}

// failedBeforeOutput reports a decode failure the client has not seen
// any of yet.
func failedBeforeOutput(resp *http.Response, first []byte) bool {
	if resp.StatusCode >= 500 {
		return true
	}
	return bytes.HasPrefix(bytes.TrimSpace(first), []byte(`data: {"error"`))
}

// hopByHop are the headers a proxy does not forward.
var hopByHop = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
}

// copyHeaders copies the client request's end-to-end headers.
func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		if hopByHop[k] || k == "Content-Length" || k == "Host" {
			continue
		}
		dst[k] = append([]string(nil), vs...)
	}
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "pd-" + hex.EncodeToString(b[:])
}

func snippet(b []byte) string {
	b = bytes.TrimSpace(b)
	if len(b) > 200 {
		return string(b[:200]) + "..."
	}
	return string(b)
}

// writeError answers in OpenAI's error shape, as vLLM does.
func writeError(w http.ResponseWriter, code int, msg string) {
	typ := "InternalServerError"
	switch code {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
		typ = "BadRequestError"
	case http.StatusBadGateway:
		typ = "BadGatewayError"
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": code}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(b)
}
