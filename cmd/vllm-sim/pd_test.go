package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/switchyard/switchyard/internal/testutil"
)

// prefillParams is what a prefill answers in kv_transfer_params.
type prefillAnswer struct {
	completion
	KV map[string]any `json:"kv_transfer_params"`
}

func prefillBody(prompt string) map[string]any {
	return map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 1, "stream": false,
		"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
			"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}}
}

func histSum(fams map[string]*dto.MetricFamily, name string) float64 {
	f, ok := fams[name]
	if !ok || len(f.GetMetric()) == 0 {
		return -1
	}
	return f.GetMetric()[0].GetHistogram().GetSampleSum()
}

// prefill runs a prefill on p and returns its answer.
func prefill(t *testing.T, p *simProc, prompt string) prefillAnswer {
	t.Helper()
	r := p.post(t, "/v1/completions", prefillBody(prompt))
	if r.code != http.StatusOK {
		t.Fatalf("prefill: %d %s", r.code, r.body)
	}
	var a prefillAnswer
	if err := json.Unmarshal(r.body, &a); err != nil {
		t.Fatalf("prefill answer %s: %v", r.body, err)
	}
	return a
}

func TestDisaggregatedPrefillProtocol(t *testing.T) {
	p := startSim(t, "-kv-connector", "NixlConnector")
	d := startSim(t, "-kv-connector", "NixlConnector", "-kv-cache-transfer-latency", "1ms", "-kv-cache-transfer-time-per-token", "1us")
	prompt := words("w", 600) // 600 tokens: 37 full blocks and a partial one

	a := prefill(t, p, prompt)
	kv := a.KV
	if kv == nil {
		t.Fatalf("prefill answer has no kv_transfer_params")
	}
	if kv["do_remote_prefill"] != true || kv["do_remote_decode"] != false {
		t.Errorf("kv_transfer_params flags = %v, %v; want true, false", kv["do_remote_prefill"], kv["do_remote_decode"])
	}
	host, port, _ := strings.Cut(p.addr, ":")
	if kv["remote_host"] != host || fmt.Sprint(kv["remote_port"]) != port {
		t.Errorf("remote_host:port = %v:%v, want %s", kv["remote_host"], kv["remote_port"], p.addr)
	}
	if groups, _ := kv["remote_block_ids"].([]any); len(groups) != 1 {
		t.Errorf("remote_block_ids %v, want one list per KV-cache group (one here)", kv["remote_block_ids"])
	} else if ids, _ := groups[0].([]any); len(ids) != 38 {
		t.Errorf("remote_block_ids has %d blocks, want 38 (600 tokens in 16-token blocks)", len(ids))
	}
	for _, k := range []string{"remote_engine_id", "remote_request_id", "tp_size"} {
		if kv[k] == nil || kv[k] == "" {
			t.Errorf("kv_transfer_params.%s is missing", k)
		}
	}
	if kv["remote_num_tokens"] != 600.0 || a.Usage.PromptTokens != 600 || a.Usage.CompletionTokens != 1 {
		t.Errorf("remote_num_tokens %v, usage %+v; want 600 tokens held, 600 prompt and 1 completion token", kv["remote_num_tokens"], *a.Usage)
	}
	if u := value(p.metrics(t), "vllm:kv_cache_usage_perc"); u <= 0 {
		t.Errorf("prefill's KV usage %v after the prefill: its blocks should be held for the decoder", u)
	}

	// The decode pulls the blocks and prefills only the last prompt token.
	decodeReq := map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": kv}
	r := d.post(t, "/v1/completions", decodeReq)
	if r.code != http.StatusOK {
		t.Fatalf("decode: %d %s", r.code, r.body)
	}
	c := decode(t, r.body)
	if c.Usage.PromptTokens != 600 || c.Usage.CompletionTokens != 8 || c.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("decode usage %+v; want 600 prompt tokens, 8 completion, 0 cached (the prefill's own hits)", *c.Usage)
	}
	if got := value(d.metrics(t), "vllm:external_prefix_cache_hits_total"); got != 600 {
		t.Errorf("decode's external prefix cache hits %v, want the 600 transferred tokens", got)
	}
	if got := histSum(d.metrics(t), "vllm:request_prefill_kv_computed_tokens"); got != 600 {
		t.Errorf("decode's computed-tokens histogram %v, want 600 (vLLM counts the prompt less the prefill's own hits)", got)
	}
	if u := value(p.metrics(t), "vllm:kv_cache_usage_perc"); u != 0 {
		t.Errorf("prefill's KV usage %v after the pull, want 0 (blocks freed)", u)
	}

	// Pulled once: the blocks are gone, and vLLM's default policy fails
	// the request.
	r = d.post(t, "/v1/completions", decodeReq)
	if r.code != http.StatusInternalServerError || !strings.Contains(string(r.body), `"type":"InternalServerError"`) {
		t.Errorf("second pull: %d %s; want 500 InternalServerError", r.code, r.body)
	}
	stream := map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 8, "stream": true, "kv_transfer_params": kv}
	r = d.post(t, "/v1/completions", stream)
	if r.code != http.StatusOK || !strings.HasPrefix(string(r.body), `data: {"error":`) || !strings.HasSuffix(string(r.body), "data: [DONE]\n\n") {
		t.Errorf("second pull, streaming: %d %q; want 200 with an error event", r.code, r.body)
	}

	// A known engine is found where it was first reached, whatever the
	// port says (vLLM handshakes once per engine id).
	moved := map[string]any{}
	for k, v := range prefill(t, p, prompt).KV {
		moved[k] = v
	}
	moved["remote_port"] = testutil.FreePort(t)
	r = d.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": moved})
	if r.code != http.StatusOK {
		t.Errorf("known engine, wrong port: %d %s; want 200", r.code, r.body)
	}
	// An engine never reached, on a dead port, fails the request.
	moved["remote_engine_id"] = "11111111-1111-4111-8111-111111111111"
	r = d.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": moved})
	if r.code != http.StatusInternalServerError {
		t.Errorf("unknown prefill server: %d %s; want 500", r.code, r.body)
	}
	// So does an engine id the server at the address does not have (a
	// restarted prefill: vLLM's "Remote NIXL agent engine ID mismatch").
	moved["remote_port"] = kv["remote_port"]
	moved["remote_engine_id"] = "00000000-0000-4000-8000-000000000000"
	r = d.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": moved})
	if r.code != http.StatusInternalServerError {
		t.Errorf("unknown engine id: %d %s; want 500", r.code, r.body)
	}

	// A server without the connector ignores kv_transfer_params.
	plain := startSim(t)
	r = plain.post(t, "/v1/completions", prefillBody(prompt))
	if r.code != http.StatusOK || strings.Contains(string(r.body), "kv_transfer_params") {
		t.Errorf("server without connector: %d %s; want a plain answer", r.code, r.body)
	}
}

func TestDisaggregatedPrefillRecomputeAndLease(t *testing.T) {
	p := startSim(t, "-kv-connector", "NixlConnector", "-kv-lease-duration", "300ms")
	d := startSim(t, "-kv-connector", "NixlConnector", "-kv-load-failure-policy", "recompute")
	prompt := words("x", 300)
	kv := prefill(t, p, prompt).KV
	// The lease runs out: the prefill frees the blocks by itself.
	testutil.Eventually(t, 10*time.Second, "held blocks expire", func() error {
		if u := value(p.metrics(t), "vllm:kv_cache_usage_perc"); u != 0 {
			return fmt.Errorf("KV usage %v", u)
		}
		return nil
	})
	// With kv_load_failure_policy recompute the decode prefills it all.
	r := d.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})
	if r.code != http.StatusOK {
		t.Fatalf("decode after expiry with recompute: %d %s", r.code, r.body)
	}
	if got := value(d.metrics(t), "vllm:external_prefix_cache_hits_total"); got != 0 {
		t.Errorf("decode's external hits %v after a failed pull, want 0 (it computed all 300 tokens)", got)
	}
}

func TestDisaggregatedPrefillChatStream(t *testing.T) {
	p := startSim(t, "-kv-connector", "NixlConnector")
	d := startSim(t, "-kv-connector", "NixlConnector")
	msgs := []map[string]any{{"role": "user", "content": words("q", 400)}}
	r := p.post(t, "/v1/chat/completions", map[string]any{"model": baseModel, "messages": msgs, "max_tokens": 1,
		"max_completion_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true}})
	var a prefillAnswer
	if r.code != http.StatusOK || json.Unmarshal(r.body, &a) != nil || a.KV == nil {
		t.Fatalf("chat prefill: %d %s", r.code, r.body)
	}
	r = d.post(t, "/v1/chat/completions", map[string]any{"model": baseModel, "messages": msgs, "max_tokens": 5,
		"stream": true, "stream_options": map[string]any{"include_usage": true}, "kv_transfer_params": a.KV})
	if r.code != http.StatusOK {
		t.Fatalf("chat decode: %d %s", r.code, r.body)
	}
	var usage *completion
	for _, line := range strings.Split(string(r.body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		c := decode(t, []byte(data))
		if c.Usage != nil {
			usage = &c
		}
	}
	if usage == nil || usage.Usage.PromptTokens != a.Usage.PromptTokens || usage.Usage.CompletionTokens != 5 {
		t.Fatalf("stream usage %+v; want the prefill's %d prompt tokens and 5 completion tokens", usage, a.Usage.PromptTokens)
	}
	if got := value(d.metrics(t), "vllm:external_prefix_cache_hits_total"); got != float64(a.Usage.PromptTokens) {
		t.Errorf("decode's external hits %v, want the %d transferred tokens", got, a.Usage.PromptTokens)
	}
}

func TestKVFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"-kv-connector", "P2pNcclConnector"},
		{"-kv-load-failure-policy", "retry"},
		{"-kv-lease-duration", "0s"},
		{"-kv-cache-transfer-latency", "-1ms"},
		{"-kv-connector", "NixlConnector", "-host", "0.0.0.0"},
	} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) accepted", args)
		}
	}
}

// TestSimPrefillAnswerMatchesRealVLLM compares the simulator's answer to
// a prefill request with the one real vLLM 0.32 (CPU build, NixlConnector
// over UCX/TCP) gave, recorded in testdata/vllm-0.32.0/pd-prefill.json:
// the same JSON field paths and types, kv_transfer_params included.
func TestSimPrefillAnswerMatchesRealVLLM(t *testing.T) {
	rec, err := os.ReadFile("testdata/vllm-0.32.0/pd-prefill.json")
	if err != nil {
		t.Fatal(err)
	}
	want, err := jsonShape(string(rec))
	if err != nil {
		t.Fatal(err)
	}
	p := startSim(t, "-kv-connector", "NixlConnector")
	r := p.post(t, "/v1/completions", prefillBody(words("w", 300)))
	if r.code != http.StatusOK {
		t.Fatalf("prefill: %d %s", r.code, r.body)
	}
	got, err := jsonShape(string(r.body))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("the simulator's prefill answer lacks %q", w)
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			t.Errorf("the simulator's prefill answer has %q, real vLLM's does not", g)
		}
	}
}
