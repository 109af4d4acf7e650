package ir

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/registry"
)

func TestParseAddress(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
		err  bool
	}{
		{in: "10.0.0.1:8000", want: "10.0.0.1:8000"},
		{in: "[2001:db8::1]:80", want: "[2001:db8::1]:80"},
		{in: "[::ffff:10.0.0.1]:80", want: "[::ffff:10.0.0.1]:80"},
		{in: "[fe80::1%eth0]:80", err: true},
		{in: "vllm-1:8000", err: true},
		{in: "10.0.0.1", err: true},
		{in: "10.0.0.1:0", err: true},
		{in: "", err: true},
	} {
		got, err := ParseAddress(tc.in)
		if tc.err {
			if !errors.Is(err, ErrBadAddress) {
				t.Errorf("ParseAddress(%q) err = %v, want ErrBadAddress", tc.in, err)
			}
			continue
		}
		if err != nil || got.String() != tc.want {
			t.Errorf("ParseAddress(%q) = %v, %v; want %s", tc.in, got, err, tc.want)
		}
	}
}

func mkState(def string, pools map[string]registry.FailureMode) *registry.State {
	s := registry.Empty()
	s.Listeners = []registry.Listener{{Name: "l", Address: "127.0.0.1:8080"}}
	s.Routing.DefaultPool = def
	for name, mode := range pools {
		s.Pools[name] = &registry.Pool{Name: name, FailureMode: mode, Endpoints: []registry.Endpoint{{Address: "10.0.0.1:8000"}}}
	}
	return s
}

// routeFor returns the first route of l a request matches, as Envoy walks
// them: model is the body's model Envoy read ("" for none), picked whether
// the picker set its destination, pool the picker's x-switchyard-pool.
func routeFor(l Listener, model string, picked bool, pool string) Route {
	for _, r := range l.Routes {
		if r.PoolHeader != "" && r.PoolHeader != pool {
			continue
		}
		if (r.Picked == PickedYes && !picked) || (r.Picked == PickedNo && picked) {
			continue
		}
		if len(r.Models) > 0 && !slices.Contains(r.Models, model) {
			continue
		}
		return r
	}
	return Route{}
}

// TestUnpickedRequestsStayInTheirPool: a request the picker did not
// process (it was unavailable) is served only by its own model's pool when
// that pool fails open, else answered 503; never by another pool, whatever
// mix of failure modes and default pool, and rewritten models go by the
// client's name.
func TestUnpickedRequestsStayInTheirPool(t *testing.T) {
	for _, tc := range []struct {
		desc  string
		def   string
		pools map[string]registry.FailureMode
	}{
		{desc: "all closed", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailClosed}},
		{desc: "one open", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailOpen}},
		{desc: "two open, one closed", pools: map[string]registry.FailureMode{"a": registry.FailOpen, "b": registry.FailOpen, "c": registry.FailClosed}},
		{desc: "open default", def: "b", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailOpen}},
		{desc: "closed default, one open", def: "a", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailOpen}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			s := mkState(tc.def, tc.pools)
			for name := range tc.pools {
				s.Models["m-"+name] = &registry.Model{Name: "m-" + name, Pool: name}
				// A rewrite whose target is another pool's model name: the
				// client's name decides.
				s.Models["alias-"+name] = &registry.Model{Name: "alias-" + name, Pool: name, Targets: []registry.Target{{Name: "m-other", Weight: 1}}}
			}
			cfg, err := Build(s, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if len(cfg.Warnings) != 0 {
				t.Fatalf("warnings: %q", cfg.Warnings)
			}
			l := cfg.Listeners[0]
			for name, mode := range tc.pools {
				for _, model := range []string{"m-" + name, "alias-" + name} {
					r := routeFor(l, model, false, "")
					switch {
					case mode == registry.FailOpen && r.Cluster != FailOpenClusterName(name):
						t.Errorf("unpicked %s (fail-open pool %s) -> %+v, want cluster %s", model, name, r, FailOpenClusterName(name))
					case mode == registry.FailClosed && (r.Direct == nil || r.Direct.Status != 503 || r.Direct.Body != PickerUnavailableBody):
						t.Errorf("unpicked %s (fail-closed pool %s) -> %+v, want the 503 JSON", model, name, r)
					}
					// Picked requests go to the pool the picker names.
					if r := routeFor(l, model, true, name); r.Cluster != ClusterName(name) {
						t.Errorf("picked %s -> %+v, want cluster %s", model, r, ClusterName(name))
					}
					// A client-sent pool header without the picker's
					// metadata selects nothing.
					if r := routeFor(l, model, false, name); r.Cluster == ClusterName(name) {
						t.Errorf("unpicked %s with a client pool header reached the picked cluster", model)
					}
				}
			}
			// Unknown models and bodies without a model go to a fail-open
			// default pool, like the picker sends them, or get the 503.
			for _, model := range []string{"unknown", ""} {
				r := routeFor(l, model, false, "")
				d, ok := tc.pools[tc.def]
				if ok && d == registry.FailOpen {
					if r.Cluster != FailOpenClusterName(tc.def) {
						t.Errorf("unpicked %q -> %+v, want the fail-open default pool", model, r)
					}
				} else if r.Direct == nil || r.Direct.Status != 503 {
					t.Errorf("unpicked %q -> %+v, want the 503", model, r)
				}
			}
			last := l.Routes[len(l.Routes)-1]
			if last.Direct == nil || last.Direct.Status != 404 {
				t.Fatalf("last route %+v is not the 404 catch-all", last)
			}
			for _, p := range cfg.Pools {
				if p.FailOpen != (p.FailOpenCluster != "") {
					t.Errorf("pool %s: fail-open %v but fail-open cluster %q", p.Name, p.FailOpen, p.FailOpenCluster)
				}
			}
		})
	}
}

func TestBuildErrorsNameTheCulprit(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"llama": registry.FailClosed})
	s.Pools["llama"].Endpoints = append(s.Pools["llama"].Endpoints, registry.Endpoint{Address: "vllm.local:8000"})
	s.Listeners = append(s.Listeners, registry.Listener{Name: "l", Address: "127.0.0.1:8081"}, registry.Listener{Name: "bad", Address: "::8080"})
	_, err := Build(s, Options{PickerAddr: "picker:9002"})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{`pool "llama" endpoint`, "vllm.local:8000", `listener "l"`, `listener "bad"`, "picker address"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if !errors.Is(err, ErrDuplicateName) || !errors.Is(err, ErrBadAddress) {
		t.Errorf("error %v does not wrap the sentinels", err)
	}
}

func TestDuplicateEndpoints(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"p": registry.FailClosed})
	s.Pools["p"].Endpoints = append(s.Pools["p"].Endpoints, registry.Endpoint{Address: "10.0.0.1:8000"})
	_, err := Build(s, Options{})
	if !errors.Is(err, ErrDuplicateName) || !strings.Contains(err.Error(), "10.0.0.1:8000") {
		t.Fatalf("err = %v, want a duplicate endpoint error", err)
	}
}

func TestNonCanonicalAddressWarns(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"p": registry.FailClosed})
	s.Pools["p"].Endpoints = []registry.Endpoint{{Address: "[2001:DB8:0::1]:8000"}}
	cfg, err := Build(s, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Warnings) != 1 || !strings.Contains(cfg.Warnings[0], "[2001:db8::1]:8000") {
		t.Fatalf("warnings = %q", cfg.Warnings)
	}
}

func TestDrainingAndUnhealthyEndpoints(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"p": registry.FailClosed})
	s.Pools["p"].Endpoints = []registry.Endpoint{
		{Address: "10.0.0.1:8000"},
		{Address: "10.0.0.2:8000", Draining: true},
		{Address: "10.0.0.3:8000", ScrapeFailing: true},
	}
	cfg, err := Build(s, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Pools[0].Endpoints; len(got) != 1 || got[0].String() != "10.0.0.1:8000" {
		t.Fatalf("endpoints = %v", got)
	}
	// All non-draining endpoints unhealthy: keep them rather than black-hole.
	s.Pools["p"].Endpoints[0].ScrapeFailing = true
	cfg, err = Build(s, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Pools[0].Endpoints; len(got) != 2 || len(cfg.Warnings) != 1 {
		t.Fatalf("endpoints = %v warnings = %v", got, cfg.Warnings)
	}
}

func TestPerListenerOptions(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"p": registry.FailClosed})
	s.Listeners = []registry.Listener{{Name: "b", Address: "127.0.0.1:1"}, {Name: "a", Address: "127.0.0.1:2"}}
	cfg, err := Build(s, Options{DisableRetries: true, PerListener: map[string]ListenerOptions{"b": {StreamIdleTimeout: 42, AccessLog: true}}})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listeners[0].Name != "listener/a" || cfg.Listeners[1].Name != "listener/b" {
		t.Fatalf("listeners not sorted: %+v", cfg.Listeners)
	}
	if a, b := cfg.Listeners[0], cfg.Listeners[1]; a.StreamIdleTimeout != DefaultStreamIdleTimeout || a.AccessLog || b.StreamIdleTimeout != 42 || !b.AccessLog {
		t.Fatalf("per-listener settings not applied: %+v / %+v", a, b)
	}
	if r := cfg.Listeners[0].Routes[0]; r.Retry != nil {
		t.Fatalf("retries not disabled: %+v", r.Retry)
	}
}

func TestTracingOptions(t *testing.T) {
	for _, c := range []struct {
		o       TracingOptions
		wantErr string
		dns     bool
	}{
		{TracingOptions{Collector: "10.0.0.9:4317", SamplePercent: 5}, "", false},
		{TracingOptions{Collector: "[fd00::9]:4317"}, "", false},
		{TracingOptions{Collector: "otel.internal:4317"}, "", true},
		{TracingOptions{Collector: "otel.internal"}, "host:port", false},
		{TracingOptions{Collector: "10.0.0.9:0"}, "bad port", false},
		{TracingOptions{Collector: "10.0.0.9:4317", SamplePercent: 101}, "0 to 100", false},
	} {
		cfg, err := Build(nil, Options{Tracing: &c.o})
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%+v: error %v, want %q", c.o, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%+v: %v", c.o, err)
		}
		if cfg.Tracing == nil || cfg.Tracing.DNS != c.dns || cfg.Tracing.ServiceName != "envoy" || cfg.Tracing.ClusterName != TracingCluster {
			t.Errorf("%+v: %+v", c.o, cfg.Tracing)
		}
	}
	if cfg, err := Build(nil, Options{}); err != nil || cfg.Tracing != nil {
		t.Errorf("no tracing: %+v %v", cfg.Tracing, err)
	}
}
