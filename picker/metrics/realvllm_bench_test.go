package metrics

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/procstat"
	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/registry"
)

// processCPU is a process's CPU time so far (user plus system, all its
// threads, not its children).
func processCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	cpu, err := procstat.CPU(pid)
	if err != nil {
		b.Fatal(err)
	}
	return cpu
}

// BenchmarkRealVLLMScrapeCost measures what being watched costs a real
// vLLM 0.32 server (the CPU build, the tiny generated model, idle): the
// CPU of its API server process per /metrics scrape (with and without the
// name[] filter, which vLLM 0.32 ignores) and per GET /load, then its CPU
// per second while one or three replicas' scrapers read it for 30 s:
// "before" as every endpoint was read before issue 25 (every 50 ms,
// whatever it costs), "after" with the defaults, the endpoint idle (no
// traffic from the picker) and busy (the picker has requests in flight
// there: read at its interval, within the engine budget). The server's
// own idle CPU is measured first and subtracted. Sub-benchmarks select
// cases (the server starts once). Run (about 6 minutes):
//
//	SWITCHYARD_REQUIRE_VLLM=1 go test -run '^$' -bench RealVLLMScrapeCost -benchtime 1x -timeout 30m ./picker/metrics/
func BenchmarkRealVLLMScrapeCost(b *testing.B) {
	py := realvllm.Require(b)
	model := realvllm.EnsureModel(b, py)
	srv := realvllm.StartFleet(b, py, model, realvllm.Options{Extra: []string{"--enable-server-load-tracking"}})[0]
	pid := srv.Pid()
	ctx := context.Background()
	client := &http.Client{Timeout: 10 * time.Second}
	get := func(path string) int {
		resp, err := client.Get(srv.URL() + path)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		n, _ := io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: HTTP %d", path, resp.StatusCode)
		}
		return int(n)
	}
	p, err := NewParser(registry.EngineVLLM, nil)
	if err != nil {
		b.Fatal(err)
	}
	filter := "/metrics?" + url.Values{"name[]": p.SampleNames()}.Encode()
	for range 20 { // warm up every path
		get("/metrics")
		get(filter)
		get("/load")
	}
	per := func(name, path string, n int) {
		b.Run(name, func(b *testing.B) {
			cpu0 := processCPU(b, pid)
			size := 0
			for range n {
				size = get(path)
			}
			cost := processCPU(b, pid) - cpu0
			b.ReportMetric(float64(cost)/float64(n)/1e6, "engine-cpu-ms/request")
			b.ReportMetric(float64(size), "bytes")
		})
	}
	per("page", "/metrics", 200)
	per("page-name-filter", filter, 200)
	per("load", "/load", 200)

	window := 30 * time.Second
	cpu0 := processCPU(b, pid)
	time.Sleep(window) // the server alone: its own idle CPU
	idle := processCPU(b, pid) - cpu0
	b.Logf("idle, not scraped: engine CPU %v per %v", idle, window)

	// share: the replicas share scrapes (one owner reads, the others
	// ingest its readings, as over the replica mesh).
	run := func(name string, replicas int, opts Options, busy, share bool) {
		b.Run(name, func(b *testing.B) {
			var ms []*Manager
			var names []string
			var attempts, failures atomic.Int64
			for i := range replicas {
				names = append(names, fmt.Sprintf("r%d", i+1))
				o := opts
				d := &fakeDemand{}
				if busy {
					d.inFlight.Store(1)
				}
				o.Demand = func(Key) Demand { return d }
				o.OnReading = func(k Key, r Reading) {
					attempts.Add(1)
					if r.Err != "" {
						failures.Add(1)
					}
					if share {
						for j, m := range ms {
							if j != i {
								_ = m.Ingest(k, names[i], r)
							}
						}
					}
				}
				ms = append(ms, NewManager(ctx, o))
			}
			// Every manager exists before any reads (OnReading ranges
			// over them).
			for i, m := range ms {
				if share {
					m.SetReplicas(names[i], slices.Delete(slices.Clone(names), i, i+1))
				} else {
					m.SetScrapers(replicas)
				}
			}
			for _, m := range ms {
				if err := m.Sync([]Target{{Pool: "p", Address: srv.Addr, Engine: registry.EngineVLLM}}); err != nil {
					b.Fatal(err)
				}
			}
			time.Sleep(5 * time.Second) // the cost is learned, the intervals settle
			a0, f0 := attempts.Load(), failures.Load()
			cpu0 := processCPU(b, pid)
			time.Sleep(window)
			cpu := processCPU(b, pid) - cpu0 - idle
			a, f := attempts.Load()-a0, failures.Load()-f0
			var interval, cost time.Duration
			if s := ms[0].Get(Key{Pool: "p", Address: srv.Addr}); s != nil {
				interval, cost = s.Interval, s.Cost
			}
			for _, m := range ms {
				m.Stop()
			}
			share := 100 * float64(cpu) / float64(window)
			b.ReportMetric(share, "engine-cpu-%")
			b.ReportMetric(float64(a)/window.Seconds(), "scrapes/s")
			b.Logf("%d replica(s): %.1f scrapes/s in all (%d failed; interval %v, answer time %v), engine CPU %.2f%% of a core above idle (%v in %v)",
				replicas, float64(a)/window.Seconds(), f, interval, cost, share, cpu, window)
		})
	}
	// Before: each replica reads the page every 50 ms through net/http,
	// whatever it costs, without the filter; the cost measure is kept
	// (Options.Client makes the exchange the same as before).
	before := Options{Client: NewHTTPClient(), IdleInterval: -1, EngineBudget: -1, NoNameFilter: true}
	for _, replicas := range []int{1, 3} {
		run(fmt.Sprintf("before-%dr", replicas), replicas, before, true, false)
		run(fmt.Sprintf("after-idle-%dr", replicas), replicas, Options{}, false, false)
		run(fmt.Sprintf("after-busy-%dr", replicas), replicas, Options{}, true, false)
	}
	run("shared-busy-3r", 3, Options{}, true, true)
}
