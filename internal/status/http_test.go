package status

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store/storetest"
	"github.com/switchyard/switchyard/xds"
)

// liveSources are real components on one publisher, none of them running:
// what Read gathers from them, not their behaviour, is under test.
func liveSources(t *testing.T) (*Sources, *registry.Publisher, *atomic.Bool) {
	t.Helper()
	pub := registry.NewPublisher(nil)
	draining := &atomic.Bool{}
	return &Sources{
		Version: "v0.0.1", ReplicaID: "sy-1", PickerAddr: "127.0.0.1:9002",
		View:     pub,
		Registry: registry.NewManager(pub),
		Picker:   picker.New(pub, picker.Options{DisableMetrics: true}, nil),
		XDS:      xds.NewServer(pub, xds.Options{}, nil),
		Store:    storetest.New(), StorePath: "/tmp/switchyard.db",
		Draining: draining.Load,
	}, pub, draining
}

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	b, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(b)
}

func TestReadiness(t *testing.T) {
	t.Parallel()
	src, pub, draining := liveSources(t)
	mux := http.NewServeMux()
	src.Register(mux)
	if code, body := get(t, mux, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "no configuration") {
		t.Errorf("/readyz before the first state: %d %q", code, body)
	}
	pub.Publish(state(1))
	if code, body := get(t, mux, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz with a state: %d %q", code, body)
	}
	// The readiness gate has the last word, and /api/status says the same.
	gate := &atomic.Bool{}
	src.Ready = func() (bool, string) { return gate.Load(), "serving other versions than ready replicas" }
	if code, body := get(t, mux, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "other versions") {
		t.Errorf("/readyz with the gate closed: %d %q", code, body)
	}
	if r := src.Read(time.Now()); r.Ready || !strings.Contains(r.NotReady, "other versions") {
		t.Errorf("report with the gate closed: ready %v %q", r.Ready, r.NotReady)
	}
	gate.Store(true)
	if code, body := get(t, mux, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz with the gate open: %d %q", code, body)
	}
	if r := src.Read(time.Now()); !r.Ready || r.NotReady != "" {
		t.Errorf("report with the gate open: ready %v %q", r.Ready, r.NotReady)
	}
	draining.Store(true)
	if code, body := get(t, mux, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "draining") {
		t.Errorf("/readyz while draining: %d %q", code, body)
	}
	if code, _ := get(t, mux, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz while draining: %d, want 200 (alive)", code)
	}
}

func state(version uint64) *registry.State {
	st := registry.Empty()
	st.Version = version
	st.Pools["p"] = &registry.Pool{Name: "p", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed,
		Endpoints: []registry.Endpoint{{Address: "127.0.0.1:18001"}, {Address: "127.0.0.1:18002", Draining: true}}}
	st.Models["m"] = &registry.Model{Name: "m", Pool: "p"}
	return st
}

// TestViewsReadOneReport reads real components through each view: the
// JSON and the metrics describe the same pool and endpoints, and the page
// renders the JSON API.
func TestViewsReadOneReport(t *testing.T) {
	t.Parallel()
	pub := registry.NewPublisher(state(3))
	src := &Sources{
		Version: "v0.0.1", ReplicaID: "sy-1", PickerAddr: "127.0.0.1:9002",
		View: pub, Registry: registry.NewManager(pub),
		Picker: picker.New(pub, picker.Options{DisableMetrics: true}, nil),
		XDS:    xds.NewServer(pub, xds.Options{}, nil),
		Store:  storetest.New(), StorePath: "/tmp/switchyard.db",
	}
	mux := http.NewServeMux()
	src.Register(mux)

	code, body := get(t, mux, "/api/status")
	if code != http.StatusOK {
		t.Fatalf("/api/status: %d %s", code, body)
	}
	var doc struct {
		Version         string `json:"version"`
		RegistryVersion uint64 `json:"registry_version"`
		ReplicaID       string `json:"replica_id"`
		Pools           []struct {
			Name      string `json:"name"`
			Endpoints []struct {
				Address  string `json:"address"`
				Draining bool   `json:"draining"`
				Healthy  bool   `json:"healthy"`
			} `json:"endpoints"`
		} `json:"pools"`
		Models []struct{ Name string } `json:"models"`
		Store  *struct {
			Path string `json:"path"`
		} `json:"store"`
		Replicas []any `json:"replicas"`
		Envoys   []any `json:"envoys"`
	}
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("/api/status: %v\n%s", err, body)
	}
	if doc.Version != "v0.0.1" || doc.RegistryVersion != 3 || doc.ReplicaID != "sy-1" || len(doc.Models) != 1 ||
		doc.Store == nil || doc.Store.Path != "/tmp/switchyard.db" || doc.Replicas == nil || doc.Envoys == nil {
		t.Errorf("/api/status:\n%s", body)
	}
	if len(doc.Pools) != 1 || len(doc.Pools[0].Endpoints) != 2 || !doc.Pools[0].Endpoints[1].Draining || !doc.Pools[0].Endpoints[0].Healthy {
		t.Fatalf("/api/status pools: %+v", doc.Pools)
	}

	code, metrics := get(t, mux, "/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`switchyard_build_info{version="v0.0.1"} 1`,
		`switchyard_registry_version 3`,
		// Two endpoints, one draining: one ready, as the JSON says.
		`inference_pool_ready_pods{name="p"} 1`,
		`switchyard_endpoint_healthy{endpoint="127.0.0.1:18002",pool="p"} 1`,
		`inference_extension_scheduler_e2e_duration_seconds_count 0`,
		`inference_extension_prefix_indexer_size{name="p"} 0`,
		"go_goroutines ", "process_cpu_seconds_total ",
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	code, page := get(t, mux, "/")
	if code != http.StatusOK || !strings.Contains(page, `fetch("api/status"`) {
		t.Errorf("status page: %d, does not fetch api/status", code)
	}
	if code, _ := get(t, mux, "/nothing"); code != http.StatusNotFound {
		t.Errorf("/nothing: %d, want 404", code)
	}
}

// TestReadLeavesOutObservations: Read, which /api/status calls on every
// poll, never takes the picker's prefix-index locks.
func TestReadLeavesOutObservations(t *testing.T) {
	t.Parallel()
	src, pub, _ := liveSources(t)
	pub.Publish(state(1))
	src.Picker = picker.New(pub, picker.Options{DisableMetrics: true}, nil)
	r := src.Read(time.Now())
	if r.Decision != nil || r.Objectives != nil || len(r.Pools) != 1 || r.Pools[0].Prefix != nil {
		t.Errorf("Read returned observations: %+v", r)
	}
	full := build(src.gather(time.Now(), true))
	if full.Decision == nil || full.Pools[0].Prefix == nil {
		t.Errorf("the collector's read lacks observations")
	}
}

// With the picker scraping for real: an endpoint refusing every
// connection alone in its pool stays routed (no endpoint of its pool
// answers) and /api/status says why; one failing beside an endpoint that
// answers is withheld, and says only why it is unhealthy.
func TestStatusSaysWhyAFailingEndpointIsRouted(t *testing.T) {
	t.Parallel()
	answering := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"+
			"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"+
			"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n")
	}))
	defer answering.Close()
	// Nothing listens on these: every connection is refused.
	solo, beside := testutil.FreeAddr(t), testutil.FreeAddr(t)

	st := registry.Empty()
	st.Version = 1
	st.Pools["solo"] = &registry.Pool{Name: "solo", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed,
		Endpoints: []registry.Endpoint{{Address: solo}}}
	st.Pools["pair"] = &registry.Pool{Name: "pair", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed,
		Endpoints: []registry.Endpoint{{Address: strings.TrimPrefix(answering.URL, "http://")}, {Address: beside}}}
	pub := registry.NewPublisher(st)
	p := picker.New(pub, picker.Options{Metrics: metrics.Options{Interval: 20 * time.Millisecond, MaxBackoff: 40 * time.Millisecond}}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	src := &Sources{Version: "v0.0.1", View: pub, Registry: registry.NewManager(pub), Picker: p, XDS: xds.NewServer(pub, xds.Options{}, nil)}
	mux := http.NewServeMux()
	src.Register(mux)

	type endpoint struct {
		Address         string `json:"address"`
		Healthy         bool   `json:"healthy"`
		UnhealthyReason string `json:"unhealthy_reason"`
		RoutedReason    string `json:"routed_reason"`
	}
	var eps map[string]endpoint
	testutil.Eventually(t, 10*time.Second, "both refusing endpoints reported unhealthy, the one beside an answering endpoint withheld", func() error {
		_, body := get(t, mux, "/api/status")
		var doc struct {
			Pools []struct {
				Endpoints []endpoint `json:"endpoints"`
			} `json:"pools"`
		}
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			return err
		}
		eps = map[string]endpoint{}
		for _, p := range doc.Pools {
			for _, e := range p.Endpoints {
				eps[e.Address] = e
			}
		}
		if eps[solo].Healthy || eps[beside].Healthy || eps[beside].RoutedReason != "" {
			return fmt.Errorf("%+v", eps)
		}
		return nil
	})
	if e := eps[solo]; !strings.Contains(e.UnhealthyReason, "none succeeded yet") || !strings.Contains(e.UnhealthyReason, "connection refused") ||
		!strings.HasPrefix(e.RoutedReason, "still routed: no other endpoint of its pool answers") {
		t.Errorf("alone in its pool: %+v, want its scrapes' error and why it is still routed", e)
	}
	if e := eps[beside]; !strings.Contains(e.UnhealthyReason, "connection refused") {
		t.Errorf("beside an answering endpoint: %+v, want its scrapes' error", e)
	}
	if e := eps[strings.TrimPrefix(answering.URL, "http://")]; !e.Healthy || e.UnhealthyReason != "" || e.RoutedReason != "" {
		t.Errorf("answering endpoint: %+v", e)
	}
	// The picker itself agrees: it withholds the one beside, not the one alone.
	if got := p.EndpointHealth().UnhealthyEndpoints(); len(got) != 1 || got[0].Address != beside {
		t.Errorf("picker withholds %v, want only %s", got, beside)
	}
}
