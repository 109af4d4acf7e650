package store

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/switchyard/switchyard/registry"
)

// testOpts returns options for tests: quiet logger, flushes only when asked.
func testOpts() Options {
	return Options{
		FlushInterval: time.Hour,
		LockTimeout:   100 * time.Millisecond,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

func openT(t testing.TB, path string, o Options) *File {
	t.Helper()
	s, err := Open(path, o)
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func flushT(t testing.TB, s *File) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v", err)
	}
}

func loadT(t testing.TB, s *File) *Snapshot {
	t.Helper()
	snap, err := s.Load()
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return snap
}

func closeT(t testing.TB, s *File) {
	t.Helper()
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// makeState builds a registry state with the given number of pools and
// endpoints per pool; half of each pool's endpoints come from Consul.
func makeState(pools, perPool int, version uint64) *registry.State {
	s := registry.Empty()
	s.Version = version
	for p := range pools {
		name := fmt.Sprintf("pool-%02d", p)
		pool := &registry.Pool{
			Name:        name,
			Engine:      registry.EngineVLLM,
			FailureMode: registry.FailClosed,
			MetricsPath: "/metrics",
			DeclRange:   fmt.Sprintf("pools.hcl:%d:1", p*10+1),
			Endpoints:   make([]registry.Endpoint, 0, perPool),
		}
		if p%2 == 0 {
			pool.Scheduling = &registry.Scheduling{
				Profile:          "default",
				Scorers:          map[string]float64{"queue": 2, "kv-cache": 1},
				Picker:           "max-score",
				ScrapeIntervalMS: 50,
				QueueThreshold:   5,
				KVThreshold:      0.8,
				Metrics:          map[string]string{"waiting": "vllm:num_requests_waiting"},
				SessionHeader:    "x-session-id",
			}
		} else {
			pool.Consul = &registry.ConsulSelector{Service: "vllm-" + name, Tag: "gpu", Datacenter: "dc1", PassingOnly: true}
		}
		for e := range perPool {
			ep := registry.Endpoint{Address: fmt.Sprintf("10.%d.%d.%d:8000", p, e/250, e%250), Source: "file"}
			if e%2 == 1 {
				ep.Source = "consul"
				ep.Models = []string{"llama-3-8b", "lora-sql"}
				ep.MetricsPath = "/v2/metrics"
			}
			ep.Draining = e%7 == 3
			if p%2 == 0 {
				ep.Role = []registry.Role{registry.RoleBoth, registry.RolePrefill, registry.RoleDecode}[e%3]
			}
			pool.Endpoints = append(pool.Endpoints, ep)
		}
		if p%2 == 0 {
			pool.Disaggregation = &registry.Disaggregation{UncachedTokens: 768, MinPromptTokens: 100, PrefillQueueThreshold: 3, DeclRange: "pools.hcl:9:3"}
		}
		s.Pools[name] = pool
		s.Models["model-"+name] = &registry.Model{
			Name: "model-" + name, Pool: name, Priority: p%3 - 1,
			Targets:   []registry.Target{{Name: "a", Weight: 80}, {Name: "b", Weight: 20}},
			DeclRange: "models.hcl:1:1",
		}
		if p%4 == 2 {
			s.Models["model-"+name].Disaggregation = &registry.Disaggregation{Disabled: true}
		}
	}
	s.Listeners = []registry.Listener{{Name: "public", Address: "127.0.0.1:8080", DeclRange: "l.hcl:1:1"}}
	if pools > 0 {
		s.Routing.DefaultPool = "pool-00"
		s.ReplicaDiscovery = &registry.ReplicaDiscovery{ConsulService: "switchyard", DeclRange: "replicas.hcl:1:1"}
		s.Replicas = []registry.Replica{
			{ID: "10.9.0.1:9002", Address: "10.9.0.1:9002", Source: "file"},
			{ID: "sy-2", Address: "10.9.0.2:9002", Admin: "10.9.0.2:9090", XDS: "10.9.0.2:18000", Source: "consul"},
		}
	}
	return s
}

func fileHash(t testing.TB, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func corruptFiles(t testing.TB, path string) []string {
	t.Helper()
	m, err := filepath.Glob(path + ".corrupt-*")
	if err != nil {
		t.Fatal(err)
	}
	return m
}
