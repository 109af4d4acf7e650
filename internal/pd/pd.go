// Package pd owns the wire facts of prefill/decode disaggregation that the
// picker and the decode-side sidecar (cmd/pd-sidecar) share: the header
// that names the prefill server (llm-d's x-prefiller-host-port), the
// signature switchyard adds to it so that a sidecar can tell a picker's
// choice from a client's, and how a client's request becomes the prefill
// request and the decode request of vLLM's KV-connector protocol
// (kv_transfer_params).
package pd

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Headers on the request from Envoy to a decode server's sidecar.
const (
	// PrefillerHeader names the prefill server, "ip:port" (llm-d's
	// routing.PrefillEndpointHeader). llm-d's sidecar also accepts a comma
	// list and uses its first entry.
	PrefillerHeader = "x-prefiller-host-port"
	// SignatureHeader carries switchyard's signature of PrefillerHeader
	// (Signer). llm-d's sidecar ignores it.
	SignatureHeader = "x-switchyard-prefiller-sig"
	// ResultHeader, on the sidecar's answer, says what it did: "split"
	// (prefilled remotely), "fallback" (tried, then ran it all locally)
	// or "local" (not asked to split, or refused to).
	ResultHeader = "x-switchyard-pd"
)

// ResultHeader's values.
const (
	ResultSplit    = "split"
	ResultFallback = "fallback"
	ResultLocal    = "local"
)

// ClientHeaders are the request headers a client must never be able to
// send through to a sidecar: the picker deletes them from every request
// before it may add its own.
var ClientHeaders = []string{PrefillerHeader, SignatureHeader, "x-encoder-hosts-ports", "x-kv-cache-source-host-port", "x-data-parallel-host-port"}

// signatureVersion prefixes every signature, so the scheme can change.
const signatureVersion = "v1"

// MinKeyLen is the shortest signing key accepted, in bytes.
const MinKeyLen = 16

// Signer signs prefill choices: an HMAC-SHA256 of the version, the
// prefill address and a Unix time under a key the picker and the sidecars
// share. A client cannot produce one, so a sidecar that requires it only
// ever contacts prefill servers a picker chose.
type Signer struct {
	key []byte
	now func() time.Time
}

// NewSigner returns a Signer for key (at least MinKeyLen bytes).
func NewSigner(key []byte) (*Signer, error) {
	if len(key) < MinKeyLen {
		return nil, fmt.Errorf("pd: signing key is %d bytes, want at least %d", len(key), MinKeyLen)
	}
	return &Signer{key: append([]byte(nil), key...), now: time.Now}, nil
}

func (s *Signer) mac(hostport string, unix int64) string {
	m := hmac.New(sha256.New, s.key)
	fmt.Fprintf(m, "%s|%s|%d", signatureVersion, hostport, unix)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// Sign returns the SignatureHeader value for hostport, now.
func (s *Signer) Sign(hostport string) string {
	t := s.now().Unix()
	return signatureVersion + "." + strconv.FormatInt(t, 10) + "." + s.mac(hostport, t)
}

// Errors Verify returns.
var (
	ErrNoSignature  = errors.New("pd: prefill header is not signed")
	ErrBadSignature = errors.New("pd: prefill header signature does not match")
	ErrStale        = errors.New("pd: prefill header signature is too old or from the future")
)

// Verify checks sig against hostport, accepting signatures made within
// maxAge of now (either way, for clock skew).
func (s *Signer) Verify(hostport, sig string, maxAge time.Duration) error {
	if sig == "" {
		return ErrNoSignature
	}
	parts := strings.Split(sig, ".")
	if len(parts) != 3 || parts[0] != signatureVersion {
		return ErrBadSignature
	}
	t, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return ErrBadSignature
	}
	if !hmac.Equal([]byte(parts[2]), []byte(s.mac(hostport, t))) {
		return ErrBadSignature
	}
	if d := s.now().Sub(time.Unix(t, 0)); d > maxAge || d < -maxAge {
		return ErrStale
	}
	return nil
}

// Prefillers splits a PrefillerHeader value (one address, or llm-d's comma
// list) into its trimmed, non-empty entries.
func Prefillers(v string) []string {
	var out []string
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// PrefillRequest turns a client's completions or chat request (decoded
// JSON object) into the prefill request of vLLM's KV-connector protocol,
// as vLLM's own reference proxy builds it: kv_transfer_params asking for a
// remote decode, no streaming, one output token, and no min_tokens (a
// prefill cannot honour them). req is not modified.
func PrefillRequest(req map[string]any) map[string]any {
	out := make(map[string]any, len(req)+1)
	for k, v := range req {
		out[k] = v
	}
	out["kv_transfer_params"] = map[string]any{
		"do_remote_decode":  true,
		"do_remote_prefill": false,
		"remote_engine_id":  nil,
		"remote_block_ids":  nil,
		"remote_host":       nil,
		"remote_port":       nil,
	}
	out["stream"] = false
	delete(out, "stream_options")
	out["max_tokens"] = 1
	if _, ok := out["max_completion_tokens"]; ok {
		out["max_completion_tokens"] = 1
	}
	delete(out, "min_tokens")
	delete(out, "min_completion_tokens")
	return out
}

// DecodeRequest is the client's request with the prefill's
// kv_transfer_params, for the decode server. req is not modified.
func DecodeRequest(req map[string]any, kvTransferParams any) map[string]any {
	out := make(map[string]any, len(req)+1)
	for k, v := range req {
		out[k] = v
	}
	out["kv_transfer_params"] = kvTransferParams
	return out
}
