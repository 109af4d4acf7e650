package quality

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestStaleMetricsKeepQueue freezes every simulator (SIGSTOP) while
// requests wait in the admission queue: the picker's view of the pool goes
// stale, and stale is not idle, so the queue must hold its requests (the
// picker counts what it sent against each server's learned batch) instead
// of releasing them onto servers that cannot take them. Once the servers
// run again, everything completes.
func TestStaleMetricsKeepQueue(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	bin := testutil.Binary(t, "vllm-sim")
	var sims []*testutil.Process
	var addrs []string
	for i := range 2 {
		port := testutil.FreePort(t)
		sims = append(sims, testutil.Start(t, fmt.Sprintf("vllm-sim-%d", i), bin, "-port", strconv.Itoa(port), "-model", modelName,
			"-time-scale", "10", "-max-num-seqs", "1", "-log-level", "warn"))
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(port))
	}
	for _, a := range addrs {
		testutil.WaitHTTP(t, "http://"+a+"/health", 15*time.Second)
	}
	t.Cleanup(func() {
		for _, p := range sims {
			_ = p.Signal(syscall.SIGCONT) // never leave one stopped
		}
	})
	f := startPickers(t, addrs, 20*time.Millisecond, 1, false, false, nil)
	srv := f.srvs[0]

	client := &http.Client{Timeout: 60 * time.Second}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failures []string
	send := func(i, maxTokens int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"request %d"}],"max_tokens":%d,"ignore_eos":true}`, modelName, i, maxTokens)
			resp, err := client.Post(f.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
			msg := ""
			switch {
			case err != nil:
				msg = err.Error()
			case resp.StatusCode != http.StatusOK:
				msg = resp.Status
			}
			if resp != nil {
				resp.Body.Close()
			}
			if msg != "" {
				mu.Lock()
				failures = append(failures, fmt.Sprintf("request %d: %s", i, msg))
				mu.Unlock()
			}
		}()
	}
	inFlight := func() map[string]int64 {
		out := map[string]int64{}
		for _, e := range srv.Stats().Endpoints {
			out[e.Address] = e.InFlightRequests
		}
		return out
	}
	total := func() (n int64) {
		for _, v := range inFlight() {
			n += v
		}
		return n
	}
	waiting := func() int {
		n := 0
		for _, st := range srv.AdmissionStats() {
			for _, w := range st.Waiting {
				n += w.Requests
			}
		}
		return n
	}

	// Long requests, one at a time, until the pool is saturated: each
	// server runs one (its batch, -max-num-seqs 1) with one on deck, and
	// the scrapes that showed it waiting taught the picker its batch.
	n := 0
	for !srv.Saturated(time.Now())[poolName] {
		if n == 8 {
			t.Fatalf("pool not saturated after %d long requests; in flight %v", n, inFlight())
		}
		before := total()
		send(n, 2500)
		n++
		testutil.Eventually(t, 5*time.Second, "the long request picked", func() error {
			if total() == before {
				return fmt.Errorf("in flight %d", before)
			}
			return nil
		})
		// Let a scrape see it before judging again.
		testutil.Eventually(t, 5*time.Second, "a scrape after the pick", func() error {
			for _, e := range srv.Stats().Endpoints {
				if e.Metrics == nil || !e.Metrics.Fresh(time.Now()) || e.Metrics.Running+e.Metrics.Waiting < int(e.InFlightRequests) {
					return fmt.Errorf("%s: scraped %+v, in flight %d", e.Address, e.Metrics, e.InFlightRequests)
				}
			}
			return nil
		})
	}
	const queued = 4
	for i := range queued {
		send(100+i, 4)
	}
	testutil.Eventually(t, 5*time.Second, "requests waiting in the admission queue", func() error {
		if w := waiting(); w != queued {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})

	for _, p := range sims {
		if err := p.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	frozenAt := time.Now()
	held, w0 := inFlight(), waiting()
	testutil.Eventually(t, 5*time.Second, "every server's metrics stale", func() error {
		for _, e := range srv.Stats().Endpoints {
			if e.Metrics.Fresh(time.Now()) {
				return fmt.Errorf("%s still fresh", e.Address)
			}
		}
		return nil
	})
	staleAt := time.Now()
	// Watch for a while with the view stale: nothing may leave the queue
	// for the frozen servers.
	for time.Since(staleAt) < 1500*time.Millisecond {
		if w := waiting(); w < w0 {
			t.Fatalf("%v after the freeze (%v stale) the queue fell from %d to %d; in flight %v (at the freeze %v)",
				time.Since(frozenAt).Round(time.Millisecond), time.Since(staleAt).Round(time.Millisecond), w0, w, inFlight(), held)
		}
		for a, v := range inFlight() {
			if v > held[a] {
				t.Fatalf("%s: %d in flight with its server frozen, %d at the freeze", a, v, held[a])
			}
		}
		time.Sleep(10 * time.Millisecond) // sampling interval, not synchronisation
	}
	t.Logf("%d long requests saturated the pool (in flight %v); %d waited through %v of stale metrics",
		n, held, w0, time.Since(staleAt).Round(time.Millisecond))

	for _, p := range sims {
		if err := p.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d requests failed after the servers resumed: %v", len(failures), failures)
	}
	if w := waiting(); w != 0 {
		t.Errorf("%d still waiting", w)
	}
}
