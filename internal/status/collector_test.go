package status

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// fixed exports one Report as of now.
type fixed struct {
	r   *Report
	now time.Time
}

func (f fixed) Describe(ch chan<- *prometheus.Desc) { collector{}.Describe(ch) }
func (f fixed) Collect(ch chan<- prometheus.Metric) { collect(f.r, f.now, ch) }

func gather(t *testing.T, r *Report) []*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewPedanticRegistry() // also checks every metric against its Desc
	reg.MustRegister(fixed{r: r, now: t0})
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// value returns the sample of family name whose labels include want.
func value(t *testing.T, mfs []*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	t.Helper()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.Metric {
			got := map[string]string{}
			for _, l := range m.Label {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.Gauge != nil:
				return m.Gauge.GetValue(), true
			case m.Counter != nil:
				return m.Counter.GetValue(), true
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount()), true
			}
		}
	}
	return 0, false
}

// TestCollectorReadsTheReport checks that the metrics say what the Report
// says, computed by the same rules: ready endpoints are the Report's
// healthy, not draining ones; pool averages are over the scraped ones.
func TestCollectorReadsTheReport(t *testing.T) {
	t.Parallel()
	r := build(sample())
	mfs := gather(t, r)
	pool := map[string]string{"name": "llama"}
	checks := []struct {
		desc   string
		name   string
		labels map[string]string
		want   float64
	}{
		{"ready: healthy and not draining (10.0.0.1, 10.0.0.5)", "inference_pool_ready_pods", pool, 2},
		{"ready in an empty pool", "inference_pool_ready_pods", map[string]string{"name": "empty"}, 0},
		{"average queue over the three scraped endpoints", "inference_pool_average_queue_size", pool, 3},
		{"average KV over the three scraped endpoints", "inference_pool_average_kv_cache_utilization", pool, 0.5},
		{"failing scrapes", "switchyard_endpoint_healthy", map[string]string{"endpoint": "10.0.0.2:8000"}, 0},
		{"withheld by the picker", "switchyard_endpoint_healthy", map[string]string{"endpoint": "10.0.0.3:8000"}, 0},
		{"draining is healthy", "switchyard_endpoint_healthy", map[string]string{"endpoint": "10.0.0.4:8000"}, 1},
		{"scrape age", "switchyard_endpoint_metrics_age_seconds", map[string]string{"endpoint": "10.0.0.1:8000"}, 2},
		{"config error", "switchyard_config_error", nil, 1},
		{"saturated", "switchyard_pool_saturated", pool, 1},
		{"guard holds", "switchyard_discovery_guard_held_endpoints", map[string]string{"pool": "llama"}, 1},
		{"node unreachable, still a member", "switchyard_discovery_node_unreachable_endpoints", map[string]string{"pool": "llama"}, 1},
		{"guard activations", "switchyard_discovery_guard_activations_total", map[string]string{"pool": "llama"}, 2},
		{"replicas", "switchyard_replicas", nil, 3},
		{"sharing, under the replica's name", "switchyard_replica_sharing", map[string]string{"peer": "sy-2"}, 1},
		{"dropped, under the replica's name", "switchyard_replica_events_dropped_total", map[string]string{"peer": "sy-2"}, 1},
		{"a static peer's sharing under the ID it announced", "switchyard_replica_sharing", map[string]string{"peer": "sy-3"}, 0},
		{"its lag under the same name", "switchyard_replica_lag_seconds", map[string]string{"peer": "sy-3"}, 0.002},
		{"lag of a replica in no list, by its ID", "switchyard_replica_lag_seconds", map[string]string{"peer": "sy-9"}, 0.003},
		{"TLS rejections", "switchyard_tls_rejected_connections_total", map[string]string{"server": "xds", "reason": "expired"}, 2},
		{"TLS reasons start at 0", "switchyard_tls_rejected_connections_total", map[string]string{"server": "extproc", "reason": "unknown_ca"}, 0},
		{"decisions", "inference_extension_scheduler_e2e_duration_seconds", nil, 100},
		{"prefix index", "inference_extension_prefix_indexer_size", pool, 12},
		{"Consul up", "switchyard_consul_up", map[string]string{"service": "vllm", "passing_only": "true"}, 1},
		{"exact KV view", "switchyard_kv_events_exact", map[string]string{"endpoint": "10.0.0.1:8000"}, 1},
		{"partial KV view: estimated", "switchyard_kv_events_exact", map[string]string{"endpoint": "10.0.0.2:8000"}, 0},
		{"KV blocks on the GPU", "switchyard_kv_events_blocks", map[string]string{"endpoint": "10.0.0.1:8000", "medium": "GPU"}, 120},
		{"KV blocks offloaded", "switchyard_kv_events_blocks", map[string]string{"endpoint": "10.0.0.1:8000", "medium": "CPU"}, 7},
		{"KV restarts", "switchyard_kv_events_engine_restarts_total", map[string]string{"endpoint": "10.0.0.1:8000"}, 1},
		{"KV losses", "switchyard_kv_events_lost_total", map[string]string{"endpoint": "10.0.0.2:8000"}, 1},
		{"predictions checked", "switchyard_kv_events_predictions_total", map[string]string{"endpoint": "10.0.0.1:8000", "result": "agree"}, 95},
		{"bounds met", "switchyard_kv_events_predictions_total", map[string]string{"endpoint": "10.0.0.1:8000", "result": "bound"}, 40},
		{"tokenize calls", "switchyard_kv_tokenize_calls_total", map[string]string{"pool": "llama", "result": "ok"}, 10},
		{"tokenize prefix hits", "switchyard_kv_tokenize_requests_total", map[string]string{"pool": "llama", "result": "prefix"}, 120},
		{"tokenize misses", "switchyard_kv_tokenize_requests_total", map[string]string{"pool": "llama", "result": "miss"}, 14},
		{"prefixes checked", "switchyard_kv_tokenize_verified_total", map[string]string{"pool": "llama", "result": "mismatch"}, 1},
		{"tokenize hits", "switchyard_kv_tokenize_requests_total", map[string]string{"pool": "llama", "result": "hit"}, 30},
	}
	for _, c := range checks {
		got, ok := value(t, mfs, c.name, c.labels)
		if !ok || got != c.want {
			t.Errorf("%s: %s%v = %v (found %v), want %v", c.desc, c.name, c.labels, got, ok, c.want)
		}
	}
	for _, absent := range []struct {
		name   string
		labels map[string]string
	}{
		{"inference_pool_per_pod_queue_size", map[string]string{"model_server_pod": "10.0.0.5:8000"}}, // never scraped
		{"inference_pool_average_queue_size", map[string]string{"name": "empty"}},                     // nothing scraped
		{"switchyard_endpoint_healthy", map[string]string{"pool": "gone"}},                            // not in the state
		{"switchyard_consul_last_success_timestamp_seconds", map[string]string{"service": "switchyard"}},
		{"switchyard_replica_sharing", map[string]string{"peer": "10.0.1.3:9002"}}, // named, not by address
		{"switchyard_replica_sharing", map[string]string{"peer": "10.0.1.2:9002"}},
		{"switchyard_kv_events_exact", map[string]string{"endpoint": "10.0.0.3:8000"}}, // no events declared
	} {
		if v, ok := value(t, mfs, absent.name, absent.labels); ok {
			t.Errorf("%s%v = %v, want no sample", absent.name, absent.labels, v)
		}
	}

	// One switchyard, no TLS, no observations: one replica, no TLS series,
	// no histogram.
	in := sample()
	in.state.Replicas, in.tls, in.observed = nil, nil, nil
	mfs = gather(t, build(in))
	if v, _ := value(t, mfs, "switchyard_replicas", nil); v != 1 {
		t.Errorf("switchyard_replicas = %v for one switchyard, want 1", v)
	}
	for _, name := range []string{"switchyard_tls_certificate_reloads_total", "inference_extension_scheduler_e2e_duration_seconds"} {
		if _, ok := value(t, mfs, name, nil); ok {
			t.Errorf("%s exported without its source", name)
		}
	}
}

// TestMetricsText pins every metric name, label and value the sample
// exports. Regenerate with -update only for a deliberate change: the
// Grafana dashboard and users' alerts query these names.
func TestMetricsText(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range gather(t, build(sample())) {
		if err := enc.Encode(mf); err != nil {
			t.Fatal(err)
		}
	}
	golden(t, filepath.Join("testdata", "metrics.txt"), buf.Bytes())
}
