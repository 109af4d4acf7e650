package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestE2EManyConcurrentPickedRequests holds 1,500 streaming requests in
// flight through one Envoy at once (the model servers are stopped with
// SIGSTOP until every request is held): each holds an ext_proc stream to
// the picker for its whole response, or while it waits in the admission
// queue, and Envoy's default
// circuit breakers (1,024) would fail or, on a fail-open pool, silently
// bypass the picker for the rest. Every request must carry the picker's
// decision (the server that answered is the primary the picker chose), and
// Envoy's overflow and ext_proc failure counters must stay at 0.
func TestE2EManyConcurrentPickedRequests(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and simulators")
	}
	t.Parallel()
	const n = 1500
	sims := []*sim{startSim(t, simOptions{}), startSim(t, simOptions{}), startSim(t, simOptions{})}
	f := newFleet(t, fmt.Sprintf(`pool "main" {
  failure_mode = "fail_open"
  endpoints = [%q, %q, %q]
}
model "m-a" {
  pool = "main"
}
`, sims[0].Addr, sims[1].Addr, sims[2].Addr), fleetOptions{})

	// Stopped servers still accept connections (the kernel's backlog), so
	// every request is picked, forwarded and then waits for its answer.
	for _, s := range sims {
		if err := s.proc.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	resumed := false
	resume := func() {
		if resumed {
			return
		}
		resumed = true
		for _, s := range sims {
			_ = s.proc.Signal(syscall.SIGCONT)
		}
	}
	defer resume()

	client := &http.Client{Timeout: 3 * time.Minute, Transport: &http.Transport{
		MaxIdleConnsPerHost: n, DisableCompression: true,
	}}
	defer client.CloseIdleConnections()
	var (
		wg      sync.WaitGroup
		results = make([]*infResp, n)
		errs    = make([]error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = sendTo(client, "http://"+f.listen, infReq{model: "m-a", prompt: fmt.Sprintf("request %d", i), maxTokens: 4, stream: true}, nil)
		}()
	}
	// Each holds an ext_proc stream: picked and waiting for its answer,
	// or, beyond the picker's per-server in-flight guard (256 each),
	// waiting in the admission queue for one to finish.
	var held string
	testutil.Eventually(t, 2*time.Minute, fmt.Sprintf("%d requests held at once", n), func() error {
		st, err := f.status()
		if err != nil {
			return err
		}
		var inFlight, queued int64
		for _, p := range st.Pools {
			for _, e := range p.Endpoints {
				inFlight += e.InFlightRequests
			}
			if p.Admission != nil {
				queued += int64(p.Admission.Queued)
			}
		}
		held = fmt.Sprintf("%d picked and in flight, %d waiting in the admission queue", inFlight, queued)
		if inFlight+queued < n {
			return fmt.Errorf("%s (picked %d)", held, st.Picker.Picked)
		}
		return nil
	})
	t.Logf("%d requests held through the picker at once: %s", n, held)
	resume()
	wg.Wait()

	served := map[string]int{}
	for i, r := range results {
		switch {
		case errs[i] != nil:
			t.Errorf("request %d: %v", i, errs[i])
		case r.status != http.StatusOK:
			t.Errorf("request %d: status %d: %s", i, r.status, truncate(string(r.body), 200))
		case r.destination == "":
			t.Errorf("request %d served by %s without the picker's decision", i, r.servedBy)
		case strings.Split(r.destination, ",")[0] != r.servedBy:
			t.Errorf("request %d: picked %s, served by %s", i, r.destination, r.servedBy)
		default:
			served[r.servedBy]++
		}
	}
	t.Logf("served: %v", served)
	checkDashboardEnvoyMetrics(t, f)
	for _, stat := range []string{
		"cluster.switchyard/picker.upstream_rq_pending_overflow",
		"cluster.switchyard/picker.upstream_cx_overflow",
		"cluster.switchyard/picker.upstream_rq_retry_overflow",
		"http.public.ext_proc.streams_failed",
		"http.public.ext_proc.failure_mode_allowed",
	} {
		v, err := envoyStat(f.envoyAdm, stat)
		if err != nil {
			t.Errorf("%s: %v", stat, err)
			continue
		}
		if v != 0 {
			t.Errorf("Envoy %s = %d, want 0", stat, v)
		}
	}
}

// checkDashboardEnvoyMetrics fails unless every envoy_* metric the Grafana
// dashboard queries is one this Envoy exports (/stats/prometheus), so the
// panels that show a bypassed or failing picker cannot go blank.
func checkDashboardEnvoyMetrics(t *testing.T, f *fleet) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "examples", "grafana", "switchyard-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	prom, err := httpGetString(f.envoyAdm + "/stats/prometheus")
	if err != nil {
		t.Fatal(err)
	}
	// A metric name is followed by its selector or range; label names
	// (envoy_cluster_name=...) are not.
	found := regexp.MustCompile(`\b(envoy_[a-z0-9_]+)[{\[]`).FindAllStringSubmatch(string(b), -1)
	if len(found) == 0 {
		t.Fatal("the dashboard queries no Envoy metric")
	}
	for _, m := range found {
		n := m[1]
		if !strings.Contains(prom, "\n"+n+"{") && !strings.HasPrefix(prom, n+"{") {
			t.Errorf("the dashboard queries %s, which Envoy does not export", n)
		}
	}
}
