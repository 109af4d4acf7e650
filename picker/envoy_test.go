package picker

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

const (
	// The ext_proc processing the tests' Envoy (testutil.StartEnvoyPool)
	// is given: the xDS translator's, and the other modes the picker
	// serves.
	duplexMode   = testutil.EnvoyFullDuplex
	bufferedMode = `                request_body_mode: BUFFERED
                response_body_mode: BUFFERED`
	streamedEarlyMode = `                request_body_mode: STREAMED
                response_body_mode: STREAMED
              send_body_without_waiting_for_header_response: true`
	streamedOverrideMode = `                request_body_mode: STREAMED
                response_body_mode: STREAMED
              allow_mode_override: true`
)

// TestEnvoyEndToEnd runs real Envoy, two real vllm-sim servers and the
// picker, in the processing mode the xDS translator configures
// (FULL_DUPLEX_STREAMED) and in BUFFERED mode.
func TestEnvoyEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy and vllm-sim")
	}
	testutil.EnvoyPath(t) // skip before starting the simulators when there is no Envoy
	sim := testutil.Binary(t, "vllm-sim")

	const served = "llama-3-8b-instruct"
	var sims []string
	for i := 0; i < 2; i++ {
		port := testutil.FreePort(t)
		testutil.Start(t, fmt.Sprintf("vllm-sim-%d", i), sim, "-port", fmt.Sprint(port), "-model", served, "-time-scale", "50",
			"-max-model-len", "1000000", "-max-num-batched-tokens", "1000000", "-num-gpu-blocks", "200000")
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		sims = append(sims, addr)
	}
	for _, a := range sims {
		testutil.WaitHTTP(t, "http://"+a+"/health", 10*time.Second)
	}
	for _, mode := range []struct{ name, cfg string }{
		{"full-duplex", duplexMode}, {"buffered", bufferedMode},
		{"streamed-early-body", streamedEarlyMode}, {"streamed-upgraded", streamedOverrideMode},
	} {
		t.Run(mode.name, func(t *testing.T) {
			envoyRoundTrips(t, sims, mode.cfg)
		})
	}
}

func envoyRoundTrips(t *testing.T, sims []string, mode string) {
	const served = "llama-3-8b-instruct"

	// The second simulator is draining: every request must land on the
	// first, which proves Envoy honours the picker's choice (the fallback
	// round robin would spread them).
	st := registry.Empty()
	st.Version = 1
	st.Pools["alpha"] = &registry.Pool{Name: "alpha", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{
		{Address: sims[0]}, {Address: sims[1], Draining: true},
	}}
	st.Models["chat"] = &registry.Model{Name: "chat", Pool: "alpha", Targets: []registry.Target{{Name: served, Weight: 1}}}
	st.Models[served] = &registry.Model{Name: served, Pool: "alpha"}
	srv := New(registry.NewPublisher(st), Options{}, nil)
	picker := serveGRPC(t, srv)

	base := testutil.StartEnvoyPool(t, testutil.EnvoyPool{Name: "alpha", Endpoints: sims, Picker: picker.String(), Processing: mode})

	post := func(body string) (*http.Response, string) {
		t.Helper()
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}

	t.Run("rewrite both ways, JSON", func(t *testing.T) {
		resp, body := post(`{"model":"chat","messages":[{"role":"user","content":"hello there"}],"max_tokens":3}`)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		var out struct{ Model string }
		if err := json.Unmarshal([]byte(body), &out); err != nil || out.Model != "chat" {
			t.Errorf("response model %q (%v), want the client's name back: %s", out.Model, err, body)
		}
		if got := resp.Header.Get("x-served-by"); got != sims[0] {
			t.Errorf("served by %q, want %q", got, sims[0])
		}
	})
	t.Run("rewrite both ways, SSE", func(t *testing.T) {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"stream please"}],"max_tokens":5,"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		events := 0
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line := sc.Text()
			if !strings.HasPrefix(line, "data: {") {
				continue
			}
			events++
			if !strings.Contains(line, `"model":"chat"`) {
				t.Errorf("SSE event not rewritten: %s", line)
			}
		}
		if resp.StatusCode != 200 || events == 0 {
			t.Errorf("status %d, %d events", resp.StatusCode, events)
		}
	})
	t.Run("large prompt rewritten", func(t *testing.T) {
		// BUFFERED mode is bounded by Envoy's per-connection buffer limit
		// (1 MiB default: Envoy itself answers 413 beyond it).
		size := 1 << 20
		if mode == bufferedMode {
			size = 256 << 10
		}
		resp, body := post(`{"model":"chat","messages":[{"role":"user","content":"` + strings.Repeat("word ", size/5) + `"}],"max_tokens":1}`)
		if resp.StatusCode != 200 || !strings.Contains(body, `"model":"chat"`) {
			t.Fatalf("status %d: %.300s", resp.StatusCode, body)
		}
	})
	t.Run("header-only request", func(t *testing.T) {
		resp, err := http.Get(base + "/health")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != sims[0] {
			t.Errorf("GET /health: %d served by %q: %s", resp.StatusCode, resp.Header.Get("x-served-by"), b)
		}
	})
	t.Run("model list answered by the picker", func(t *testing.T) {
		resp, err := http.Get(base + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != "" ||
			testutil.ContainsAll(string(b), `"object":"list"`, `"id":"chat"`, `"id":"`+served+`"`) != nil {
			t.Errorf("GET /v1/models: %d served by %q: %s", resp.StatusCode, resp.Header.Get("x-served-by"), b)
		}
	})
	t.Run("local replies", func(t *testing.T) {
		for body, code := range map[string]int{`{"model":"nope"}`: 404, `{"model":`: 400, `{"messages":[]}`: 400} {
			resp, b := post(body)
			if resp.StatusCode != code || !strings.Contains(b, fmt.Sprintf(`"code":%d`, code)) ||
				!strings.HasPrefix(resp.Header.Get("content-type"), "application/json") {
				t.Errorf("%s: %d %s (%s)", body, resp.StatusCode, b, resp.Header.Get("content-type"))
			}
		}
	})
	t.Run("client cannot pick the endpoint", func(t *testing.T) {
		req, _ := http.NewRequest("POST", base+"/v1/chat/completions",
			strings.NewReader(`{"model":"`+served+`","messages":[{"role":"user","content":"x"}],"max_tokens":1}`))
		req.Header.Set("x-gateway-destination-endpoint", sims[1])
		req.Header.Set("x-switchyard-pool", "other")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != sims[0] {
			t.Errorf("status %d served by %q", resp.StatusCode, resp.Header.Get("x-served-by"))
		}
	})

	t.Run("50 concurrent requests", func(t *testing.T) {
		errs := make(chan error, 50)
		for i := 0; i < 50; i++ {
			go func(i int) {
				resp, err := http.Post(base+"/v1/chat/completions", "application/json",
					strings.NewReader(fmt.Sprintf(`{"model":"chat","messages":[{"role":"user","content":"req %d"}],"max_tokens":2}`, i)))
				if err != nil {
					errs <- err
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || !strings.Contains(string(b), `"model":"chat"`) {
					err = fmt.Errorf("request %d: %d %.200s", i, resp.StatusCode, b)
				}
				errs <- err
			}(i)
		}
		for i := 0; i < 50; i++ {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
	})
	t.Run("client disconnects mid-stream", func(t *testing.T) {
		if mode == bufferedMode {
			t.Skip("BUFFERED response mode cannot stream: Envoy holds the whole (here unbounded) SSE body")
		}
		resp, err := http.Post(base+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"chat","messages":[{"role":"user","content":"long"}],"max_tokens":200000,"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "data: ") {
			t.Fatalf("first event %q: %v", line, err)
		}
		if n, _ := srv.InFlight(); n != 1 {
			t.Errorf("in-flight %d while streaming, want 1", n)
		}
		resp.Body.Close() // drops the connection mid-stream
		testutil.Eventually(t, 5*time.Second, "in-flight released after disconnect", func() error {
			if n, _ := srv.InFlight(); n != 0 {
				return fmt.Errorf("in-flight %d", n)
			}
			return nil
		})
	})

	testutil.Eventually(t, 5*time.Second, "in-flight back to zero", func() error {
		if n, _ := srv.InFlight(); n != 0 {
			return fmt.Errorf("in-flight %d", n)
		}
		return nil
	})
	stats := srv.Stats()
	var servedCount int64
	for _, e := range stats.Endpoints {
		servedCount += e.Served
	}
	if servedCount == 0 || servedCount != stats.Picked {
		t.Errorf("served reports %d for %d picks: Envoy's x-gateway-destination-endpoint-served metadata not seen", servedCount, stats.Picked)
	}
}
