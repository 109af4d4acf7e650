package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
)

// TestE2EDisaggregatedPool serves a disaggregated pool through the
// switchyard binary and a real Envoy: two prefill simulators, two decode
// simulators behind pd-sidecar processes, all in vLLM's NixlConnector
// mode. The picker's P/D stage splits long prompts: streamed and not,
// chat and completions, with the prompt counted once in the usage; keeps
// short prompts whole; never honours a client's prefill header; signs
// the prefill server for the sidecar that requires it; shows its
// decisions in the metrics and decision records; and loses no request
// when a prefill server is killed, nor when both are.
func TestE2EDisaggregatedPool(t *testing.T) {
	t.Parallel()
	kv := []string{"-kv-connector", "NixlConnector"}
	p1, p2 := startSim(t, simOptions{extra: kv}), startSim(t, simOptions{extra: kv})
	d1, d2 := startSim(t, simOptions{extra: kv}), startSim(t, simOptions{extra: kv})
	sc1, sc2 := testutil.FreeAddr(t), testutil.FreeAddr(t)
	pool := fmt.Sprintf(`
pool "big" {
  endpoint %q { role = "prefill" }
  endpoint %q { role = "prefill" }
  endpoint %q { role = "decode" }
  endpoint %q { role = "decode" }
  disaggregation {
    uncached_tokens   = 64
    min_prompt_tokens = 128
  }
}
model "m-a" {
  pool = "big"
}
`, p1.Addr, p2.Addr, sc1, sc2)
	// The sidecars trust the pool's prefill servers from the same
	// configuration; the second also requires switchyard's signature,
	// which switchyard makes with the same key.
	cfgDir := t.TempDir()
	testutil.WriteFile(t, cfgDir, "pd.hcl", pool)
	const key = "a-shared-key-of-enough-bytes"
	keyFile := testutil.WriteFile(t, t.TempDir(), "pd.key", key+"\n")
	bin := testutil.Binary(t, "pd-sidecar")
	testutil.Start(t, "pd-sidecar "+sc1, bin, "-listen", sc1, "-decoder", "http://"+d1.Addr, "-config", cfgDir, "-pool", "big")
	testutil.Start(t, "pd-sidecar "+sc2, bin, "-listen", sc2, "-decoder", "http://"+d2.Addr, "-config", cfgDir, "-pool", "big",
		"-signing-key-file", keyFile)
	for _, a := range []string{sc1, sc2} {
		testutil.WaitHTTP(t, "http://"+a+"/health", 10*time.Second)
	}
	f := newFleet(t, pool, fleetOptions{switchyardArgs: []string{"-pd-signing-key-file", keyFile}})

	decoders := map[string]bool{d1.Addr: true, d2.Addr: true}
	// prefills is how many requests the prefill servers finished.
	prefills := func(t *testing.T, sims ...*sim) int {
		t.Helper()
		n := 0
		for _, s := range sims {
			m, err := s.requests()
			if err != nil {
				t.Fatal(err)
			}
			n += m
		}
		return n
	}
	long := func(tag string) string { return tag + " " + strings.Repeat("word ", 200) }

	t.Run("long prompts are split", func(t *testing.T) {
		before := prefills(t, p1, p2)
		seen := map[string]int{}
		for i, chat := range []bool{false, true} {
			for j, stream := range []bool{false, true} {
				r := infReq{chat: chat, stream: stream, model: "m-a", prompt: long(fmt.Sprintf("split-%d-%d", i, j)), maxTokens: 5}
				resp, err := f.send(r)
				checkOK(t, resp, err, "m-a")
				what := fmt.Sprintf("chat=%v stream=%v", chat, stream)
				if got := resp.header.Get(pd.ResultHeader); got != "split" {
					t.Errorf("%s: the sidecar says %q, want split", what, got)
				}
				if !decoders[resp.servedBy] || resp.completion != 5 || (stream && (!resp.done || resp.tokens != 5)) {
					t.Errorf("%s: served by %q, %d completion tokens, %d token events, done %v", what, resp.servedBy, resp.completion, resp.tokens, resp.done)
				}
				seen[resp.servedBy]++
				// The usage counts the prompt once: as the decode server
				// counts it when it prefills the same request itself.
				whole, err := sendTo(f.client, "http://"+resp.servedBy, r, nil)
				checkOK(t, whole, err, "m-a")
				if resp.prompt == 0 || resp.prompt != whole.prompt {
					t.Errorf("%s: %d prompt tokens split, %d whole", what, resp.prompt, whole.prompt)
				}
			}
		}
		if got := prefills(t, p1, p2) - before; got != 4 {
			t.Errorf("the prefill servers ran %d prefills for 4 split requests", got)
		}
		t.Logf("served by %v", seen)
	})

	t.Run("short prompts are not split", func(t *testing.T) {
		before := prefills(t, p1, p2)
		for _, stream := range []bool{false, true} {
			resp, err := f.send(infReq{stream: stream, model: "m-a", prompt: "a short question", maxTokens: 3})
			checkOK(t, resp, err, "m-a")
			if got := resp.header.Get(pd.ResultHeader); got != "local" || !decoders[resp.servedBy] {
				t.Errorf("stream=%v: the sidecar says %q, served by %q; want local on a decode server", stream, got, resp.servedBy)
			}
		}
		if got := prefills(t, p1, p2) - before; got != 0 {
			t.Errorf("%d prefills for short prompts", got)
		}
	})

	t.Run("a client's prefill header is never honoured", func(t *testing.T) {
		var evilHits atomic.Int32
		evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { evilHits.Add(1) }))
		defer evil.Close()
		evilAddr := strings.TrimPrefix(evil.URL, "http://")
		signer, err := pd.NewSigner([]byte(key))
		if err != nil {
			t.Fatal(err)
		}
		before := prefills(t, p1, p2)
		for i, h := range []map[string]string{
			{pd.PrefillerHeader: evilAddr},
			{pd.PrefillerHeader: evilAddr + "," + evilAddr, pd.SignatureHeader: signer.Sign(evilAddr)},
			// A prefill server of the pool, signed with the real key: the
			// picker removes the header, and a short prompt is not split.
			{pd.PrefillerHeader: p1.Addr, pd.SignatureHeader: signer.Sign(p1.Addr)},
		} {
			for j := range 6 {
				resp, err := f.send(infReq{stream: j%2 == 0, model: "m-a", prompt: fmt.Sprintf("evil %d %d", i, j), maxTokens: 2, headers: h})
				checkOK(t, resp, err, "m-a")
				if got := resp.header.Get(pd.ResultHeader); got != "local" {
					t.Errorf("header set %d, request %d: the sidecar says %q, want local", i, j, got)
				}
			}
		}
		// A long prompt with a client's header is split where the picker
		// chose.
		resp, err := f.send(infReq{model: "m-a", prompt: long("evil-long"), maxTokens: 2, headers: map[string]string{pd.PrefillerHeader: evilAddr}})
		checkOK(t, resp, err, "m-a")
		if got := resp.header.Get(pd.ResultHeader); got != "split" {
			t.Errorf("long prompt with a client's header: the sidecar says %q, want split", got)
		}
		if n := evilHits.Load(); n != 0 {
			t.Errorf("a server outside the pool was contacted %d times", n)
		}
		if got := prefills(t, p1, p2) - before; got != 1 {
			t.Errorf("%d prefills, want 1 (the long prompt's)", got)
		}
	})

	t.Run("decisions are counted and recorded", func(t *testing.T) {
		fams := scrapeMetrics(t, f.admin)
		for d, atLeast := range map[string]float64{"split": 5, "short-prompt": 20, "no-prefill-server": 0} {
			v, ok := metricValue(fams, "switchyard_pd_decisions_total", map[string]string{"pool": "big", "decision": d})
			if !ok || v < atLeast {
				t.Errorf("switchyard_pd_decisions_total{decision=%q} = %v (present %v), want at least %v", d, v, ok, atLeast)
			}
		}
		body, err := httpGetString("http://" + f.admin + "/api/decisions?model=m-a&limit=1000")
		if err != nil {
			t.Fatal(err)
		}
		var dec struct {
			Records []struct {
				Picked string `json:"picked"`
				PD     *struct {
					Decision string `json:"decision"`
					Prefill  string `json:"prefill"`
					Uncached int    `json:"uncached_tokens"`
					Result   string `json:"result"`
				} `json:"pd"`
			} `json:"records"`
		}
		if err := json.Unmarshal([]byte(body), &dec); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		splits := 0
		for _, r := range dec.Records {
			if r.PD == nil {
				t.Errorf("record without its P/D decision: %+v", r)
				continue
			}
			if r.PD.Decision == "split" {
				splits++
				if (r.PD.Prefill != p1.Addr && r.PD.Prefill != p2.Addr) || r.PD.Result != "split" || r.PD.Uncached < 64 {
					t.Errorf("split record %+v", *r.PD)
				}
			}
		}
		if splits < 5 {
			t.Errorf("%d split records, want 5", splits)
		}
	})

	t.Run("killed prefill servers lose no request", func(t *testing.T) {
		var (
			mu      sync.Mutex
			results = map[string]int{}
			failed  []string
			sent    atomic.Int32
		)
		send := func(i int) {
			resp, err := f.send(infReq{chat: i%3 == 0, stream: i%2 == 0, model: "m-a", prompt: long(fmt.Sprintf("kill-%d", i)), maxTokens: 4})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				failed = append(failed, fmt.Sprintf("request %d: %v", i, err))
			case resp.status != http.StatusOK || resp.completion != 4:
				failed = append(failed, fmt.Sprintf("request %d: status %d, %d completion tokens: %s", i, resp.status, resp.completion, truncate(string(resp.body), 200)))
			default:
				results[resp.header.Get(pd.ResultHeader)]++
			}
		}
		// Load from four clients while the first prefill server is killed,
		// then the second.
		load := func(n int) {
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for range n {
						send(int(sent.Add(1)))
					}
				})
			}
			wg.Wait()
		}
		stop := make(chan struct{})
		var bg sync.WaitGroup
		bg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					send(int(sent.Add(1)))
				}
			}
		})
		load(5)
		p1.proc.Kill()
		load(10)
		// With p1 gone the picker splits onto p2 alone.
		before := prefills(t, p2)
		testutil.Eventually(t, settle, "a split onto the remaining prefill server", func() error {
			load(1)
			if prefills(t, p2) == before {
				return fmt.Errorf("no prefill on %s yet", p2.Addr)
			}
			return nil
		})
		p2.proc.Kill()
		load(10)
		// No prefill server left: once its scrapes say so, the picker
		// sends requests whole (until then the sidecars fall back).
		testutil.Eventually(t, settle, "whole requests once no prefill server is up", func() error {
			resp, err := f.send(infReq{model: "m-a", prompt: long(fmt.Sprintf("after-%d", sent.Add(1))), maxTokens: 4})
			if err != nil || resp.status != http.StatusOK {
				return fmt.Errorf("%v %v", resp, err)
			}
			if got := resp.header.Get(pd.ResultHeader); got != "local" {
				return fmt.Errorf("the sidecar says %q", got)
			}
			return nil
		})
		close(stop)
		bg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, e := range failed {
			t.Error(e)
		}
		t.Logf("%d requests: sidecar results %v", sent.Load(), results)
		fams := scrapeMetrics(t, f.admin)
		if v, _ := metricValue(fams, "switchyard_pd_decisions_total", map[string]string{"pool": "big", "decision": "no-prefill-server"}); v == 0 {
			t.Error("no request was decided whole for want of a prefill server")
		}
	})
}
