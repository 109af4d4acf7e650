package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/switchyard/switchyard/cmd/vllm-sim/sim"
)

// Disaggregated prefill, as vLLM's NixlConnector does it (vLLM 0.32):
//
//   - A request with kv_transfer_params.do_remote_decode runs here as a
//     prefill (the caller sends max_tokens 1, stream false). When it
//     finishes, its KV blocks stay allocated for the lease, and the answer
//     carries kv_transfer_params naming them: do_remote_prefill true,
//     remote_engine_id, remote_request_id, remote_block_ids, remote_host,
//     remote_port, tp_size, remote_num_tokens, remote_prefill_cached_tokens.
//   - A request with kv_transfer_params.do_remote_prefill and those fields
//     pulls the blocks from remote_host:remote_port before it queues,
//     waiting the transfer time, and is then not prefilled for them.
//
// vLLM's NIXL side channel is a port of its own (VLLM_NIXL_SIDE_CHANNEL_PORT);
// here it is the HTTP port: POST /_sim/kv/pull. A pull fails when the
// prefill is unreachable, is another engine (restarted: new engine id), or
// no longer holds the blocks (pulled already, or the lease ran out). The
// decode then fails the request as vLLM's default kv_load_failure_policy
// "fail" does (500, or an error event in a stream), or with "recompute"
// prefills the whole prompt itself.

// kvConnectorNixl is the -kv-connector value that turns the protocol on.
const kvConnectorNixl = "NixlConnector"

// kvPullPath is the simulated NIXL side channel.
const kvPullPath = "/_sim/kv/pull"

// pdConfig is the server's disaggregation settings; the zero value is off.
type pdConfig struct {
	enabled       bool
	engineID      string
	advertiseHost string // remote_host sent to decoders
	advertisePort int
	recompute     bool // kv_load_failure_policy "recompute" rather than "fail"
	client        *http.Client

	// peers remembers where each remote engine was first reached: like
	// vLLM's NIXL handshake, done once per engine id.
	mu    sync.Mutex
	peers map[string]string
}

// kvParams is the part of a request's kv_transfer_params the simulator
// reads.
type kvParams struct {
	DoRemoteDecode            bool    `json:"do_remote_decode"`
	DoRemotePrefill           bool    `json:"do_remote_prefill"`
	RemoteEngineID            *string `json:"remote_engine_id"`
	RemoteRequestID           *string `json:"remote_request_id"`
	RemoteHost                *string `json:"remote_host"`
	RemotePort                *int    `json:"remote_port"`
	RemoteNumTokens           *int    `json:"remote_num_tokens"`
	RemotePrefillCachedTokens *int    `json:"remote_prefill_cached_tokens"`
}

// newEngineID returns a random id in vLLM's uuid4 text form.
func newEngineID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// prefillParams is the kv_transfer_params a finished prefill answers with.
func (p *pdConfig) prefillParams(requestID string, ev sim.Event) map[string]any {
	return map[string]any{
		"do_remote_prefill":            true,
		"do_remote_decode":             false,
		"remote_block_ids":             [][]int{ev.KVBlocks}, // one list per KV-cache group
		"remote_engine_id":             p.engineID,
		"remote_request_id":            requestID,
		"remote_host":                  p.advertiseHost,
		"remote_port":                  p.advertisePort,
		"tp_size":                      1,
		"dcp_size":                     1,
		"pp_size":                      1,
		"remote_num_tokens":            ev.KVTokens,
		"remote_blocks_expiry_time":    nil,
		"transfer_mode":                "pull",
		"remote_prefill_cached_tokens": ev.Usage.CachedTokens,
	}
}

// pullRequest is the body of a pull on the side channel.
type pullRequest struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
}

// handlePull hands a held prefill's blocks to a decoder.
func (s *server) handlePull(w http.ResponseWriter, r *http.Request) {
	var req pullRequest
	if !decodeBody(w, r, &req) {
		return
	}
	if req.EngineID != s.pd.engineID {
		writeError(w, http.StatusNotFound, fmt.Sprintf("unknown engine %q (this is %q)", req.EngineID, s.pd.engineID))
		return
	}
	n, err := s.eng.PullKV(req.RequestID)
	if err != nil {
		writeError(w, http.StatusNotFound, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"num_tokens": n})
}

// errKVLoad marks a failed pull of remote KV.
var errKVLoad = errors.New("kv load failed")

// pullRemote fetches the blocks a decode request's kv_transfer_params name
// and returns how many tokens they hold.
func (p *pdConfig) pullRemote(ctx context.Context, kv *kvParams) (int, error) {
	if kv.RemoteHost == nil || kv.RemotePort == nil || kv.RemoteEngineID == nil || kv.RemoteRequestID == nil {
		return 0, fmt.Errorf("%w: kv_transfer_params lack remote_host, remote_port, remote_engine_id or remote_request_id", errKVLoad)
	}
	addr := net.JoinHostPort(*kv.RemoteHost, strconv.Itoa(*kv.RemotePort))
	p.mu.Lock()
	if known, ok := p.peers[*kv.RemoteEngineID]; ok {
		addr = known
	}
	p.mu.Unlock()
	body, _ := json.Marshal(pullRequest{EngineID: *kv.RemoteEngineID, RequestID: *kv.RemoteRequestID})
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+kvPullPath, bytes.NewReader(body))
	if err != nil {
		return 0, fmt.Errorf("%w: %v", errKVLoad, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%w: handshake with %s: %v", errKVLoad, addr, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%w: %s answered %d: %s", errKVLoad, addr, resp.StatusCode, bytes.TrimSpace(b))
	}
	var out struct {
		NumTokens int `json:"num_tokens"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return 0, fmt.Errorf("%w: %s: %v", errKVLoad, addr, err)
	}
	p.mu.Lock()
	if p.peers == nil {
		p.peers = map[string]string{}
	}
	p.peers[*kv.RemoteEngineID] = addr
	p.mu.Unlock()
	return out.NumTokens, nil
}

// writeKVLoadError answers a request whose remote KV could not be loaded
// as vLLM does with kv_load_failure_policy "fail": the request finishes
// with reason "error", which the API server turns into a 500, or into an
// error event when streaming.
func writeKVLoadError(w http.ResponseWriter, stream bool) {
	const msg = "Internal server error"
	if !stream {
		writeErrorType(w, http.StatusInternalServerError, "InternalServerError", msg)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "InternalServerError", "param": nil, "code": http.StatusInternalServerError}})
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", b)
}
