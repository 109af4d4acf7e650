package sidecar

import (
	"bufio"
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/internal/testutil"
)

// pageSum sums the samples of one metric family on a /metrics page.
func pageSum(page, name string) float64 {
	total := 0.0
	sc := bufio.NewScanner(strings.NewReader(page))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		n := line
		if i := strings.IndexAny(n, "{ "); i >= 0 {
			n = n[:i]
		}
		if n != name {
			continue
		}
		f := strings.Fields(line[strings.LastIndexAny(line, "} ")+1:])
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			total += v
		}
	}
	return total
}

func realMetric(t *testing.T, s *realvllm.Server, name string) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	page, err := s.MetricsPage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return pageSum(page, name)
}

// TestRealVLLMDisaggregated runs the sidecar in front of a real vLLM 0.32
// decode server, with a real vLLM prefill server, both with vLLM's
// NixlConnector moving the KV cache over UCX/TCP on CPU (the tiny generated
// model): completions and streamed chat are split, the decode server
// receives the prefill's KV (NIXL transfers and external prefix-cache hits
// on its metrics page), usage counts the prompt once, and an unreachable
// prefill server leaves the decode server to do it all.
func TestRealVLLMDisaggregated(t *testing.T) {
	py := realvllm.Require(t)
	nixl := realvllm.RequireNIXL(t)
	m := realvllm.EnsureModel(t, py)
	opts := realvllm.Options{KVConnector: "NixlConnector", PythonPath: []string{nixl}}
	servers := realvllm.StartFleet(t, py, m, opts, opts)
	p, d := servers[0], servers[1]

	dead := testutil.FreeAddr(t)
	h, err := New(Config{
		Decoder:        &url.URL{Scheme: "http", Host: d.Addr},
		Allowed:        func(hp string) bool { return hp == p.Addr || hp == dead },
		PrefillTimeout: 2 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	pr := &pair{h: h, sidecar: srv}
	hdr := map[string]string{pd.PrefillerHeader: p.Addr}

	// Completions: the prompt runs on the prefill server, its KV moves.
	promptBefore := realMetric(t, p, "vllm:prompt_tokens_total")
	a := pr.post(t, "/v1/completions", hdr, map[string]any{"model": "tiny", "prompt": words("tok", 150), "max_tokens": 5, "ignore_eos": true})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "split" {
		t.Fatalf("completions: %d %s %s", a.code, a.header.Get(pd.ResultHeader), a.body)
	}
	u := usageOf(t, a)
	prefilled := realMetric(t, p, "vllm:prompt_tokens_total") - promptBefore
	if u.PromptTokens == 0 || float64(u.PromptTokens) != prefilled || u.CompletionTokens != 5 {
		t.Errorf("usage %+v; the prefill server ran %v prompt tokens: want the same prompt, counted once, and 5 completion tokens", u, prefilled)
	}
	if got := realMetric(t, d, "vllm:nixl_xfer_time_seconds_count"); got < 1 {
		t.Errorf("decode server made %v NIXL transfers, want at least 1", got)
	}
	if got := realMetric(t, d, "vllm:external_prefix_cache_hits_total"); got < float64(u.PromptTokens)-32 {
		t.Errorf("decode server received %v tokens of KV for a %d-token prompt", got, u.PromptTokens)
	}

	// Chat, streamed with usage.
	msgs := []map[string]any{{"role": "user", "content": words("chat", 120)}}
	a = pr.post(t, "/v1/chat/completions", hdr, map[string]any{"model": "tiny", "messages": msgs, "max_tokens": 4, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true}})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "split" {
		t.Fatalf("chat stream: %d %s %s", a.code, a.header.Get(pd.ResultHeader), a.body)
	}
	if u := usageOf(t, a); u.CompletionTokens != 4 || u.PromptTokens < 120 {
		t.Errorf("chat usage %+v", u)
	}
	if got := realMetric(t, d, "vllm:nixl_xfer_time_seconds_count"); got < 2 {
		t.Errorf("decode server made %v NIXL transfers after two splits", got)
	}

	// The prefill server is gone: the decode server serves it whole.
	a = pr.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: dead}, map[string]any{"model": "tiny", "prompt": words("gone", 100), "max_tokens": 3, "ignore_eos": true})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "fallback" {
		t.Fatalf("dead prefill server: %d %s %s", a.code, a.header.Get(pd.ResultHeader), a.body)
	}
	if u := usageOf(t, a); u.CompletionTokens != 3 {
		t.Errorf("fallback usage %+v", u)
	}
}
