package metrics

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// fakeServer is a real HTTP server on 127.0.0.1 whose /metrics answer the
// test changes while it runs.
type fakeServer struct {
	*httptest.Server
	page   atomic.Pointer[string]
	status atomic.Int32
	hang   atomic.Bool
	hits   atomic.Int64
}

func newFakeServer(t *testing.T, page string) *fakeServer {
	t.Helper()
	f := &fakeServer{}
	f.setPage(page)
	f.status.Store(http.StatusOK)
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.hits.Add(1)
		if f.hang.Load() {
			<-r.Context().Done()
			return
		}
		if r.URL.Path != "/metrics" && r.URL.Path != "/alt" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		w.WriteHeader(int(f.status.Load()))
		page := *f.page.Load()
		if r.URL.Path == "/alt" {
			page = vllmPage(42, 0, 0.1)
		}
		fmt.Fprint(w, page)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeServer) setPage(p string) { f.page.Store(&p) }

func (f *fakeServer) addr() string { return strings.TrimPrefix(f.URL, "http://") }

func vllmPage(waiting, running int, kv float64) string {
	return fmt.Sprintf(`# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} %d
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} %d
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} %g
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1
`, waiting, running, kv)
}

// fastOptions scrape every 5 ms, whatever the page costs the server.
func fastOptions() Options {
	return Options{Interval: 5 * time.Millisecond, Timeout: 200 * time.Millisecond, FailureThreshold: 2, MaxBackoff: 20 * time.Millisecond,
		EngineBudget: -1}
}

// waitValues polls until the endpoint's latest successful values satisfy ok.
func waitValues(t *testing.T, m *Manager, k Key, what string, ok func(Values) bool) *Snapshot {
	t.Helper()
	var got *Snapshot
	testutil.Eventually(t, 5*time.Second, what, func() error {
		got = m.Get(k)
		if got == nil {
			return errors.New("no snapshot yet")
		}
		if got.Err != nil || !ok(got.Values) {
			return fmt.Errorf("snapshot %+v", *got)
		}
		return nil
	})
	return got
}

func TestManagerFollowsChangingAnswers(t *testing.T) {
	t.Parallel()
	a := newFakeServer(t, vllmPage(3, 1, 0.5))
	b := newFakeServer(t, vllmPage(0, 8, 0.9))
	m := NewManager(context.Background(), fastOptions())
	defer m.Stop()
	ka := Key{Pool: "p", Address: a.addr()}
	kb := Key{Pool: "p", Address: b.addr()}
	if err := m.Sync([]Target{
		{Pool: "p", Address: a.addr(), Engine: registry.EngineVLLM},
		{Pool: "p", Address: b.addr(), Engine: registry.EngineVLLM, MetricsPath: "metrics"},
	}); err != nil {
		t.Fatal(err)
	}
	s := waitValues(t, m, ka, "a scraped", func(v Values) bool { return v.Waiting == 3 && v.Running == 1 && v.KVUsage == 0.5 })
	if s.BlockSize != 16 || s.NumBlocks != 1000 {
		t.Errorf("cache config = %d/%d", s.BlockSize, s.NumBlocks)
	}
	if !s.Fresh(s.LastSuccess) || s.Fresh(s.LastSuccess.Add(s.MaxAge+time.Millisecond)) {
		t.Errorf("Fresh wrong around MaxAge %v", s.MaxAge)
	}
	if s.MaxAge != DefaultMinMaxAge {
		t.Errorf("MaxAge = %v, want the 250ms floor for a 5ms interval", s.MaxAge)
	}
	waitValues(t, m, kb, "b scraped", func(v Values) bool { return v.Running == 8 && v.KVUsage == 0.9 })

	a.setPage(vllmPage(9, 2, 0.75))
	waitValues(t, m, ka, "a's new answer", func(v Values) bool { return v.Waiting == 9 && v.Running == 2 && v.KVUsage == 0.75 })

	all := m.All()
	if len(all) != 2 {
		t.Fatalf("All() = %d snapshots", len(all))
	}
	if m.Get(Key{Pool: "other", Address: a.addr()}) != nil {
		t.Error("Get of an unknown key must be nil")
	}
}

func TestManagerFailureAndRecovery(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, vllmPage(4, 4, 0.25))
	var mu sync.Mutex
	var events []Transition
	opts := fastOptions()
	opts.OnTransition = func(tr Transition) {
		mu.Lock()
		events = append(events, tr)
		mu.Unlock()
	}
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	k := Key{Pool: "p", Address: srv.addr()}
	if err := m.Sync([]Target{{Pool: "p", Address: srv.addr(), Engine: registry.EngineVLLM}}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, k, "first scrape", func(v Values) bool { return v.Waiting == 4 })

	srv.status.Store(http.StatusInternalServerError)
	testutil.Eventually(t, 5*time.Second, "endpoint failing", func() error {
		s := m.Get(k)
		if !s.Failing {
			return fmt.Errorf("not failing: %+v", *s)
		}
		if s.Err == nil || !strings.Contains(s.Err.Error(), "HTTP 500") {
			return fmt.Errorf("err = %v", s.Err)
		}
		// The last good values are kept while failing.
		if s.Waiting != 4 || s.LastSuccess.IsZero() {
			return fmt.Errorf("lost last good values: %+v", *s)
		}
		return nil
	})
	testutil.Eventually(t, 5*time.Second, "failing transition", func() error {
		mu.Lock()
		defer mu.Unlock()
		// The first successful scrape, then the failure.
		if len(events) != 2 || !events[0].Healthy || events[1].Healthy || events[1].Key != k {
			return fmt.Errorf("events %+v", events)
		}
		return nil
	})

	srv.status.Store(http.StatusOK)
	srv.setPage(vllmPage(1, 1, 0.125))
	s := waitValues(t, m, k, "recovered", func(v Values) bool { return v.Waiting == 1 && v.KVUsage == 0.125 })
	if s.Failing || s.ConsecutiveFailures != 0 {
		t.Errorf("still failing after success: %+v", *s)
	}
	testutil.Eventually(t, 5*time.Second, "recovery transition", func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(events) != 3 || !events[2].Healthy {
			return fmt.Errorf("events %+v", events)
		}
		return nil
	})
}

func TestManagerTimeoutAndBodyCap(t *testing.T) {
	t.Parallel()
	hung := newFakeServer(t, vllmPage(1, 1, 0.1))
	hung.hang.Store(true)
	big := newFakeServer(t, vllmPage(1, 1, 0.1)+strings.Repeat("# filler comment line\n", 200))
	opts := fastOptions()
	opts.Timeout = 30 * time.Millisecond
	opts.MaxBodyBytes = 1024
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	if err := m.Sync([]Target{
		{Pool: "p", Address: hung.addr()},
		{Pool: "p", Address: big.addr()},
	}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr, want string
	}{{hung.addr(), "deadline exceeded"}, {big.addr(), "exceeds 1024 bytes"}} {
		testutil.Eventually(t, 5*time.Second, c.want, func() error {
			s := m.Get(Key{Pool: "p", Address: c.addr})
			if s == nil || !s.Failing || s.Err == nil || !strings.Contains(s.Err.Error(), c.want) {
				return fmt.Errorf("snapshot %+v", s)
			}
			if s.Fresh(time.Now()) {
				return errors.New("never-successful endpoint reported fresh")
			}
			return nil
		})
	}
}

func TestManagerEndpointSetChanges(t *testing.T) {
	t.Parallel()
	a := newFakeServer(t, vllmPage(1, 0, 0))
	b := newFakeServer(t, vllmPage(2, 0, 0))
	m := NewManager(context.Background(), fastOptions())
	defer m.Stop()
	ta := Target{Pool: "p", Address: a.addr(), Engine: registry.EngineVLLM}
	tb := Target{Pool: "p", Address: b.addr(), Engine: registry.EngineVLLM}
	if err := m.Sync([]Target{ta}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, ta.Key(), "a", func(v Values) bool { return v.Waiting == 1 })

	if err := m.Sync([]Target{ta, tb}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, tb.Key(), "b added", func(v Values) bool { return v.Waiting == 2 })

	// Removing a stops its goroutine and its requests.
	if err := m.Sync([]Target{tb}); err != nil {
		t.Fatal(err)
	}
	if m.Get(ta.Key()) != nil {
		t.Error("removed endpoint still readable")
	}
	testutil.Eventually(t, 5*time.Second, "one scrape goroutine left", func() error {
		if n := m.running.Load(); n != 1 {
			return fmt.Errorf("%d running", n)
		}
		return nil
	})
	before := a.hits.Load()
	waitValues(t, m, tb.Key(), "b keeps being scraped", func(Values) bool { return b.hits.Load() > before+3 })
	if a.hits.Load() != before {
		t.Errorf("removed endpoint still scraped: %d -> %d", before, a.hits.Load())
	}

	// Changing a target's path restarts it with the new settings; its
	// Handle stays the same and sees the new values.
	hb := m.Handle(tb.Key())
	if hb == nil || m.Handle(ta.Key()) != nil {
		t.Fatal("Handle: want one for b only")
	}
	tb.MetricsPath = "/alt"
	if err := m.Sync([]Target{tb}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, tb.Key(), "b re-pathed", func(v Values) bool { return v.Waiting == 42 })
	if m.Handle(tb.Key()) != hb || hb.Load().Waiting != 42 {
		t.Fatal("handle changed across a target restart")
	}

	// A bad target is reported; the good ones are kept.
	bad := Target{Pool: "p", Address: a.addr(), Engine: "tgi"}
	err := m.Sync([]Target{tb, bad})
	if err == nil || !strings.Contains(err.Error(), "unknown engine") || !strings.Contains(err.Error(), a.addr()) {
		t.Fatalf("err = %v", err)
	}
	if m.Get(tb.Key()) == nil {
		t.Error("good target dropped")
	}
	if n := m.running.Load(); n != 1 {
		t.Errorf("%d running after bad target", n)
	}
}

func TestManagerStopLeavesNoGoroutines(t *testing.T) {
	// Not parallel: it counts the process's goroutines.
	before := runtime.NumGoroutine()
	srvs := []*fakeServer{newFakeServer(t, vllmPage(1, 1, 0.1)), newFakeServer(t, vllmPage(2, 2, 0.2))}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := NewManager(ctx, fastOptions())
	var targets []Target
	for _, s := range srvs {
		targets = append(targets, Target{Pool: "p", Address: s.addr()})
	}
	if err := m.Sync(targets); err != nil {
		t.Fatal(err)
	}
	for _, tg := range targets {
		waitValues(t, m, tg.Key(), "scraped", func(v Values) bool { return v.Running > 0 })
	}
	m.Stop()
	if n := m.running.Load(); n != 0 {
		t.Fatalf("%d scrape goroutines after Stop", n)
	}
	if err := m.Sync(targets); err == nil {
		t.Error("Sync after Stop must fail")
	}
	for _, s := range srvs {
		s.Close()
	}
	testutil.Eventually(t, 5*time.Second, "goroutines back to baseline", func() error {
		if n := runtime.NumGoroutine(); n > before {
			return fmt.Errorf("%d goroutines, %d before", n, before)
		}
		return nil
	})
}

func TestManagerStopsWithContext(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, vllmPage(1, 1, 0.1))
	ctx, cancel := context.WithCancel(context.Background())
	m := NewManager(ctx, fastOptions())
	defer m.Stop()
	if err := m.Sync([]Target{{Pool: "p", Address: srv.addr()}}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, Key{"p", srv.addr()}, "scraped", func(v Values) bool { return v.Waiting == 1 })
	cancel()
	testutil.Eventually(t, 5*time.Second, "goroutine exits on ctx cancel", func() error {
		if n := m.running.Load(); n != 0 {
			return fmt.Errorf("%d running", n)
		}
		return nil
	})
}

// A page waits for a parse slot once it is read (MaxParallelParses), and
// the wait is not the server's slowness: however long it lasts, the
// scrape does not fail for the timeout, and it publishes once parsed.
func TestManagerParseSlotWaitIsNotATimeout(t *testing.T) {
	t.Parallel()
	f := newFakeServer(t, vllmPage(4, 2, 0.25))
	opts := fastOptions()
	opts.Timeout = 50 * time.Millisecond
	opts.MaxParallelParses = 1
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	m.parsing <- struct{}{} // the only slot, held
	k := Key{Pool: "p", Address: f.addr()}
	if err := m.Sync([]Target{{Pool: "p", Address: f.addr(), Engine: registry.EngineVLLM}}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "page read", func() error {
		if f.hits.Load() == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	// Hold the slot for several timeouts: the worker waits, neither
	// publishing a failure nor asking again.
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(4 * opts.Timeout); time.Now().Before(deadline); <-tick.C {
		if s := m.Get(k); s != nil {
			t.Fatalf("published while waiting for a parse slot: %+v", *s)
		}
	}
	if n := f.hits.Load(); n != 1 {
		t.Errorf("%d scrapes while the first waited for its parse", n)
	}
	<-m.parsing
	s := waitValues(t, m, k, "parsed once the slot is free", func(v Values) bool { return v.Waiting == 4 && v.Running == 2 })
	if s.ConsecutiveFailures != 0 {
		t.Errorf("failures %d after waiting for a slot", s.ConsecutiveFailures)
	}
}
