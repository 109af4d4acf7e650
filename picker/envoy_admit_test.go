package picker

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// TestEnvoyAdmissionQueue holds requests in the admission queue behind a
// real Envoy, in the mode xDS configures (FULL_DUPLEX_STREAMED) and in
// BUFFERED mode, where Envoy times the picker's answer: there the message
// timeout is cut to 300 ms, and a request that waits far longer must still
// be served, because the picker asks Envoy for more time. A request that
// waits out the pool's TTL gets Envoy's 429 with the reason headers.
func TestEnvoyAdmissionQueue(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy and vllm-sim")
	}
	testutil.EnvoyPath(t) // skip before starting the simulator when there is no Envoy
	port := testutil.FreePort(t)
	testutil.Start(t, "vllm-sim", testutil.Binary(t, "vllm-sim"), "-port", fmt.Sprint(port), "-model", "llama", "-time-scale", "50",
		"-max-model-len", "1000000", "-max-num-batched-tokens", "1000000", "-num-gpu-blocks", "200000")
	sim := fmt.Sprintf("127.0.0.1:%d", port)
	testutil.WaitHTTP(t, "http://"+sim+"/health", 10*time.Second)
	// BUFFERED requests; responses pass through (a buffered response
	// could not stream the answer that holds the slot).
	const bufferedRequests = `                request_body_mode: BUFFERED
                response_body_mode: NONE`
	for _, mode := range []struct{ name, cfg string }{{"full-duplex", duplexMode}, {"buffered", bufferedRequests}} {
		t.Run(mode.name, func(t *testing.T) { envoyAdmission(t, sim, mode.cfg) })
	}
}

func envoyAdmission(t *testing.T, sim, mode string) {
	st := registry.Empty()
	st.Version = 1
	st.Pools["alpha"] = &registry.Pool{Name: "alpha", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{{Address: sim}}}
	st.Models["llama"] = &registry.Model{Name: "llama", Pool: "alpha"}
	pub := registry.NewPublisher(st)
	// One request in flight saturates the pool (the in-flight guard; no
	// scraping needed).
	srv := New(pub, Options{MaxInFlightPerEndpoint: 1, DisableMetrics: true}, nil)
	runPicker(t, srv)
	picker := serveGRPC(t, srv)

	base := testutil.StartEnvoyPool(t, testutil.EnvoyPool{Name: "alpha", Endpoints: []string{sim}, Picker: picker.String(), Processing: mode,
		MessageTimeout: 300 * time.Millisecond, MaxMessageTimeout: 360 * time.Second})
	stats := func() (waiting int, dispatched uint64) {
		for _, s := range srv.AdmissionStats() {
			for _, w := range s.Waiting {
				waiting += w.Requests
			}
			dispatched = s.Dispatched
		}
		return waiting, dispatched
	}

	// A long streamed answer holds the only slot.
	holdResp, err := http.Post(base+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"llama","prompt":"hold","max_tokens":200000,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(holdResp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first event %q: %v", line, err)
	}

	type result struct {
		code int
		body string
		err  error
	}
	done := make(chan result, 1)
	sent := time.Now()
	go func() {
		resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"llama","prompt":"queued","max_tokens":2}`))
		if err != nil {
			done <- result{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{code: resp.StatusCode, body: string(b)}
	}()
	testutil.Eventually(t, 5*time.Second, "request queued", func() error {
		if w, _ := stats(); w != 1 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	// Hold it well past Envoy's 300 ms message timeout: it must still be
	// waiting, not failed by Envoy.
	select {
	case r := <-done:
		t.Fatalf("queued request answered while the pool was saturated: %d %s %v", r.code, r.body, r.err)
	case <-time.After(time.Second):
	}
	holdResp.Body.Close() // the slot frees
	r := <-done
	if r.err != nil || r.code != 200 {
		t.Fatalf("queued request: %d %.200s %v", r.code, r.body, r.err)
	}
	if waited := time.Since(sent); waited < time.Second {
		t.Errorf("served after %v: it cannot have waited", waited)
	}
	if _, d := stats(); d != 1 {
		t.Errorf("dispatched %d, want 1", d)
	}

	t.Run("TTL answered 429 through Envoy", func(t *testing.T) {
		st2 := registry.Empty()
		*st2 = *st
		st2.Version = 2
		p := *st.Pools["alpha"]
		p.Admission = &registry.Admission{TTL: 200 * time.Millisecond}
		st2.Pools = map[string]*registry.Pool{"alpha": &p}
		pub.Publish(st2)
		testutil.Eventually(t, 5*time.Second, "ttl applied", func() error {
			if s := srv.AdmissionStats(); len(s) != 1 || s[0].Config.TTL != 200*time.Millisecond {
				return fmt.Errorf("%+v", s)
			}
			return nil
		})
		hold, err := http.Post(base+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"llama","prompt":"hold","max_tokens":200000,"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		defer hold.Body.Close()
		if _, err := bufio.NewReader(hold.Body).ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"llama","prompt":"late","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 429 || resp.Header.Get(HeaderAdmission) != "ttl" || resp.Header.Get("retry-after") != "1" ||
			!strings.Contains(string(b), `"code":429`) {
			t.Errorf("got %d %s=%q retry-after=%q: %s", resp.StatusCode, HeaderAdmission, resp.Header.Get(HeaderAdmission),
				resp.Header.Get("retry-after"), b)
		}
	})
}
