package consul

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// TestAgentUnreachable: a model host's own Consul client agent stops
// answering (SIGSTOP: as a partition between it and the servers looks to
// them) while its server keeps serving. The servers mark the node's
// serfHealth critical, so the instance is critical in Consul; switchyard
// keeps it in the pool, marked NodeUnreachable, and its discovery guard
// holds nothing. When the agent answers again the mark goes.
func TestAgentUnreachable(t *testing.T) {
	serfLAN := testutil.FreePort(t)
	server := testutil.StartConsulArgs(t, "-serf-lan-port", strconv.Itoa(serfLAN))

	// The model host's agent: a client that joins the dev server.
	httpPort := testutil.FreePort(t)
	agent := testutil.Start(t, "consul-client", testutil.ConsulPath(t), "agent",
		"-data-dir", t.TempDir(), "-node", "model-host", "-bind", "127.0.0.1", "-client", "127.0.0.1",
		"-http-port", strconv.Itoa(httpPort), "-dns-port", "-1", "-grpc-port", "-1", "-grpc-tls-port", "-1",
		"-serf-lan-port", strconv.Itoa(testutil.FreePort(t)), "-retry-join", "127.0.0.1:"+strconv.Itoa(serfLAN),
		"-hcl", "disable_update_check = true", "-log-level", "warn")
	t.Cleanup(func() { _ = agent.Signal(syscall.SIGCONT) }) // so Stop can end it
	client, err := api.NewClient(&api.Config{Address: "127.0.0.1:" + strconv.Itoa(httpPort)})
	if err != nil {
		t.Fatal(err)
	}
	h := newModelServer(t)
	testutil.Eventually(t, 45*time.Second, "the client agent joined and registered the host", func() error {
		if leader, err := client.Status().Leader(); err != nil || leader == "" {
			return fmt.Errorf("no leader through the client agent: %q %v", leader, err)
		}
		return nil
	})
	register(t, client, "vllm-1", h)

	sel := registry.ConsulSelector{Service: "vllm", PassingOnly: true}
	pool := &registry.Pool{Name: "llama", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed, MetricsPath: "/metrics", Consul: &sel}
	pub := registry.NewPublisher(nil)
	log := slog.New(slog.NewTextHandler(t.Output(), nil))
	m := registry.NewManager(pub, registry.WithLogger(log))
	file := registry.Update{Pools: map[string]*registry.Pool{"llama": pool}}
	if err := m.AddSource("file", staticSource{file}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := registry.Merge([]registry.Update{file})
	if err != nil {
		t.Fatal(err)
	}
	// switchyard reads the server, as a replica on a control host does.
	src, err := New(Options{Wants: WantsFrom(cfg), Address: "http://" + server.Addr, WaitTime: 10 * time.Second, Logger: log,
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
	waitEndpoints(t, pub, "llama", h.addr())

	serfHealth := func() (string, error) {
		checks, _, err := server.Client().Health().Node("model-host", nil)
		if err != nil {
			return "", err
		}
		for _, c := range checks {
			if c.CheckID == "serfHealth" {
				return c.Status, nil
			}
		}
		return "", fmt.Errorf("no serfHealth check: %+v", checks)
	}

	if err := agent.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	testutil.Eventually(t, time.Minute, "Consul marks the model host's node failed", func() error {
		st, err := serfHealth()
		if err != nil {
			return err
		}
		if st != api.HealthCritical {
			return fmt.Errorf("serfHealth %s", st)
		}
		return nil
	})
	t.Logf("serfHealth critical %v after the agent stopped answering", time.Since(stopped).Round(100*time.Millisecond))
	if entries, _, err := server.Client().Health().Service("vllm", "", false, nil); err != nil || len(entries) != 1 || entries[0].Checks.AggregatedStatus() != api.HealthCritical {
		t.Fatalf("Consul's view of the instance: %v %+v; want it critical", err, entries)
	}
	testutil.Eventually(t, 10*time.Second, "the endpoint marked NodeUnreachable, still a member", func() error {
		eps := endpointsOf(pub, "llama")
		if len(eps) != 1 || eps[0].Address != h.addr() || !eps[0].NodeUnreachable || eps[0].Held || eps[0].Critical {
			return fmt.Errorf("pool llama %+v", eps)
		}
		return nil
	})
	if st := m.Status(); len(st.Guards) != 0 || st.GuardActivations["llama"] != 0 {
		t.Errorf("the discovery guard held %v (%v activations): an unreachable agent is not a failing check", st.Guards, st.GuardActivations)
	}

	if err := agent.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, time.Minute, "the mark goes when the agent answers again", func() error {
		eps := endpointsOf(pub, "llama")
		if len(eps) != 1 || eps[0].NodeUnreachable {
			return fmt.Errorf("pool llama %+v", eps)
		}
		return nil
	})
}
