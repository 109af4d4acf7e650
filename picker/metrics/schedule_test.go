package metrics

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// filterServer serves the vLLM 0.11-shaped fixture and records each
// request's query; mode says what it does with a name[] filter.
type filterServer struct {
	*httptest.Server
	mu      sync.Mutex
	queries []url.Values
}

const (
	filterIgnore = iota // vLLM 0.32: the whole page regardless
	filterHonour        // prometheus_client: only the samples named
	filterRefuse        // 400 for any query string
)

func newFilterServer(t *testing.T, mode int) *filterServer {
	t.Helper()
	page := string(fixture(t, "vllm.txt"))
	f := &filterServer{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		f.mu.Lock()
		f.queries = append(f.queries, q)
		f.mu.Unlock()
		names := q["name[]"]
		switch {
		case mode == filterRefuse && r.URL.RawQuery != "":
			http.Error(w, "unexpected query", http.StatusBadRequest)
			return
		case mode == filterHonour && len(names) > 0:
			var out []string
			for _, l := range strings.Split(page, "\n") {
				n, _, _ := strings.Cut(l, "{")
				if f := strings.Fields(n); len(f) > 0 && slices.Contains(names, f[0]) {
					out = append(out, l)
				}
			}
			fmt.Fprint(w, strings.Join(out, "\n")+"\n")
			return
		}
		fmt.Fprint(w, page)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *filterServer) lastQuery() url.Values {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.queries) == 0 {
		return nil
	}
	return f.queries[len(f.queries)-1]
}

// The scraper asks for only the families it reads (Prometheus' name[]
// filter), a server that ignores the filter (real vLLM 0.32) still gives
// the right values, and the snapshot says whether the filter took.
func TestNameFilter(t *testing.T) {
	t.Parallel()
	want := Values{Waiting: 3, Running: 7, KVUsage: 0.4213, BlockSize: 16, NumBlocks: 27904}
	for _, tc := range []struct {
		name       string
		mode       int
		wantFilter FilterState
		wantQuery  bool // the latest request still carries the filter
	}{
		{"ignored", filterIgnore, FilterIgnored, true},
		{"honoured", filterHonour, FilterHonoured, true},
		{"refused", filterRefuse, FilterRejected, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newFilterServer(t, tc.mode)
			m := NewManager(context.Background(), fastOptions())
			defer m.Stop()
			k := Key{Pool: "p", Address: strings.TrimPrefix(srv.URL, "http://")}
			if err := m.Sync([]Target{{Pool: "p", Address: k.Address, Engine: registry.EngineVLLM}}); err != nil {
				t.Fatal(err)
			}
			var s *Snapshot
			testutil.Eventually(t, 5*time.Second, "scraped with the filter's verdict", func() error {
				s = m.Get(k)
				if s == nil || s.Err != nil || s.Filter != tc.wantFilter || s.LastSuccess.IsZero() {
					return fmt.Errorf("snapshot %+v", s)
				}
				return nil
			})
			if s.Waiting != want.Waiting || s.Running != want.Running || s.KVUsage != want.KVUsage || s.BlockSize != want.BlockSize || s.NumBlocks != want.NumBlocks {
				t.Errorf("values %+v, want %+v", s.Values, want)
			}
			if s.TTFT == nil || s.TTFT.Count != 2279 || s.Hists[HistQueue].Count != 1500 {
				t.Errorf("histograms: TTFT %+v, queue %+v", s.TTFT, s.Hists[HistQueue])
			}
			srv.mu.Lock()
			first := srv.queries[0]
			srv.mu.Unlock()
			names := first["name[]"]
			for _, n := range []string{"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
				"vllm:cache_config_info", "vllm:time_to_first_token_seconds_bucket", "vllm:request_queue_time_seconds_sum"} {
				if !slices.Contains(names, n) {
					t.Errorf("first request's name[] filter %q lacks %s", names, n)
				}
			}
			if slices.Contains(names, "vllm:e2e_request_latency_seconds_bucket") {
				t.Errorf("filter asks for a family never read: %q", names)
			}
			testutil.Eventually(t, 5*time.Second, "a later scrape", func() error {
				if q := srv.lastQuery(); tc.wantQuery != (len(q["name[]"]) > 0) {
					return fmt.Errorf("latest query %v", q)
				}
				return nil
			})
		})
	}
}

// fakeDemand is the picker's accounting for one endpoint.
type fakeDemand struct{ sent, inFlight atomic.Int64 }

func (d *fakeDemand) Demand() (int64, int64) { return d.sent.Load(), d.inFlight.Load() }

// An endpoint the picker sends nothing (and whose page shows nothing
// running) is read at its idle interval; one request sent there wakes the
// scraper at once.
func TestIdleEndpointWakesOnTraffic(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, vllmPage(0, 0, 0))
	d := &fakeDemand{}
	opts := fastOptions()
	opts.IdleInterval = time.Hour
	opts.Demand = func(Key) Demand { return d }
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	k := Key{Pool: "p", Address: srv.addr()}
	if err := m.Sync([]Target{{Pool: "p", Address: srv.addr()}}); err != nil {
		t.Fatal(err)
	}
	s := waitValues(t, m, k, "first scrape", func(Values) bool { return true })
	if s.Interval != time.Hour || s.MaxAge != 3*time.Hour {
		t.Fatalf("idle endpoint: interval %v, max age %v; want 1h, 3h", s.Interval, s.MaxAge)
	}
	hits := srv.hits.Load()
	srv.setPage(vllmPage(0, 1, 0.1))
	d.sent.Add(1)
	d.inFlight.Add(1)
	s = waitValues(t, m, k, "scraped again after a request was sent", func(v Values) bool { return v.Running == 1 })
	if s.Interval != opts.Interval {
		t.Errorf("endpoint in use: interval %v, want %v", s.Interval, opts.Interval)
	}
	if srv.hits.Load() <= hits {
		t.Error("no new scrape")
	}
	// Back to idle once the request ended and the page shows nothing.
	d.inFlight.Add(-1)
	srv.setPage(vllmPage(0, 0, 0))
	testutil.Eventually(t, 5*time.Second, "idle again", func() error {
		if s := m.Get(k); s.Interval != time.Hour {
			return fmt.Errorf("interval %v", s.Interval)
		}
		return nil
	})
}

// An endpoint that takes long to answer is read no more often than the
// engine budget allows, shared among the replicas that scrape it.
func TestEngineBudget(t *testing.T) {
	t.Parallel()
	page := vllmPage(1, 1, 0.5)
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond) // the page costs the server 20 ms
		fmt.Fprint(w, page)
	}))
	defer slow.Close()
	opts := fastOptions()
	opts.EngineBudget = 0.1
	opts.IdleInterval = time.Hour // the budget's floor is capped at the idle interval
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	addr := strings.TrimPrefix(slow.URL, "http://")
	k := Key{Pool: "p", Address: addr}
	if err := m.Sync([]Target{{Pool: "p", Address: addr}}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "interval stretched to the budget", func() error {
		s := m.Get(k)
		if s == nil || s.Cost < 20*time.Millisecond || s.Interval < 200*time.Millisecond || s.Interval != time.Duration(float64(s.Cost)/0.1) {
			return fmt.Errorf("snapshot %+v", s)
		}
		return nil
	})
	m.SetScrapers(3)
	testutil.Eventually(t, 10*time.Second, "three scrapers: a third of the budget each", func() error {
		if s := m.Get(k); s.Interval < 600*time.Millisecond || s.Interval != time.Duration(3*float64(s.Cost)/0.1) {
			return fmt.Errorf("interval %v for cost %v", s.Interval, s.Cost)
		}
		return nil
	})
}

// An endpoint another replica owns is not scraped here; its readings come
// in through Ingest, and it turns stale when they stop.
func TestOwnershipAndIngest(t *testing.T) {
	t.Parallel()
	srv := newFakeServer(t, vllmPage(2, 2, 0.2))
	var readings atomic.Int64
	opts := fastOptions()
	opts.OnReading = func(Key, Reading) { readings.Add(1) }
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	k := Key{Pool: "p", Address: srv.addr()}
	if err := m.Sync([]Target{{Pool: "p", Address: srv.addr()}}); err != nil {
		t.Fatal(err)
	}
	waitValues(t, m, k, "scraped while owned", func(v Values) bool { return v.Waiting == 2 })
	if readings.Load() == 0 {
		t.Error("OnReading not called for own scrapes")
	}
	owner := peerAhead(k, "me")
	m.SetReplicas("me", []string{owner})
	if got := m.Owner(k); got != owner {
		t.Fatalf("Owner = %q, want %q", got, owner)
	}
	// Wait until a scrape in progress has finished, then no more come.
	var before int64
	testutil.Eventually(t, 5*time.Second, "scraping stopped", func() error {
		before = srv.hits.Load()
		time.Sleep(50 * time.Millisecond) // ten intervals without a hit
		if n := srv.hits.Load(); n != before {
			return fmt.Errorf("%d more hits", n-before)
		}
		return nil
	})
	at := time.Now()
	if err := m.Ingest(k, owner, Reading{At: at, Values: Values{Waiting: 9, Running: 1}, Interval: time.Second}); err != nil {
		t.Fatal(err)
	}
	s := m.Get(k)
	if s.Waiting != 9 || s.From != owner || !s.LastSuccess.Equal(at) || s.MaxAge != 3*time.Second {
		t.Fatalf("ingested snapshot %+v", s)
	}
	if !s.Fresh(at.Add(time.Second)) || s.Fresh(at.Add(3*time.Second+time.Millisecond)) {
		t.Error("an ingested reading must turn stale after StaleIntervals of its interval")
	}
	if err := m.Ingest(Key{Pool: "p", Address: "127.0.0.1:1"}, owner, Reading{At: at}); err == nil {
		t.Error("Ingest for an endpoint not scraped here must fail")
	}
	if n := srv.hits.Load(); n != before {
		t.Errorf("scraped %d times while another replica owned it", n-before)
	}
	m.SetReplicas("me", nil)
	waitValues(t, m, k, "scraped again once owned", func(v Values) bool { return v.Waiting == 2 })
	if s := m.Get(k); s.From != "" {
		t.Errorf("own scrape marked from %q", s.From)
	}
}

// peerAhead returns a replica name ranked before self in k's order.
func peerAhead(k Key, self string) string {
	for i := 0; ; i++ {
		name := fmt.Sprintf("replica-%d", i)
		if Owner(self, []string{name}, k) == name {
			return name
		}
	}
}

// The budget never makes an endpoint in use wait longer than an idle one:
// slow answers may come from a starved CPU, not the page's cost.
func TestEngineBudgetCappedAtIdleInterval(t *testing.T) {
	t.Parallel()
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond)
		fmt.Fprint(w, vllmPage(1, 1, 0.5))
	}))
	defer slow.Close()
	opts := fastOptions()
	opts.EngineBudget = 0.01 // 2 s for a 20 ms answer
	opts.IdleInterval = 300 * time.Millisecond
	m := NewManager(context.Background(), opts)
	defer m.Stop()
	addr := strings.TrimPrefix(slow.URL, "http://")
	if err := m.Sync([]Target{{Pool: "p", Address: addr}}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "interval capped", func() error {
		if s := m.Get(Key{Pool: "p", Address: addr}); s == nil || s.Cost < 20*time.Millisecond || s.Interval != 300*time.Millisecond {
			return fmt.Errorf("snapshot %+v", s)
		}
		return nil
	})
}
