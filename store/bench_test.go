package store

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// benchState is the benchmark state: 20 pools of 50 endpoints (1,000).
const benchPools, benchPerPool = 20, 50

// fillStore saves a realistic full load into s: the 1,000-endpoint state,
// metrics and health for every endpoint, a 2 KiB prefix blob per endpoint
// and 10,000 sessions.
func fillStore(b *testing.B, s *File) {
	b.Helper()
	st := makeState(benchPools, benchPerPool, 1)
	s.SaveState(st)
	now := time.Now()
	metrics := map[EndpointKey]Metrics{}
	health := map[EndpointKey]Health{}
	blob := make([]byte, 2<<10)
	for _, name := range st.PoolNames() {
		for _, ep := range st.Pools[name].Endpoints {
			k := EndpointKey{Pool: name, Address: ep.Address}
			metrics[k] = Metrics{Waiting: 3, Running: 12, KVUsage: 0.42, ScrapedAt: now}
			health[k] = Health{Healthy: true, Since: now}
			if err := s.SavePrefix(name, ep.Address, blob); err != nil {
				b.Fatal(err)
			}
		}
	}
	s.SaveMetrics(metrics)
	s.SaveHealth(health)
	sessions := make([]Session, 10_000)
	for i := range sessions {
		sessions[i] = Session{ID: fmt.Sprintf("session-%06d", i), Pool: "pool-00", Endpoint: "10.0.0.1:8000", Expires: now.Add(time.Hour)}
	}
	s.SaveSessions(sessions)
	s.SaveConsulIndex("service:vllm", 42)
}

func fileSize(b *testing.B, path string) float64 {
	fi, err := os.Stat(path)
	if err != nil {
		b.Fatal(err)
	}
	return float64(fi.Size())
}

// BenchmarkSaveStateFlush measures SaveState plus the flush that commits a
// 1,000-endpoint / 20-pool state (one bbolt transaction with fsync).
func BenchmarkSaveStateFlush(b *testing.B) {
	path := filepath.Join(b.TempDir(), "state.db")
	s := openT(b, path, testOpts())
	st := makeState(benchPools, benchPerPool, 1)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		// The previous iteration's flush has released st, so it may change.
		st.Version = uint64(i + 1)
		s.SaveState(st)
		flushT(b, s)
	}
	b.StopTimer()
	b.ReportMetric(fileSize(b, path), "file-bytes")
}

// BenchmarkFlushMetricsHealth measures the steady-state flush: fresh
// metrics and health for all 1,000 endpoints in one transaction.
func BenchmarkFlushMetricsHealth(b *testing.B) {
	s := openT(b, filepath.Join(b.TempDir(), "state.db"), testOpts())
	st := makeState(benchPools, benchPerPool, 1)
	now := time.Now()
	metrics := map[EndpointKey]Metrics{}
	health := map[EndpointKey]Health{}
	for _, name := range st.PoolNames() {
		for _, ep := range st.Pools[name].Endpoints {
			k := EndpointKey{Pool: name, Address: ep.Address}
			metrics[k] = Metrics{Waiting: 3, Running: 12, KVUsage: 0.42, ScrapedAt: now}
			health[k] = Health{Healthy: true, Since: now}
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		s.SaveMetrics(metrics)
		s.SaveHealth(health)
		flushT(b, s)
	}
}

// BenchmarkSaveStateCall measures the request-path cost of SaveState alone.
func BenchmarkSaveStateCall(b *testing.B) {
	s := openT(b, filepath.Join(b.TempDir(), "state.db"), testOpts())
	st := makeState(benchPools, benchPerPool, 1)
	b.ReportAllocs()
	for b.Loop() {
		s.SaveState(st)
	}
}

// BenchmarkLoad measures Load of a full store: the 1,000-endpoint state,
// metrics, health and a 2 KiB prefix blob per endpoint, 10,000 sessions.
func BenchmarkLoad(b *testing.B) {
	path := filepath.Join(b.TempDir(), "state.db")
	s := openT(b, path, testOpts())
	fillStore(b, s)
	flushT(b, s)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		snap, err := s.Load()
		if err != nil {
			b.Fatal(err)
		}
		if len(snap.Metrics) != benchPools*benchPerPool {
			b.Fatalf("loaded %d metrics", len(snap.Metrics))
		}
	}
	b.StopTimer()
	b.ReportMetric(fileSize(b, path), "file-bytes")
}

// BenchmarkOpen measures opening that full store: lock, header check,
// bbolt open and the full validating read.
func BenchmarkOpen(b *testing.B) {
	path := filepath.Join(b.TempDir(), "state.db")
	s := openT(b, path, testOpts())
	fillStore(b, s)
	closeT(b, s)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		s, err := Open(path, testOpts())
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLoadState measures Load of a store holding only the
// 1,000-endpoint / 20-pool state.
func BenchmarkLoadState(b *testing.B) {
	path := filepath.Join(b.TempDir(), "state.db")
	s := openT(b, path, testOpts())
	s.SaveState(makeState(benchPools, benchPerPool, 1))
	flushT(b, s)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		snap, err := s.Load()
		if err != nil {
			b.Fatal(err)
		}
		if snap.State() == nil {
			b.Fatal("no state")
		}
	}
	b.StopTimer()
	b.ReportMetric(fileSize(b, path), "file-bytes")
}
