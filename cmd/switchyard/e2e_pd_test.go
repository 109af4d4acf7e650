package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
)

// TestE2EDisaggregatedPool serves a pool with roles through the switchyard
// binary and a real Envoy: two prefill simulators, two decode simulators
// behind pd-sidecar processes, all in vLLM's NixlConnector mode. It checks
// that the pool serves (streamed and not, chat and completions, usage
// counted once), that the sidecar's two steps work behind Envoy (a request
// naming a pool prefill server is split, or, once the picker strips client
// copies of the header, served whole), and that no client header makes
// anything contact a server outside the pool; with a signing key on a
// sidecar, a client's header never splits there.
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
    uncached_tokens = 64
  }
}
model "m-a" {
  pool = "big"
}
`, p1.Addr, p2.Addr, sc1, sc2)
	// The sidecars trust the pool's prefill servers from the same
	// configuration; the second also requires switchyard's signature.
	cfgDir := t.TempDir()
	testutil.WriteFile(t, cfgDir, "pd.hcl", pool)
	keyFile := testutil.WriteFile(t, t.TempDir(), "pd.key", "a-shared-key-of-enough-bytes\n")
	bin := testutil.Binary(t, "pd-sidecar")
	testutil.Start(t, "pd-sidecar "+sc1, bin, "-listen", sc1, "-decoder", "http://"+d1.Addr, "-config", cfgDir, "-pool", "big")
	testutil.Start(t, "pd-sidecar "+sc2, bin, "-listen", sc2, "-decoder", "http://"+d2.Addr, "-config", cfgDir, "-pool", "big",
		"-signing-key-file", keyFile)
	for _, a := range []string{sc1, sc2} {
		testutil.WaitHTTP(t, "http://"+a+"/health", 10*time.Second)
	}
	f := newFleet(t, pool, fleetOptions{})

	var evilHits atomic.Int32
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { evilHits.Add(1) }))
	defer evil.Close()
	evilAddr := strings.TrimPrefix(evil.URL, "http://")
	prompt := strings.Repeat("word ", 200)
	members := map[string]bool{p1.Addr: true, p2.Addr: true, d1.Addr: true, d2.Addr: true}

	t.Run("serves", func(t *testing.T) {
		for _, chat := range []bool{false, true} {
			for _, stream := range []bool{false, true} {
				resp, err := f.send(infReq{chat: chat, stream: stream, model: "m-a", prompt: prompt, maxTokens: 5})
				checkOK(t, resp, err, "m-a")
				if !members[resp.servedBy] || resp.completion != 5 || (stream && !resp.done) {
					t.Errorf("chat=%v stream=%v: served by %q, %d completion tokens, done %v", chat, stream, resp.servedBy, resp.completion, resp.done)
				}
			}
		}
	})

	// A request naming a prefill server of the pool, sent until both
	// sidecars have had some: the picker spreads them over the pool.
	t.Run("sidecars behind Envoy", func(t *testing.T) {
		signer, err := pd.NewSigner([]byte("a-shared-key-of-enough-bytes"))
		if err != nil {
			t.Fatal(err)
		}
		seen, results := map[string]int{}, map[string]int{}
		for i := 0; i < 64 && (seen[d1.Addr] < 2 || seen[d2.Addr] < 2); i++ {
			h := map[string]string{pd.PrefillerHeader: p1.Addr}
			if i%2 == 1 {
				// A valid signature made outside switchyard: the picker
				// drops every x-switchyard-* request header.
				h[pd.SignatureHeader] = signer.Sign(p1.Addr)
			}
			stream := i%4 < 2
			resp, err := f.send(infReq{stream: stream, model: "m-a", prompt: fmt.Sprintf("%d %s", i, prompt), maxTokens: 6, headers: h})
			checkOK(t, resp, err, "m-a")
			if resp.completion != 6 || (stream && !resp.done) {
				t.Errorf("request %d: %d completion tokens, done %v", i, resp.completion, resp.done)
			}
			seen[resp.servedBy]++
			got := resp.header.Get(pd.ResultHeader)
			results[got]++
			switch resp.servedBy {
			case d1.Addr:
				// Until the picker strips client copies of the header
				// (docs/routing.md), this sidecar follows it to the pool's
				// prefill server; afterwards it serves it whole.
				if got != "split" && got != "local" {
					t.Errorf("request %d on the unsigned sidecar: result %q", i, got)
				}
			case d2.Addr:
				if got != "local" {
					t.Errorf("request %d on the signed sidecar: result %q, want local", i, got)
				}
			case p1.Addr, p2.Addr:
				if got != "" {
					t.Errorf("request %d on prefill server %s: result %q", i, resp.servedBy, got)
				}
			default:
				t.Errorf("request %d served by %q, outside the pool", i, resp.servedBy)
			}
		}
		t.Logf("served by %v; sidecar results %v", seen, results)
		if seen[d1.Addr] == 0 || seen[d2.Addr] == 0 {
			t.Errorf("the picker never chose one of the sidecars: %v", seen)
		}
	})

	t.Run("client headers reach no other server", func(t *testing.T) {
		for _, h := range []map[string]string{
			{pd.PrefillerHeader: evilAddr},
			{pd.PrefillerHeader: evilAddr + "," + evilAddr},
			{pd.PrefillerHeader: evilAddr, "x-gateway-destination-endpoint": sc1},
		} {
			for i := range 8 {
				resp, err := f.send(infReq{stream: i%2 == 0, model: "m-a", prompt: fmt.Sprintf("evil %d %s", i, prompt), maxTokens: 2, headers: h})
				checkOK(t, resp, err, "m-a")
			}
		}
		if n := evilHits.Load(); n != 0 {
			t.Errorf("a server outside the pool was contacted %d times", n)
		}
	})

}
