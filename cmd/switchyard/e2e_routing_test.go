package main

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestE2ERouting sends requests through a real Envoy configured by the
// switchyard binary to real simulators, and checks that every request
// lands on the endpoint the picker chose (acceptance 1) and that client
// headers cannot choose an upstream (acceptance 3).
func TestE2ERouting(t *testing.T) {
	t.Parallel()
	big := []string{"-max-model-len", "300000"}
	s1, s2, s3 := startSim(t, simOptions{extra: big}), startSim(t, simOptions{extra: big}), startSim(t, simOptions{extra: big})
	side := startSim(t, simOptions{})    // in pool "side" only
	outside := startSim(t, simOptions{}) // in no pool at all
	f := newFleet(t, fmt.Sprintf(`
pool "main" {
  endpoints = [%q, %q, %q]
}
pool "side" {
  endpoints = [%q]
}
model "m-a" {
  pool = "main"
}
model "m-chat" {
  pool = "main"
  target "m-chat-v2" {
    weight = 1
  }
}
model "m-b" {
  pool = "side"
}
`, s1.Addr, s2.Addr, s3.Addr, side.Addr), fleetOptions{})
	mainPool := map[string]bool{s1.Addr: true, s2.Addr: true, s3.Addr: true}

	// observe sends reqs and checks the x-served-by tally against the
	// picker's picked and served deltas for every endpoint.
	observe := func(t *testing.T, reqs []infReq, wantModel string) *status {
		t.Helper()
		before := f.mustStatus()
		tally := map[string]int64{}
		for _, r := range reqs {
			resp, err := f.send(r)
			checkOK(t, resp, err, wantModel)
			if !mainPool[resp.servedBy] {
				t.Fatalf("served by %q, not a member of pool main", resp.servedBy)
			}
			if r.stream && (!resp.done || resp.completion != r.maxTokens || resp.tokens < r.maxTokens) {
				t.Fatalf("stream incomplete: done=%v completion=%d token events=%d, want %d", resp.done, resp.completion, resp.tokens, r.maxTokens)
			}
			tally["main/"+resp.servedBy]++
		}
		var after *status
		testutil.Eventually(t, 5*time.Second, "picker counters match x-served-by", func() error {
			s, err := f.status()
			if err != nil {
				return err
			}
			b, a := before.counts(), s.counts()
			for key, c := range a {
				picked, served := c[0]-b[key][0], c[1]-b[key][1]
				if picked != tally[key] || served != tally[key] {
					return fmt.Errorf("%s: picked +%d, served +%d, x-served-by %d (tally %v)", key, picked, served, tally[key], tally)
				}
			}
			after = s
			return nil
		})
		t.Logf("x-served-by distribution %v", tally)
		return after
	}

	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			name := fmt.Sprintf("chat=%v/stream=%v", chat, stream)
			t.Run(name, func(t *testing.T) {
				var reqs []infReq
				for i := range 9 {
					reqs = append(reqs, infReq{chat: chat, stream: stream, model: "m-a", maxTokens: 4,
						prompt: fmt.Sprintf("request %d of %s", i, name)})
				}
				observe(t, reqs, "m-a")
			})
		}
	}

	t.Run("1MiB prompt", func(t *testing.T) {
		prompt := strings.Repeat("abcd ", (1<<20)/5)
		observe(t, []infReq{
			{model: "m-a", prompt: prompt, maxTokens: 2},
			{chat: true, stream: true, model: "m-a", prompt: prompt, maxTokens: 2},
		}, "m-a")
	})

	t.Run("model rewrite", func(t *testing.T) {
		before := f.mustStatus()
		var reqs []infReq
		for i := range 3 {
			reqs = append(reqs, infReq{chat: true, model: "m-chat", maxTokens: 3, prompt: fmt.Sprint("json ", i)},
				infReq{chat: true, stream: true, model: "m-chat", maxTokens: 3, prompt: fmt.Sprint("sse ", i)},
				infReq{stream: true, model: "m-chat", maxTokens: 3, prompt: fmt.Sprint("sse completions ", i)})
		}
		// The sims do not serve "m-chat": a 200 proves the request was
		// rewritten; observe checks every JSON body and SSE chunk says
		// "m-chat" again.
		after := observe(t, reqs, "m-chat")
		if d := after.Picker.Rewritten - before.Picker.Rewritten; d != int64(len(reqs)) {
			t.Fatalf("picker rewrote %d requests, want %d", d, len(reqs))
		}
		if after.Picker.ResponseBodies == before.Picker.ResponseBodies {
			t.Fatal("the picker saw no response body of the rewritten requests")
		}
	})

	t.Run("client headers cannot choose the upstream", func(t *testing.T) {
		sideBefore, err := side.requests()
		if err != nil {
			t.Fatal(err)
		}
		spoofs := []map[string]string{
			{"x-gateway-destination-endpoint": outside.Addr},
			{"x-gateway-destination-endpoint": side.Addr},
			{"x-gateway-destination-endpoint": "10.255.255.1:80"},
			{"x-gateway-destination-endpoint": outside.Addr + "," + side.Addr},
			{"x-switchyard-pool": "side"},
			{"x-switchyard-pool": "side", "x-gateway-destination-endpoint": side.Addr},
			{"x-gateway-destination-endpoint-subset": outside.Addr},
			{"x-gateway-destination-endpoint-subset": side.Addr, "x-gateway-destination-endpoint-served": side.Addr},
		}
		var reqs []infReq
		for _, h := range spoofs {
			for _, stream := range []bool{false, true} {
				reqs = append(reqs, infReq{stream: stream, model: "m-a", maxTokens: 2, prompt: "spoof", headers: h})
			}
		}
		// Served by pool main, as picked: observe fails on any other host.
		observe(t, reqs, "m-a")

		// Unknown model: 404 from the picker, whatever the headers say.
		for _, h := range spoofs {
			resp, err := f.send(infReq{model: "no-such-model", prompt: "x", maxTokens: 1, headers: h})
			if err != nil {
				t.Fatal(err)
			}
			if resp.status != http.StatusNotFound || resp.servedBy != "" {
				t.Fatalf("headers %v, unknown model: status %d served by %q, want 404 from the picker", h, resp.status, resp.servedBy)
			}
		}
		// A body-less request goes to the header-only pool (no default
		// pool: the first by name, "main"), whatever the client asks for.
		req, _ := http.NewRequest(http.MethodGet, "http://"+f.listen+"/health", nil)
		req.Header.Set("x-switchyard-pool", "side")
		req.Header.Set("x-gateway-destination-endpoint", side.Addr)
		resp, err := f.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !mainPool[resp.Header.Get("x-served-by")] {
			t.Fatalf("GET /health with spoofed headers: %d served by %q, want 200 from pool main", resp.StatusCode, resp.Header.Get("x-served-by"))
		}

		if n, err := outside.requests(); err != nil || n != 0 {
			t.Fatalf("the sim outside every pool served %d requests (err %v), want 0", n, err)
		}
		if n, err := side.requests(); err != nil || n != sideBefore {
			t.Fatalf("pool side's sim served %d requests, want %d (err %v)", n, sideBefore, err)
		}
		// The side pool itself works, so the zero above is meaningful.
		r, err := f.send(infReq{model: "m-b", prompt: "side", maxTokens: 1})
		checkOK(t, r, err, "m-b")
		if r.servedBy != side.Addr {
			t.Fatalf("m-b served by %q, want %s", r.servedBy, side.Addr)
		}
	})
}
