package translator

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

var update = flag.Bool("update", false, "rewrite testdata/out golden files")

func vllmPool(name string, mode registry.FailureMode, addrs ...string) *registry.Pool {
	p := &registry.Pool{Name: name, Engine: registry.EngineVLLM, FailureMode: mode, MetricsPath: "/metrics"}
	for _, a := range addrs {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a, Source: "file"})
	}
	return p
}

func state(listeners []registry.Listener, pools ...*registry.Pool) *registry.State {
	s := registry.Empty()
	s.Listeners = listeners
	for _, p := range pools {
		s.Pools[p.Name] = p
	}
	return s
}

var oneListener = []registry.Listener{{Name: "public", Address: "0.0.0.0:8080"}}

// replicas sets s's replicas to addrs (in the order given).
func replicas(s *registry.State, addrs ...string) *registry.State {
	for _, a := range addrs {
		s.Replicas = append(s.Replicas, registry.Replica{ID: a, Address: a})
	}
	return s
}

// goldenCases maps a case name to its input. Outputs live in
// testdata/out/<case>.<type>.json.
func goldenCases() map[string]struct {
	state *registry.State
	opts  ir.Options
} {
	type tc = struct {
		state *registry.State
		opts  ir.Options
	}
	// scrapeFailing marks the given endpoints of every pool of s.
	scrapeFailing := func(s *registry.State, addrs ...string) *registry.State {
		for _, p := range s.Pools {
			for i, e := range p.Endpoints {
				if slices.Contains(addrs, e.Address) {
					p.Endpoints[i].ScrapeFailing = true
				}
			}
		}
		return s
	}
	draining := vllmPool("llama", registry.FailClosed, "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
	draining.Endpoints[1].Draining = true
	failOpenDefault := state(oneListener,
		vllmPool("llama", registry.FailOpen, "10.0.0.1:8000"),
		vllmPool("qwen", registry.FailClosed, "10.0.1.1:8000"))
	failOpenDefault.Routing.DefaultPool = "llama"
	// A disaggregated fail-open pool: its prefill server is in neither
	// cluster; a pool without a disaggregation block keeps an endpoint
	// marked prefill (roles matter only with the block).
	disagg := vllmPool("big", registry.FailOpen, "10.0.2.1:8000", "10.0.2.2:8000", "10.0.2.3:8000")
	disagg.Disaggregation = &registry.Disaggregation{}
	disagg.Endpoints[0].Role = registry.RolePrefill
	disagg.Endpoints[1].Role = registry.RoleDecode
	plain := vllmPool("small", registry.FailClosed, "10.0.3.1:8000")
	plain.Endpoints[0].Role = registry.RolePrefill
	return map[string]tc{
		"disaggregated": {state: state(oneListener, disagg, plain)},
		"single-pool":   {state: state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000", "10.0.0.2:8000"))},
		"multi-pool": {
			state: state([]registry.Listener{{Name: "public", Address: "0.0.0.0:8080"}, {Name: "internal", Address: "127.0.0.1:8081"}},
				vllmPool("llama", registry.FailClosed, "10.0.0.1:8000", "10.0.0.2:8000"),
				vllmPool("qwen", registry.FailClosed, "10.0.1.1:8000")),
			opts: ir.Options{PickerAddr: "10.1.0.5:9002", PerListener: map[string]ir.ListenerOptions{"internal": {AccessLog: true, RouteTimeout: 600_000_000_000}}},
		},
		"fail-open-pool": {state: failOpenDefault},
		"ipv6-endpoint":  {state: state([]registry.Listener{{Name: "public", Address: "[::]:8080"}}, vllmPool("llama", registry.FailClosed, "[2001:db8::1]:8000", "10.0.0.1:8000"))},
		"draining":       {state: state(oneListener, draining)},
		"empty-pool":     {state: state(oneListener, vllmPool("llama", registry.FailClosed))},
		"unhealthy":      {state: scrapeFailing(state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000", "10.0.0.2:8000")), "10.0.0.2:8000")},
		"tracing": {state: state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), opts: ir.Options{
			Tracing: &ir.TracingOptions{Collector: "10.0.0.9:4317", SamplePercent: 10}}},
		"tracing-dns": {state: state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), opts: ir.Options{
			Tracing: &ir.TracingOptions{Collector: "otel-collector.internal:4317", ServiceName: "edge", SamplePercent: 100}}},
		"no-retries":    {state: state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), opts: ir.Options{DisableRetries: true}},
		"empty-state":   {state: registry.Empty()},
		"all-unhealthy": {state: scrapeFailing(state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), "10.0.0.1:8000")},
		"two-fail-open": {state: state(oneListener, vllmPool("a", registry.FailOpen, "10.0.0.1:8000"), vllmPool("b", registry.FailOpen, "10.0.0.2:8000"))},
		"replicas":      {state: replicas(state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), "10.1.0.7:9002", "10.1.0.5:9002", "10.1.0.6:9002"), opts: ir.Options{PickerAddr: "10.1.0.5:9002"}},
		"picker-mtls": {state: state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000")), opts: ir.Options{
			PickerAddr: "10.1.0.5:9002",
			PickerTLS: &ir.PickerTLS{CertificateSDS: "/etc/envoy/switchyard-tls/cert-sds.yaml", CertificateSecret: "switchyard-client",
				ValidationSDS: "/etc/envoy/switchyard-tls/ca-sds.yaml", ValidationSecret: "switchyard-ca",
				WatchDir: "/etc/envoy/switchyard-tls", SNI: "switchyard"},
		}},
	}
}

var typeSuffix = map[resource.Type]string{
	resource.ListenerType: "listeners",
	resource.RouteType:    "routes",
	resource.ClusterType:  "clusters",
	resource.EndpointType: "endpoints",
}

// render turns resources into stable, indented JSON (protojson output is
// deliberately unstable, so it is re-encoded through encoding/json).
func render(t *testing.T, list []types.Resource) []byte {
	t.Helper()
	var out []any
	for _, r := range list {
		b, err := protojson.Marshal(r)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		var v any
		if err := json.Unmarshal(b, &v); err != nil {
			t.Fatalf("unmarshal: %v", err)
		}
		out = append(out, v)
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return append(b, '\n')
}

func TestGolden(t *testing.T) {
	want := map[string]bool{}
	for name, c := range goldenCases() {
		for _, suffix := range typeSuffix {
			want[name+"."+suffix+".json"] = true
		}
		t.Run(name, func(t *testing.T) {
			// One model per pool, so the routes for requests the picker
			// did not process show up.
			for pool := range c.state.Pools {
				c.state.Models["m-"+pool] = &registry.Model{Name: "m-" + pool, Pool: pool}
			}
			cfg, err := ir.Build(c.state, c.opts)
			if err != nil {
				t.Fatalf("build: %v", err)
			}
			res, err := Translate(cfg)
			if err != nil {
				t.Fatalf("translate: %v", err)
			}
			for typ, suffix := range typeSuffix {
				got := render(t, res[typ])
				path := filepath.Join("testdata", "out", name+"."+suffix+".json")
				if *update {
					if err := os.WriteFile(path, got, 0o644); err != nil {
						t.Fatal(err)
					}
					continue
				}
				exp, err := os.ReadFile(path)
				if err != nil {
					t.Fatalf("read golden (run with -update): %v", err)
				}
				if !bytes.Equal(got, exp) {
					t.Errorf("%s differs from golden; rerun with -update and review the diff\n--- got ---\n%s", path, got)
				}
			}
		})
	}
	// Prune outputs of cases that no longer exist.
	files, _ := filepath.Glob(filepath.Join("testdata", "out", "*.json"))
	for _, f := range files {
		if want[filepath.Base(f)] {
			continue
		}
		if *update {
			_ = os.Remove(f)
		} else {
			t.Errorf("orphaned golden file %s (run with -update to prune)", f)
		}
	}
}

func TestTranslateIsDeterministic(t *testing.T) {
	c := goldenCases()["multi-pool"]
	var first [][]byte
	for i := 0; i < 5; i++ {
		cfg, err := ir.Build(c.state, c.opts)
		if err != nil {
			t.Fatal(err)
		}
		res, err := Translate(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var cur [][]byte
		for _, typ := range []resource.Type{resource.ListenerType, resource.RouteType, resource.ClusterType, resource.EndpointType} {
			cur = append(cur, render(t, res[typ]))
		}
		if first == nil {
			first = cur
			continue
		}
		for j := range cur {
			if !bytes.Equal(cur[j], first[j]) {
				t.Fatalf("run %d differs from run 0", i)
			}
		}
	}
}

func TestResourcesSortedByName(t *testing.T) {
	c := goldenCases()["multi-pool"]
	cfg, err := ir.Build(c.state, c.opts)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Translate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	wantClusters := []string{"pool/llama", "pool/qwen", "switchyard/picker"}
	var got []string
	for _, r := range res[resource.ClusterType] {
		got = append(got, resourceName(r))
	}
	if strings.Join(got, ",") != strings.Join(wantClusters, ",") {
		t.Fatalf("clusters = %v, want %v", got, wantClusters)
	}
	for typ, list := range res {
		if !sort.SliceIsSorted(list, func(i, j int) bool { return resourceName(list[i]) < resourceName(list[j]) }) {
			t.Errorf("%s not sorted", typ)
		}
	}
}

func TestTranslateRejectsInvalidResource(t *testing.T) {
	// A listener port above 65535 passes the IR (uint32) but fails the
	// generated proto validation, which must surface as an error.
	cfg := &ir.Config{
		Picker: ir.Picker{ClusterName: ir.PickerCluster, Addresses: []ir.Address{{IP: "127.0.0.1", Port: 9002}}, ConnectTimeout: 1, HealthInterval: 1, HealthTimeout: 1, MessageTimeout: 1},
		Listeners: []ir.Listener{{
			Name: "listener/x", RouteConfigName: "listener/x/routes", StatPrefix: "x",
			Address: ir.Address{IP: "127.0.0.1", Port: 70000},
		}},
	}
	if _, err := Translate(cfg); err == nil || !strings.Contains(err.Error(), "listener/x") {
		t.Fatalf("err = %v, want a validation error naming listener/x", err)
	}
}

// TestListenerStableAcrossPoolEdits checks that adding, removing and
// re-moding pools never changes a Listener resource: Envoy would otherwise
// drain every open connection onto a new filter chain (up to its drain
// time), and connections opened before the edit would keep the old one.
func TestListenerStableAcrossPoolEdits(t *testing.T) {
	steps := []struct {
		desc  string
		state *registry.State
	}{
		{"no pools", state(oneListener)},
		{"one fail-closed pool", state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000"))},
		{"first fail-open pool added", state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.1:8000"), vllmPool("qwen", registry.FailOpen, "10.0.1.1:8000"))},
		{"fail-closed pool turned fail-open", state(oneListener, vllmPool("llama", registry.FailOpen, "10.0.0.1:8000"), vllmPool("qwen", registry.FailOpen, "10.0.1.1:8000"))},
		{"fail-open pool removed", state(oneListener, vllmPool("llama", registry.FailOpen, "10.0.0.1:8000"))},
		{"back to fail-closed", state(oneListener, vllmPool("llama", registry.FailClosed, "10.0.0.2:8000"))},
	}
	var first []byte
	unpicked := map[string]bool{}
	for _, st := range steps {
		for name := range st.state.Pools {
			st.state.Models["m-"+name] = &registry.Model{Name: "m-" + name, Pool: name}
		}
		cfg, err := ir.Build(st.state, ir.Options{})
		if err != nil {
			t.Fatalf("%s: %v", st.desc, err)
		}
		res, err := Translate(cfg)
		if err != nil {
			t.Fatalf("%s: %v", st.desc, err)
		}
		got := render(t, res[resource.ListenerType])
		if first == nil {
			first = got
		} else if !bytes.Equal(got, first) {
			t.Fatalf("%s: the Listener changed:\n--- first ---\n%s\n--- now ---\n%s", st.desc, first, got)
		}
		// The routes, not the listener, carry the difference.
		for _, r := range cfg.Listeners[0].Routes {
			if r.Picked == ir.PickedNo {
				unpicked[r.Name] = true
			}
		}
	}
	if !unpicked[ir.PickerUnavailableRoute] || !unpicked["unpicked/qwen"] || !unpicked["unpicked/llama"] {
		t.Fatalf("routes for unprocessed requests across the steps = %v, want the 503 route and a route per pool", unpicked)
	}
	if !strings.Contains(string(first), `"failureModeAllow": true`) {
		t.Fatalf("listener does not let unprocessed requests reach the routes:\n%s", first)
	}
}
