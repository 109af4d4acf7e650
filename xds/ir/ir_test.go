package ir

import (
	"errors"
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

func TestFailOpenPoolChoice(t *testing.T) {
	for _, tc := range []struct {
		desc     string
		def      string
		pools    map[string]registry.FailureMode
		want     string
		warnings int
	}{
		{desc: "all closed", pools: map[string]registry.FailureMode{"a": registry.FailClosed}, want: ""},
		{desc: "single open", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailOpen}, want: "b"},
		{desc: "open default wins", def: "b", pools: map[string]registry.FailureMode{"a": registry.FailOpen, "b": registry.FailOpen}, want: "b"},
		{desc: "closed default, one open", def: "a", pools: map[string]registry.FailureMode{"a": registry.FailClosed, "b": registry.FailOpen}, want: "b"},
		{desc: "two open, no default", pools: map[string]registry.FailureMode{"a": registry.FailOpen, "b": registry.FailOpen}, want: "", warnings: 1},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			cfg, err := Build(mkState(tc.def, tc.pools), Options{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.FailOpenPool != tc.want || len(cfg.Warnings) != tc.warnings {
				t.Fatalf("fail-open pool %q warnings %q; want %q and %d warnings", cfg.FailOpenPool, cfg.Warnings, tc.want, tc.warnings)
			}
			l := cfg.Listeners[0]
			// Requests the picker did not process (no metadata) go to the
			// fail-open pool, or get the 503 route when there is none.
			var unpicked *Route
			for i, r := range l.Routes {
				if r.Picked == PickedNo {
					unpicked = &l.Routes[i]
					break
				}
			}
			switch {
			case unpicked == nil:
				t.Fatal("no route for requests the picker did not process")
			case tc.want != "" && unpicked.Cluster != ClusterName(tc.want):
				t.Fatalf("unprocessed requests go to %+v, want pool %q", unpicked, tc.want)
			case tc.want == "" && (unpicked.Direct == nil || unpicked.Direct.Status != 503 || unpicked.Name != PickerUnavailableRoute):
				t.Fatalf("unprocessed requests get %+v, want the 503 %s route", unpicked, PickerUnavailableRoute)
			}
			last := l.Routes[len(l.Routes)-1]
			if last.Direct == nil || last.Direct.Status != 404 {
				t.Fatalf("last route %+v is not the 404 catch-all", last)
			}
			for _, r := range l.Routes {
				if r.PoolHeader != "" && r.Picked != PickedYes {
					t.Fatalf("pool route %q does not require picker metadata", r.Name)
				}
			}
		})
	}
}

func TestBuildErrorsNameTheCulprit(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"llama": registry.FailClosed})
	s.Pools["llama"].Endpoints = append(s.Pools["llama"].Endpoints, registry.Endpoint{Address: "vllm.local:8000"})
	s.Listeners = append(s.Listeners, registry.Listener{Name: "l", Address: "127.0.0.1:8081"}, registry.Listener{Name: "bad", Address: "::8080"})
	_, err := Build(s, Options{PickerAddr: "picker:9002"}, nil)
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
	_, err := Build(s, Options{}, nil)
	if !errors.Is(err, ErrDuplicateName) || !strings.Contains(err.Error(), "10.0.0.1:8000") {
		t.Fatalf("err = %v, want a duplicate endpoint error", err)
	}
}

func TestNonCanonicalAddressWarns(t *testing.T) {
	s := mkState("", map[string]registry.FailureMode{"p": registry.FailClosed})
	s.Pools["p"].Endpoints = []registry.Endpoint{{Address: "[2001:DB8:0::1]:8000"}}
	cfg, err := Build(s, Options{}, nil)
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
		{Address: "10.0.0.3:8000"},
	}
	sick := func(_, addr string) bool { return addr == "10.0.0.3:8000" }
	cfg, err := Build(s, Options{}, sick)
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Pools[0].Endpoints; len(got) != 1 || got[0].String() != "10.0.0.1:8000" {
		t.Fatalf("endpoints = %v", got)
	}
	// All non-draining endpoints unhealthy: keep them rather than black-hole.
	cfg, err = Build(s, Options{}, func(string, string) bool { return true })
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
	cfg, err := Build(s, Options{DisableRetries: true, PerListener: map[string]ListenerOptions{"b": {StreamIdleTimeout: 42, AccessLog: true}}}, nil)
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
