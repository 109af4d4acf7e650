package main

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/switchyard/switchyard/internal/testutil"
)

// scrapeMetrics fetches and parses switchyard's /metrics.
func scrapeMetrics(t testing.TB, admin string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: HTTP %d", resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	return fams
}

// metricValue returns the value of the series of family name whose labels
// include want, and whether it exists.
func metricValue(fams map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		got := map[string]string{}
		for _, l := range m.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if got[k] != v {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.GetGauge().GetValue(), true
		case m.Counter != nil:
			return m.GetCounter().GetValue(), true
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount()), true
		}
	}
	return 0, false
}

// /metrics reflects the fleet: ready endpoints, scraped queue and KV per
// endpoint, picker and local-reply counters, and the Envoy node's ACKs.
func TestE2EMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and simulators")
	}
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf(`
pool "llama" {
  endpoints = [%q, %q]
}
model "m-a" { pool = "llama" }
`, s1.Addr, s2.Addr), fleetOptions{})

	for i := 0; i < 4; i++ {
		r, err := f.send(infReq{model: "m-a", prompt: "hello metrics", maxTokens: 2})
		if err != nil || r.status != 200 {
			t.Fatalf("request %d: %v %+v", i, err, r)
		}
	}
	if r, err := f.send(infReq{model: "nope", prompt: "x"}); err != nil || r.status != 404 {
		t.Fatalf("unknown model: %v %+v", err, r)
	}

	var fams map[string]*dto.MetricFamily
	testutil.Eventually(t, 5*time.Second, "metrics reflect the fleet", func() error {
		fams = scrapeMetrics(t, f.admin)
		if v, _ := metricValue(fams, "inference_pool_ready_pods", map[string]string{"name": "llama"}); v != 2 {
			return fmt.Errorf("inference_pool_ready_pods = %v, want 2", v)
		}
		for _, s := range []*sim{s1, s2} {
			if _, ok := metricValue(fams, "inference_pool_per_pod_queue_size", map[string]string{"name": "llama", "model_server_pod": s.Addr}); !ok {
				return fmt.Errorf("no scraped queue for %s", s.Addr)
			}
		}
		return nil
	})
	picked := 0.0
	for _, s := range []*sim{s1, s2} {
		v, _ := metricValue(fams, "switchyard_endpoint_picked_total", map[string]string{"pool": "llama", "endpoint": s.Addr})
		picked += v
	}
	if picked < 4 {
		t.Errorf("switchyard_endpoint_picked_total sums to %v, want >= 4", picked)
	}
	if v, ok := metricValue(fams, "switchyard_picker_local_replies_total", map[string]string{"code": "404"}); !ok || v < 1 {
		t.Errorf("local 404 replies = %v (present %v), want >= 1", v, ok)
	}
	if v, _ := metricValue(fams, "switchyard_xds_acks_total", map[string]string{"node": f.nodeID}); v < 1 {
		t.Errorf("no xDS ACKs counted for node %s", f.nodeID)
	}
	if v, ok := metricValue(fams, "switchyard_xds_nacks_total", map[string]string{"node": f.nodeID}); !ok || v != 0 {
		t.Errorf("xDS NACKs for node %s = %v (present %v), want 0", f.nodeID, v, ok)
	}
	if v, _ := metricValue(fams, "inference_objective_request_total", map[string]string{"model_name": "m-a", "target_model_name": "m-a"}); v != 4 {
		t.Errorf("inference_objective_request_total{m-a} = %v, want 4", v)
	}
	if v, ok := metricValue(fams, "inference_objective_running_requests", map[string]string{"model_name": "m-a"}); !ok || v != 0 {
		t.Errorf("inference_objective_running_requests{m-a} = %v (present %v), want 0 after the responses", v, ok)
	}
	if v, _ := metricValue(fams, "inference_extension_scheduler_e2e_duration_seconds", nil); v < 5 {
		t.Errorf("decision histogram counted %v decisions, want >= 5", v)
	}
	if v, ok := metricValue(fams, "switchyard_pool_saturated", map[string]string{"name": "llama"}); !ok || v != 0 {
		t.Errorf("switchyard_pool_saturated{llama} = %v (present %v), want 0 on an idle fleet", v, ok)
	}
	if _, ok := metricValue(fams, "inference_extension_prefix_indexer_size", map[string]string{"name": "llama"}); !ok {
		t.Error("no prefix index size for pool llama")
	}
	if v, _ := metricValue(fams, "switchyard_config_error", nil); v != 0 {
		t.Errorf("switchyard_config_error = %v, want 0", v)
	}
	for _, name := range []string{"switchyard_build_info", "go_goroutines", "process_resident_memory_bytes"} {
		if fams[name] == nil {
			t.Errorf("missing %s; have %s", name, strings.Join(keys(fams), ", "))
		}
	}
}

func keys(m map[string]*dto.MetricFamily) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
