package picker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

const simModel = "sim-model"

// startSims starts n vllm-sim processes and returns their addresses,
// sorted, plus the ports.
func startSims(t *testing.T, n int, args ...string) []string {
	t.Helper()
	bin := testutil.Binary(t, "vllm-sim")
	var addrs []string
	for i := range n {
		port := testutil.FreePort(t)
		addr := "127.0.0.1:" + strconv.Itoa(port)
		testutil.Start(t, fmt.Sprintf("vllm-sim-%d", i), bin, append([]string{"-port", strconv.Itoa(port), "-model", simModel,
			"-time-scale", "10", "-log-level", "warn"}, args...)...)
		addrs = append(addrs, addr)
	}
	for _, a := range addrs {
		testutil.WaitHTTP(t, "http://"+a+"/health", 10*time.Second)
	}
	slices.Sort(addrs)
	return addrs
}

func simState(addrs []string, sc *registry.Scheduling) *registry.State {
	st := registry.Empty()
	st.Version = 1
	p := &registry.Pool{Name: "alpha", Engine: registry.EngineVLLM, Scheduling: sc}
	for _, a := range addrs {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a})
	}
	st.Pools["alpha"] = p
	st.Models[simModel] = &registry.Model{Name: simModel, Pool: "alpha"}
	st.Models["bulk"] = &registry.Model{Name: "bulk", Pool: "alpha", Priority: -1, Targets: []registry.Target{{Name: simModel, Weight: 1}}}
	return st
}

var fastScrape = Options{Metrics: metrics.Options{Interval: 20 * time.Millisecond, FailureThreshold: 2, MaxBackoff: 40 * time.Millisecond}}

// pickOnce routes one chat request through the picker and completes it
// (response end of stream), returning the primary endpoint.
func pickOnce(t *testing.T, h *harness, body []byte, extra ...string) string {
	t.Helper()
	s := h.duplex()
	s.send(postHeaders("/v1/chat/completions", extra...))
	s.send(reqBody(body, true))
	r := s.recv()
	if ir := r.GetImmediateResponse(); ir != nil {
		t.Fatalf("local reply %d: %s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	d := decisionOf(t, r)
	s.readStreamedRequestBody()
	s.send(respHeaders(true, ":status", "200"))
	s.recv()
	primary, _, _ := strings.Cut(d.dest, ",")
	return primary
}

func chatJSON(system, question string, maxTokens int) []byte {
	b, _ := json.Marshal(map[string]any{
		"model":      simModel,
		"messages":   []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": question}},
		"max_tokens": maxTokens, "ignore_eos": true,
	})
	return b
}

// postDirect sends body straight to a simulator.
func postDirect(addr string, body []byte) error {
	resp, err := http.Post("http://"+addr+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: status %d", addr, resp.StatusCode)
	}
	return nil
}

// waitScraped waits until every endpoint has a fresh scrape.
func waitScraped(t *testing.T, h *harness) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "metrics scraped", func() error {
		for _, e := range h.srv.Stats().Endpoints {
			if !e.Metrics.Fresh(time.Now()) {
				return fmt.Errorf("%s not scraped yet", e.Address)
			}
		}
		return nil
	})
}

// TestSchedulingAvoidsLoadedSim queues requests on one real simulator and
// checks the picker, reading its scraped queue, sends traffic to the other.
func TestSchedulingAvoidsLoadedSim(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	addrs := startSims(t, 2, "-max-num-seqs", "1")
	h := newScrapingHarness(t, simState(addrs, nil), fastScrape)
	busy, idle := addrs[0], addrs[1]
	var wg sync.WaitGroup
	for i := range 4 { // one runs, three wait (about 2 s of work at -time-scale 10)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = postDirect(busy, chatJSON("load", fmt.Sprint("q", i), 600))
		}()
	}
	t.Cleanup(wg.Wait)
	testutil.Eventually(t, 5*time.Second, "picker sees the busy simulator's queue", func() error {
		for _, e := range h.srv.Stats().Endpoints {
			if e.Address == busy && e.Metrics.Fresh(time.Now()) && e.Metrics.Waiting >= 2 {
				return nil
			}
		}
		return fmt.Errorf("no queue seen yet")
	})
	// Prompts share no prefix, so only load decides.
	for i := range 20 {
		if got := pickOnce(t, h, chatJSON(fmt.Sprint(i, " again"), "there", 4)); got != idle {
			for _, e := range h.srv.Stats().Endpoints {
				t.Logf("%s: %+v", e.Address, e.Metrics)
			}
			t.Fatalf("request %d went to the loaded simulator %s", i, got)
		}
	}
}

// TestSchedulingPrefersPrefixHolder sends a long shared system prompt to
// whichever simulator the picker chooses, then checks every later request
// sharing that prefix follows it, while both simulators are idle.
func TestSchedulingPrefersPrefixHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	addrs := startSims(t, 2)
	h := newScrapingHarness(t, simState(addrs, nil), fastScrape)
	system := strings.Repeat("you are a careful assistant who answers briefly ", 60) // ~2.9 KB
	waitScraped(t, h)
	first := chatJSON(system, "first question", 2)
	holder := pickOnce(t, h, first)
	if err := postDirect(holder, first); err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		if got := pickOnce(t, h, chatJSON(system, fmt.Sprint("question number ", i), 2)); got != holder {
			t.Fatalf("request %d went to %s, not the prefix holder %s", i, got, holder)
		}
	}
	// A different prompt has no affinity: over many requests both serve.
	seen := map[string]bool{}
	for i := range 16 {
		seen[pickOnce(t, h, chatJSON(fmt.Sprint("other system ", i), "q", 2))] = true
	}
	if len(seen) != 2 {
		t.Errorf("unrelated prompts all went to %v", seen)
	}
}

// TestUnhealthySimFilteredAndReported stops one simulator: its endpoint
// must be reported unhealthy (for EDS), get no traffic, and come back when
// the simulator does.
func TestUnhealthySimFilteredAndReported(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	bin := testutil.Binary(t, "vllm-sim")
	addrs := startSims(t, 1)
	port := testutil.FreePort(t)
	flaky := "127.0.0.1:" + strconv.Itoa(port)
	args := []string{"-port", strconv.Itoa(port), "-model", simModel, "-time-scale", "10", "-log-level", "warn"}
	p := testutil.StartNoCleanup(t, "flaky-sim", bin, args...)
	testutil.WaitHTTP(t, "http://"+flaky+"/health", 10*time.Second)
	all := append([]string{flaky}, addrs...)
	slices.Sort(all)
	h := newScrapingHarness(t, simState(all, nil), fastScrape)
	eh := h.srv.EndpointHealth()

	changed := eh.Changed()
	p.Stop()
	testutil.Eventually(t, 5*time.Second, "stopped simulator reported unhealthy", func() error {
		if !eh.Unhealthy("alpha", flaky) {
			return fmt.Errorf("unhealthy endpoints %v", eh.UnhealthyEndpoints())
		}
		return nil
	})
	select {
	case <-changed:
	default:
		t.Error("Changed not closed on the transition")
	}
	if got := eh.UnhealthyEndpoints(); len(got) != 1 || got[0].Address != flaky || eh.Unhealthy("alpha", addrs[0]) {
		t.Errorf("unhealthy %v", got)
	}
	for i := range 10 {
		if got := pickOnce(t, h, chatJSON("s", fmt.Sprint(i), 2)); got != addrs[0] {
			t.Fatalf("request %d routed to the dead simulator", i)
		}
	}
	// A stale endpoint counts as saturated, but the live one is idle, so
	// sheddable requests still pass.
	if got := pickOnce(t, h, []byte(`{"model":"bulk","messages":[{"role":"user","content":"x"}]}`)); got != addrs[0] {
		t.Errorf("sheddable request went to %s", got)
	}

	testutil.Start(t, "flaky-sim-again", bin, args...)
	testutil.Eventually(t, 10*time.Second, "restarted simulator healthy again", func() error {
		if eh.Unhealthy("alpha", flaky) {
			return fmt.Errorf("still unhealthy")
		}
		return nil
	})
	// A fresh prompt each time: a repeated one would stick to the live
	// simulator by prefix affinity, as it should.
	seen := map[string]bool{}
	n := 0
	testutil.Eventually(t, 5*time.Second, "recovered simulator gets traffic", func() error {
		n++
		seen[pickOnce(t, h, chatJSON(fmt.Sprint("recovery prompt ", n), "q", 2))] = true
		if !seen[flaky] {
			return fmt.Errorf("only %v", seen)
		}
		return nil
	})
}

// TestSheddableShedWhenSimsSaturated fills both simulators' queues past
// queue_threshold: with admission off, sheddable requests get 429 and
// others still route.
func TestSheddableShedWhenSimsSaturated(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	addrs := startSims(t, 2, "-max-num-seqs", "1")
	st := simState(addrs, &registry.Scheduling{QueueThreshold: 2})
	for _, p := range st.Pools {
		p.Admission = &registry.Admission{Disabled: true}
	}
	h := newScrapingHarness(t, st, fastScrape)
	var wg sync.WaitGroup
	for _, a := range addrs {
		for i := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = postDirect(a, chatJSON("load", fmt.Sprint("q", i), 300))
			}()
		}
	}
	t.Cleanup(wg.Wait)
	testutil.Eventually(t, 5*time.Second, "sheddable request shed", func() error {
		s := h.duplex()
		s.send(postHeaders("/v1/chat/completions"))
		s.send(reqBody([]byte(`{"model":"bulk","messages":[{"role":"user","content":"x"}]}`), true))
		r := s.recv()
		if r.GetImmediateResponse() == nil {
			return fmt.Errorf("not shed")
		}
		immediateOf(t, r, 429)
		return nil
	})
	if got := pickOnce(t, h, chatJSON("s", "q", 2)); !slices.Contains(addrs, got) {
		t.Errorf("priority 0 request routed to %q", got)
	}
}

// TestAdapterFollowsServedModels: no endpoint lists its models, yet
// requests for a LoRA adapter go only to the simulator that has it,
// because the picker reads every server's /v1/models; the base model
// still spreads over all of them.
func TestAdapterFollowsServedModels(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim")
	}
	plain := startSims(t, 2)
	lora := startSims(t, 1, "-lora-modules", "sql-lora", "-max-loras", "2")
	all := append(append([]string(nil), plain...), lora...)
	slices.Sort(all)
	st := simState(all, nil)
	st.Models["sql-lora"] = &registry.Model{Name: "sql-lora", Pool: "alpha"}
	h := newScrapingHarness(t, st, fastScrape)
	waitScraped(t, h)
	testutil.Eventually(t, 5*time.Second, "served models read", func() error {
		for _, e := range h.srv.Stats().Endpoints {
			if e.Metrics == nil || e.Metrics.ServedModels == nil {
				return fmt.Errorf("%s: served models unknown", e.Address)
			}
		}
		return nil
	})
	adapter := func(i int) []byte {
		b, _ := json.Marshal(map[string]any{"model": "sql-lora", "max_tokens": 2,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprint("select ", i)}}})
		return b
	}
	for i := range 12 {
		if got := pickOnce(t, h, adapter(i)); got != lora[0] {
			t.Fatalf("adapter request %d went to %s, which does not serve sql-lora (only %s does)", i, got, lora[0])
		}
	}
	seen := map[string]bool{}
	for i := range 40 {
		seen[pickOnce(t, h, chatJSON(fmt.Sprint("base prompt ", i), "q", 2))] = true
	}
	if len(seen) != 3 {
		t.Errorf("base-model requests went to %v, want all three servers", seen)
	}
}
