package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/testutil"
)

// staticEnvoy is the baseline: one listener and a ROUND_ROBIN cluster of
// the same simulators, no ext_proc, no xDS.
const staticEnvoyYAML = `admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: %d}
static_resources:
  listeners:
  - name: rr
    address:
      socket_address: {address: 127.0.0.1, port_value: %d}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: sims, timeout: 0s}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: sims
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 1s
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}
    load_assignment:
      cluster_name: sims
      endpoints:
      - lb_endpoints:
%s`

// startStaticEnvoy runs the baseline Envoy and returns its listener URL.
func startStaticEnvoy(t testing.TB, concurrency int, sims []*sim) string {
	t.Helper()
	var eps strings.Builder
	for _, s := range sims {
		_, port, _ := strings.Cut(s.Addr, ":")
		fmt.Fprintf(&eps, "        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %s}}}\n", port)
	}
	admin, listen := testutil.FreePort(t), testutil.FreePort(t)
	path := testutil.WriteFile(t, t.TempDir(), "static.yaml", fmt.Sprintf(staticEnvoyYAML, admin, listen, eps.String()))
	testutil.Start(t, "static envoy", testutil.EnvoyPath(t), "-c", path, "--use-dynamic-base-id", "-l", "warning",
		"--concurrency", strconv.Itoa(concurrency))
	testutil.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/ready", admin), 15*time.Second)
	return fmt.Sprintf("http://127.0.0.1:%d", listen)
}

// benchRun is one closed-loop load run: a warm-up stage, then the
// measured stage.
func benchRun(ctx context.Context, t testing.TB, url string, promptTokens, concurrency int, warm, measure time.Duration) load.StageReport {
	t.Helper()
	rep, err := load.Run(ctx, load.Config{
		URL: url, API: load.APICompletions, Model: "m-a", NoStream: true,
		Workload: load.Workload{Kind: load.WorkloadRandom, Input: load.Fixed(promptTokens), Output: load.Fixed(1)},
		Arrival:  load.ArrivalConcurrency,
		Stages:   []load.Stage{{Concurrency: concurrency, Duration: warm}, {Concurrency: concurrency, Duration: measure}},
		Timeout:  30 * time.Second, DrainTimeout: 10 * time.Second, Seed: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	st := rep.Stages[1]
	if st.Failed > 0 || st.Completed == 0 {
		t.Fatalf("%s, %d tokens x %d: %d completed, %d failed: %v %v", url, promptTokens, concurrency, st.Completed, st.Failed, st.Errors, st.ErrorExamples)
	}
	return st
}

// TestE2EBench measures the latency Envoy + picker add over Envoy with
// plain round robin to the same simulators, and the request rate one
// switchyard sustains. Only with SWITCHYARD_BENCH=1; otherwise a smoke
// run checks both paths work.
//
//	SWITCHYARD_BENCH=1 go test -run TestE2EBench -v -timeout 10m ./cmd/switchyard/
func TestE2EBench(t *testing.T) {
	full := os.Getenv("SWITCHYARD_BENCH") == "1"
	if !full {
		t.Parallel()
	}
	// The sims' own time is negligible and constant: every simulated
	// duration is divided by 100000, prefill of a 200 KiB prompt is one
	// step, and the KV cache holds every concurrent request.
	simOpts := simOptions{timeScale: 100000, extra: []string{"-max-model-len", "100000", "-max-num-batched-tokens", "10000000",
		"-max-num-seqs", "2048", "-num-gpu-blocks", "2000000", "-enable-prefix-caching=false"}}
	sims := []*sim{startSim(t, simOpts), startSim(t, simOpts), startSim(t, simOpts)}
	var eps []string
	for _, s := range sims {
		eps = append(eps, s.Addr)
	}
	// Round robin in the picker too, so both paths spread load alike.
	f := newFleet(t, fmt.Sprintf("pool \"main\" {\n  endpoints = [%s]\n  scheduling {\n    profile = \"round-robin\"\n  }\n}\nmodel \"m-a\" {\n  pool = \"main\"\n}\n",
		quoteList(eps)), fleetOptions{envoyConcurrency: 2})
	baseline := startStaticEnvoy(t, 2, sims)
	picked := "http://" + f.listen

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	if !full {
		for _, url := range []string{baseline, picked} {
			st := benchRun(ctx, t, url, 820, 2, 100*time.Millisecond, 300*time.Millisecond)
			t.Logf("smoke %s: %d requests, e2e p50 %v", url, st.Completed, st.E2E.P50)
		}
		return
	}

	const (
		kib4   = 820   // tokens: 4-letter words + space, 5 bytes each = 4 KiB
		kib200 = 40960 // 200 KiB
	)
	var table strings.Builder
	table.WriteString("| prompt | streams | RR Envoy p50 | RR Envoy p99 | switchyard p50 | switchyard p99 | added p50 | added p99 | RR Envoy req/s | switchyard req/s |\n|---|---|---|---|---|---|---|---|---|---|\n")
	ms := func(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/1e6) }
	for _, size := range []struct {
		name   string
		tokens int
	}{{"4 KiB", kib4}, {"200 KiB", kib200}} {
		for _, c := range []int{1, 200} {
			measure := 4 * time.Second
			base := benchRun(ctx, t, baseline, size.tokens, c, time.Second, measure)
			sy := benchRun(ctx, t, picked, size.tokens, c, time.Second, measure)
			fmt.Fprintf(&table, "| %s | %d | %s | %s | %s | %s | %s | %s | %.0f | %.0f |\n", size.name, c,
				ms(base.E2E.P50), ms(base.E2E.P99), ms(sy.E2E.P50), ms(sy.E2E.P99),
				ms(sy.E2E.P50-base.E2E.P50), ms(sy.E2E.P99-base.E2E.P99), base.RequestThroughput, sy.RequestThroughput)
		}
	}

	// Maximum rate: closed-loop sweep through switchyard's Envoy (and the
	// baseline for reference) with small prompts, until throughput stops
	// rising.
	table.WriteString("\n| closed-loop concurrency | switchyard req/s | switchyard p50 | RR Envoy req/s | RR Envoy p50 |\n|---|---|---|---|---|\n")
	best, flat := 0.0, 0
	for _, c := range []int{8, 16, 32, 64, 128, 256, 512} {
		sy := benchRun(ctx, t, picked, 64, c, 500*time.Millisecond, 3*time.Second)
		base := benchRun(ctx, t, baseline, 64, c, 500*time.Millisecond, 3*time.Second)
		fmt.Fprintf(&table, "| %d | %.0f | %s | %.0f | %s |\n", c, sy.RequestThroughput, ms(sy.E2E.P50), base.RequestThroughput, ms(base.E2E.P50))
		if sy.RequestThroughput > best*1.03 {
			best, flat = sy.RequestThroughput, 0
		} else if flat++; flat == 2 {
			break
		}
	}
	fmt.Fprintf(&table, "\nmax sustained through switchyard: %.0f req/s (lower bound: Envoy, picker, 3 sims and the load generator share 2 cores)\n", best)
	fmt.Println(table.String())
}
