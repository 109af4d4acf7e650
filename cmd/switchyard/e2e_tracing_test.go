package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/internal/testutil/otlptest"
)

// traceTap is a reverse proxy in front of a simulator that records the
// traceparent of every inference request it forwards: what the model
// server receives.
type traceTap struct {
	Addr string
	mu   sync.Mutex
	seen []string
}

func startTraceTap(t *testing.T, upstream string) *traceTap {
	t.Helper()
	u, _ := url.Parse("http://" + upstream)
	rp := httputil.NewSingleHostReverseProxy(u)
	tap := &traceTap{}
	lis, err := net.Listen("tcp", testutil.FreeAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	tap.Addr = lis.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/completions") || strings.HasPrefix(r.URL.Path, "/v1/chat") {
			tap.mu.Lock()
			tap.seen = append(tap.seen, r.Header.Get("traceparent"))
			tap.mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() { _ = srv.Close() })
	return tap
}

func (tap *traceTap) traceparents() []string {
	tap.mu.Lock()
	defer tap.mu.Unlock()
	return append([]string(nil), tap.seen...)
}

// With tracing on, Envoy starts each request's trace and exports its
// spans, the picker's span is a child of Envoy's span for the ext_proc
// call (same trace), the model server receives the trace's traceparent
// from Envoy, the picker's span names the endpoint that served, and the
// request's decision record names its trace. A client's own sampled
// traceparent is continued rather than replaced.
func TestE2ETracing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and a simulator")
	}
	col := otlptest.Start(t)
	sim := startSim(t, simOptions{})
	tap := startTraceTap(t, sim.Addr)
	f := newFleet(t, fmt.Sprintf(`
pool "llama" {
  endpoints = [%q]
}
model "m-a" { pool = "llama" }
`, tap.Addr), fleetOptions{switchyardArgs: []string{"-tracing-endpoint", col.Addr, "-tracing-sample-ratio", "1"}})

	const n = 3
	for i := 0; i < n; i++ {
		resp, err := f.send(infReq{model: "m-a", prompt: fmt.Sprintf("hello %d", i), maxTokens: 4, stream: true, chat: true})
		checkOK(t, resp, err, "m-a")
	}
	const clientTrace = "5c1c63257de34c67a7ca9e1e2a7e5d81"
	resp, err := f.send(infReq{model: "m-a", prompt: "traced by the client", maxTokens: 2,
		headers: map[string]string{"traceparent": "00-" + clientTrace + "-a1b2c3d4e5f60718-01"}})
	checkOK(t, resp, err, "m-a")

	var picks []otlptest.Span
	envoy := map[string]otlptest.Span{} // by span ID
	testutil.Eventually(t, 30*time.Second, "every request's spans at the collector", func() error {
		picks = picks[:0]
		clear(envoy)
		for _, s := range col.Spans() {
			switch s.Service {
			case "switchyard":
				// (The fleet's own readiness probes are traced too.)
				if s.Attr("gen_ai.request.model") == "m-a" {
					picks = append(picks, s)
				}
			case "envoy":
				envoy[s.SpanID()] = s
			}
		}
		if len(picks) < n+1 {
			return fmt.Errorf("%d picker spans, %d Envoy spans", len(picks), len(envoy))
		}
		for _, p := range picks {
			if _, ok := envoy[p.ParentID()]; !ok {
				return fmt.Errorf("picker span %s: its parent %s has not arrived", p.SpanID(), p.ParentID())
			}
		}
		return nil
	})
	traces := map[string]bool{}
	for _, p := range picks {
		parent := envoy[p.ParentID()]
		if parent.TraceID() != p.TraceID() {
			t.Errorf("picker span in trace %s, its parent in %s", p.TraceID(), parent.TraceID())
		}
		// Envoy's ext_proc span hangs under Envoy's own request span.
		if root, ok := envoy[parent.ParentID()]; !ok && parent.TraceID() != clientTrace {
			t.Errorf("Envoy's span %q (parent of the pick) has no Envoy parent", parent.Span.GetName())
		} else if ok && root.TraceID() != p.TraceID() {
			t.Errorf("Envoy's request span in another trace")
		}
		if got := p.Attr("switchyard.endpoint.served"); got != tap.Addr {
			t.Errorf("span says served by %q, the endpoint is %s", got, tap.Addr)
		}
		if got := p.Attr("switchyard.endpoint.picked"); got != tap.Addr {
			t.Errorf("span says picked %q", got)
		}
		if p.Attr("http.response.status_code") != "200" || p.Event("scheduled") == nil || p.Attr("switchyard.endpoint.served") == "" {
			t.Errorf("span attributes/events: status %q events %d", p.Attr("http.response.status_code"), len(p.Span.GetEvents()))
		}
		traces[p.TraceID()] = true
	}
	if !traces[clientTrace] {
		t.Errorf("the client's trace %s was not continued: traces %v", clientTrace, traces)
	}
	// The model server received each traced request's context from Envoy.
	for _, tp := range tap.traceparents() {
		parts := strings.Split(tp, "-")
		if len(parts) != 4 || !traces[parts[1]] {
			t.Errorf("model server got traceparent %q, not one of the picked traces", tp)
			continue
		}
		if _, ok := envoy[parts[2]]; !ok {
			t.Errorf("model server's parent span %s is not an Envoy span", parts[2])
		}
	}
	if got := len(tap.traceparents()); got != n+1 {
		t.Errorf("model server saw %d requests, want %d", got, n+1)
	}

	// The decision records name the traces.
	body, err := httpGetString("http://" + f.admin + "/api/decisions?model=m-a")
	if err != nil {
		t.Fatal(err)
	}
	var dec struct {
		Records []struct {
			TraceID string `json:"trace_id"`
			Picked  string `json:"picked"`
			Outcome struct {
				Status int     `json:"status"`
				Served string  `json:"served"`
				TTFTMS float64 `json:"ttft_ms"`
				Tokens int     `json:"output_tokens"`
			} `json:"outcome"`
		} `json:"records"`
	}
	if err := json.Unmarshal([]byte(body), &dec); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	if len(dec.Records) != n+1 {
		t.Fatalf("%d decision records, want %d", len(dec.Records), n+1)
	}
	for _, r := range dec.Records {
		if !traces[r.TraceID] || r.Outcome.Status != 200 || r.Outcome.Served != tap.Addr || r.Outcome.TTFTMS <= 0 || r.Outcome.Tokens <= 0 {
			t.Errorf("record %+v", r)
		}
	}
}

// jsonLines parses every line of out as a JSON object and fails the test
// at the first that is not one.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("with -log-format json, switchyard wrote a line that is not JSON: %q\n--- output ---\n%s", l, tail(out, 4000))
		}
		lines = append(lines, m)
	}
	return lines
}

// With -log-format json, every line switchyard writes is JSON, also what
// libraries report on their own: with the trace collector down, the
// OpenTelemetry SDK fails an export every ~6 s (its 5 s timeout, then
// the next batch), and those failures come out as JSON lines of the
// "opentelemetry" component, at most one per kind per processLogEvery;
// the lines held back are counted on the next one, or at exit.
func TestE2EJSONLogsWithCollectorDown(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and a simulator")
	}
	closed := testutil.FreeAddr(t) // nothing listens there
	sim := startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf(`
pool "llama" {
  endpoints = [%q]
}
model "m-a" { pool = "llama" }
`, sim.Addr), fleetOptions{switchyardArgs: []string{"-log-format", "json", "-tracing-endpoint", closed, "-tracing-no-envoy", "-drain-delay", "0s"}})
	f.mu.Lock()
	sy := f.sy
	f.mu.Unlock()
	start := time.Now()

	otelLines := func(lines []map[string]any) []map[string]any {
		var out []map[string]any
		for _, l := range lines {
			if l["component"] == "opentelemetry" {
				out = append(out, l)
			}
		}
		return out
	}
	// Requests make spans, which the SDK fails to export.
	var last time.Time
	load := func() {
		if time.Since(last) < 200*time.Millisecond {
			return
		}
		last = time.Now()
		resp, err := f.send(infReq{model: "m-a", prompt: "spans for a collector that is down", maxTokens: 2})
		checkOK(t, resp, err, "m-a")
	}
	testutil.Eventually(t, 60*time.Second, "the first export failure logged", func() error {
		load()
		if n := len(otelLines(jsonLines(t, sy.Output()))); n == 0 {
			return errors.New("no opentelemetry line yet")
		}
		return nil
	})
	first := time.Now()
	// Load for 15 s more: two or three more failures, each held back
	// (they are of one kind).
	pace := time.NewTicker(200 * time.Millisecond)
	for range pace.C {
		if time.Since(first) > 15*time.Second {
			break
		}
		load()
	}
	pace.Stop()
	if got := otelLines(jsonLines(t, sy.Output())); len(got) != 1 {
		t.Errorf("%d opentelemetry lines within %v of the first, want 1 (one per %v):\n%v", len(got), time.Since(first).Round(time.Second), processLogEvery, got)
	}

	// At exit, what was held back is logged with its count.
	if err := sy.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sy.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("switchyard did not exit after SIGTERM")
	}
	elapsed := time.Since(start)
	got := otelLines(jsonLines(t, sy.Output()))
	allowed := 1 + int(elapsed/processLogEvery) + 1 // the first, one per window since, the exit's
	failures := 0
	for _, l := range got {
		if l["msg"] != "OpenTelemetry error" || !strings.HasPrefix(fmt.Sprint(l["err"]), "traces export: ") {
			t.Errorf("opentelemetry line %v, want an export failure", l)
		}
		if n, ok := l["suppressed"].(float64); ok {
			failures += int(n)
		} else {
			failures++
		}
	}
	if len(got) > allowed {
		t.Errorf("%d opentelemetry lines in %v, want at most %d: %v", len(got), elapsed.Round(time.Second), allowed, got)
	}
	if failures < 2 {
		t.Errorf("the lines stand for %d export failures, want 2 or more: nothing was held back, the limit went untested: %v", failures, got)
	}
	t.Logf("%d export failures in %v, logged as %d lines", failures, elapsed.Round(time.Second), len(got))
}
