package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestE2EMTLSBench measures what mutual TLS between Envoy and switchyard
// adds on the request path: two fleets on the same simulators, one
// plaintext, one with mTLS on ADS and ext_proc, measured in alternation so
// that the machine's drift hits both alike. Only with SWITCHYARD_BENCH=1;
// otherwise a smoke run checks both paths answer.
//
//	SWITCHYARD_BENCH=1 go test -run TestE2EMTLSBench -count=1 -v -timeout 10m ./cmd/switchyard/
func TestE2EMTLSBench(t *testing.T) {
	full := os.Getenv("SWITCHYARD_BENCH") == "1"
	if !full {
		t.Parallel()
	}
	simOpts := simOptions{timeScale: 100000, extra: []string{"-max-model-len", "100000", "-max-num-batched-tokens", "10000000",
		"-max-num-seqs", "2048", "-num-gpu-blocks", "2000000", "-enable-prefix-caching=false"}}
	sims := []*sim{startSim(t, simOpts), startSim(t, simOpts)}
	cfg := fmt.Sprintf("pool \"main\" {\n  endpoints = [%s]\n  scheduling {\n    profile = \"round-robin\"\n  }\n}\nmodel \"m-a\" {\n  pool = \"main\"\n}\n",
		quoteList([]string{sims[0].Addr, sims[1].Addr}))
	plain := newFleet(t, cfg, fleetOptions{envoyConcurrency: 2})
	p := newE2EPKI(t)
	secure := newFleet(t, cfg, fleetOptions{envoyConcurrency: 2, switchyardArgs: p.args(), envoyTLSDir: p.envoy.Dir})

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	if !full {
		for _, f := range []*fleet{plain, secure} {
			st := benchRun(ctx, t, "http://"+f.listen, 820, 2, 100*time.Millisecond, 300*time.Millisecond)
			t.Logf("smoke %s: %d requests, e2e p50 %v", f.listen, st.Completed, st.E2E.P50)
		}
		return
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d)/1e6) }
	var table strings.Builder
	table.WriteString("| prompt | streams | round | plaintext p50 / p99 ms | mTLS p50 / p99 ms | added p50 / p99 ms | plaintext / mTLS req/s |\n|---|---|---|---|---|---|---|\n")
	for _, size := range []struct {
		name   string
		tokens int
	}{{"4 KiB", 820}, {"200 KiB", 40960}} {
		for _, c := range []int{1, 50} {
			for round := 1; round <= 3; round++ {
				a := benchRun(ctx, t, "http://"+plain.listen, size.tokens, c, 500*time.Millisecond, 3*time.Second)
				b := benchRun(ctx, t, "http://"+secure.listen, size.tokens, c, 500*time.Millisecond, 3*time.Second)
				fmt.Fprintf(&table, "| %s | %d | %d | %s / %s | %s / %s | %s / %s | %.0f / %.0f |\n", size.name, c, round,
					ms(a.E2E.P50), ms(a.E2E.P99), ms(b.E2E.P50), ms(b.E2E.P99),
					ms(b.E2E.P50-a.E2E.P50), ms(b.E2E.P99-a.E2E.P99), a.RequestThroughput, b.RequestThroughput)
			}
		}
	}
	fmt.Println(table.String())
}
