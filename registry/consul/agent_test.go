package consul

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// modelServer is an httptest server standing in for a vLLM host's /health.
type modelServer struct {
	*httptest.Server
	healthy atomic.Bool
}

func newModelServer(t *testing.T) *modelServer {
	m := &modelServer{}
	m.healthy.Store(true)
	m.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" && !m.healthy.Load() {
			http.Error(w, "engine dead", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(m.Close)
	return m
}

func (m *modelServer) port(t *testing.T) int {
	_, p, _ := net.SplitHostPort(m.Listener.Addr().String())
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (m *modelServer) addr() string { return m.Listener.Addr().String() }

// register registers m as an instance of service "vllm", the way
// examples/consul/vllm-llama.json does.
func register(t *testing.T, c *api.Client, id string, m *modelServer) {
	t.Helper()
	err := c.Agent().ServiceRegister(&api.AgentServiceRegistration{
		ID: id, Name: "vllm", Tags: []string{"llama-8b"}, Address: "127.0.0.1", Port: m.port(t),
		Meta: map[string]string{MetaModels: "llama-3-8b,sql-lora", MetaEngine: "vllm", MetaMetricsPath: "/metrics"},
		Check: &api.AgentServiceCheck{
			HTTP: m.URL + "/health", Interval: "1s", Timeout: "500ms",
			// Start passing so the test measures discovery, not the first
			// check run; a real host may start critical until healthy.
			Status: api.HealthPassing, DeregisterCriticalServiceAfter: "1m",
		},
	})
	if err != nil {
		t.Fatalf("register %s: %v", id, err)
	}
}

// staticSource declares pools once, like an HCL file would.
type staticSource struct{ u registry.Update }

func (s staticSource) Run(ctx context.Context, up chan<- registry.Update) {
	select {
	case up <- s.u:
	case <-ctx.Done():
	}
	<-ctx.Done()
}

func endpointsOf(v registry.View, pool string) []registry.Endpoint {
	s, _ := v.Current()
	if p, ok := s.Pools[pool]; ok {
		return p.Endpoints
	}
	return nil
}

// waitEndpoints polls until pool has exactly want (addresses, in order) and
// returns how long it took.
func waitEndpoints(t *testing.T, v registry.View, pool string, want ...string) time.Duration {
	t.Helper()
	start := time.Now()
	testutil.Eventually(t, 10*time.Second, fmt.Sprintf("pool %s endpoints %v", pool, want), func() error {
		var got []string
		for _, ep := range endpointsOf(v, pool) {
			got = append(got, ep.Address)
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("endpoints %v", got)
		}
		return nil
	})
	return time.Since(start)
}

// TestAgent drives a real registry.Manager with this source against a real
// Consul agent. The steps share one agent and run in order.
func TestAgent(t *testing.T) {
	a := testutil.StartConsul(t)
	c := a.Client()

	passing := registry.ConsulSelector{Service: "vllm", Tag: "llama-8b", PassingOnly: true}
	all := registry.ConsulSelector{Service: "vllm"}
	// The discovery guard is off in these pools (grace 0), except in
	// "guarded", so a failing instance leaves at once.
	pool := func(name string, sel registry.ConsulSelector) *registry.Pool {
		return &registry.Pool{Name: name, Engine: registry.EngineVLLM, FailureMode: registry.FailClosed, MetricsPath: "/metrics", Consul: &sel,
			Guard: &registry.Guard{}}
	}
	guarded := pool("guarded", all)
	guarded.Guard = nil
	pub := registry.NewPublisher(nil)
	log := slog.New(slog.NewTextHandler(t.Output(), nil))
	m := registry.NewManager(pub, registry.WithLogger(log)) // default debounce, as in serve
	file := registry.Update{Pools: map[string]*registry.Pool{
		"llama": pool("llama", passing), "llama-all": pool("llama-all", all), "guarded": guarded,
	}}
	if err := m.AddSource("file", staticSource{file}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := registry.Merge([]registry.Update{file})
	if err != nil {
		t.Fatal(err)
	}
	src, err := New(Options{Wants: WantsFrom(cfg), Address: "http://" + a.Addr, WaitTime: 10 * time.Second, Logger: log,
		MinBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.AddSource(SourceName, src); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})

	var v registry.View = pub
	h1 := newModelServer(t)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if _, err := registry.WaitFor(wctx, v, func(s *registry.State) bool { return s.Pools["llama"] != nil }); err != nil {
		t.Fatalf("first state not published: %v", err)
	}

	t.Run("registration appears", func(t *testing.T) {
		register(t, c, "vllm-1", h1)
		d := waitEndpoints(t, v, "llama", h1.addr())
		t.Logf("registered instance in the published state after %v", d)
		waitEndpoints(t, v, "llama-all", h1.addr())
		ep := endpointsOf(v, "llama")[0]
		if ep.Source != SourceName || !slices.Equal(ep.Models, []string{"llama-3-8b", "sql-lora"}) || ep.MetricsPath != "/metrics" || ep.Draining {
			t.Errorf("endpoint = %+v", ep)
		}
	})

	t.Run("failing health check removes it", func(t *testing.T) {
		h1.healthy.Store(false)
		d := waitEndpoints(t, v, "llama")
		t.Logf("failing instance left the published state after %v (check interval 1s)", d)
		waitEndpoints(t, v, "llama-all") // critical: out of both pools
		// With the guard (the default), the pool's only endpoint failing
		// is held for the grace period instead.
		if eps := endpointsOf(v, "guarded"); len(eps) != 1 || !eps[0].Held {
			t.Errorf("guarded pool: %+v, want the failing instance held", eps)
		}
		h1.healthy.Store(true)
		waitEndpoints(t, v, "llama", h1.addr())
		if eps := endpointsOf(v, "guarded"); len(eps) != 1 || eps[0].Held {
			t.Errorf("guarded pool after recovery: %+v, want it no longer held", eps)
		}
	})

	t.Run("maintenance drains", func(t *testing.T) {
		if err := c.Agent().EnableServiceMaintenance("vllm-1", "upgrade"); err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, 10*time.Second, "instance in maintenance draining", func() error {
			for _, pool := range []string{"llama", "llama-all"} {
				if eps := endpointsOf(v, pool); len(eps) != 1 || !eps[0].Draining {
					return fmt.Errorf("pool %s: %+v, want the instance Draining", pool, eps)
				}
			}
			return nil
		})
		if err := c.Agent().DisableServiceMaintenance("vllm-1"); err != nil {
			t.Fatal(err)
		}
		waitEndpoints(t, v, "llama", h1.addr())
	})

	t.Run("deregistration removes it", func(t *testing.T) {
		if err := c.Agent().ServiceDeregister("vllm-1"); err != nil {
			t.Fatal(err)
		}
		d := waitEndpoints(t, v, "llama")
		t.Logf("deregistered instance left the published state after %v", d)
		waitEndpoints(t, v, "llama-all")
		waitEndpoints(t, v, "guarded") // deliberate: never held
	})

	t.Run("consul down keeps members; restart resumes", func(t *testing.T) {
		register(t, c, "vllm-1", h1)
		waitEndpoints(t, v, "llama", h1.addr())
		before := m.Status().Version

		a.Stop()
		testutil.Eventually(t, 10*time.Second, "source reports consul down", func() error {
			for _, st := range src.Status() {
				if st.Up || st.LastError == nil {
					return fmt.Errorf("%v: up=%v err=%v", describe(st.Selector), st.Up, st.LastError)
				}
			}
			return nil
		})
		testutil.Eventually(t, 5*time.Second, "manager reports the consul error", func() error {
			if err := m.LastError(); err == nil || !strings.Contains(err.Error(), `source "consul"`) {
				return fmt.Errorf("LastError = %v", err)
			}
			return nil
		})
		if got := endpointsOf(v, "llama"); len(got) != 1 || got[0].Address != h1.addr() {
			t.Fatalf("while consul is down the pool has %+v, want the last member %s", got, h1.addr())
		}
		if after := m.Status().Version; after != before {
			t.Errorf("state version went %d -> %d while consul was down, want no new state", before, after)
		}

		// A dev agent forgets everything: register another host after the
		// restart; the old one must go, the new one come.
		a.Restart()
		h2 := newModelServer(t)
		register(t, c, "vllm-2", h2)
		d := waitEndpoints(t, v, "llama", h2.addr())
		t.Logf("after the restart the new registration appeared after %v", d)
		testutil.Eventually(t, 5*time.Second, "source reports consul up", func() error {
			for _, st := range src.Status() {
				if !st.Up || st.LastError != nil || st.Index == 0 {
					return fmt.Errorf("%v: up=%v err=%v index=%d", describe(st.Selector), st.Up, st.LastError, st.Index)
				}
			}
			return m.LastError()
		})
	})
}

// TestRegisterReplica registers a replica with a real agent: its service
// carries the picker address, admin and ADS addresses and a readiness check
// that passes; the registration comes back after the agent loses it, and
// goes when Register returns.
func TestRegisterReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Consul")
	}
	a := testutil.StartConsul(t)
	c := a.Client()
	ready := newModelServer(t) // answers /health; the check only needs a 200
	reg := Registration{Service: "switchyard", ID: "sy-test", Address: "127.0.0.1:9002",
		Admin: "127.0.0.1:9090", XDS: "127.0.0.1:18000", CheckURL: "http://" + ready.addr() + "/health"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Register(ctx, c, reg, 200*time.Millisecond, slog.New(slog.NewTextHandler(t.Output(), nil)))
	}()
	passing := func() error {
		entries, _, err := c.Health().Service("switchyard", "", true, nil)
		if err != nil {
			return err
		}
		reps, _ := convertReplicas(entries)
		if len(reps) != 1 || reps[0].Address != "127.0.0.1:9002" || reps[0].Admin != "127.0.0.1:9090" || reps[0].XDS != "127.0.0.1:18000" || reps[0].ID != "sy-test" {
			return fmt.Errorf("replicas %+v", reps)
		}
		return nil
	}
	testutil.Eventually(t, 10*time.Second, "replica registered and passing", passing)
	if err := c.Agent().ServiceDeregister("sy-test"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "replica registered again after the agent lost it", passing)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	svcs, err := c.Agent().Services()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := svcs["sy-test"]; ok {
		t.Fatal("replica still registered after Register returned")
	}
}
