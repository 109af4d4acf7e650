package sidecar

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/pd"
	pdpick "github.com/switchyard/switchyard/picker/pd"
	"github.com/switchyard/switchyard/registry"
)

// benchRouter stands in for Envoy and the picker's P/D stage in
// BenchmarkDisaggregation: it sends each request to the decode endpoint
// with the fewest requests in flight (the profile's queue scorer, here
// from its own counts) and, with prefill servers, asks picker/pd.Decide
// whether and where to prefill, tracking each prefill server's pending
// prefill tokens until the response's first byte.
type benchRouter struct {
	decoders  []string
	prefill   []string
	policy    pdpick.Policy
	transport http.RoundTripper

	mu       sync.Mutex
	inFlight map[string]int
	pending  map[string]int
	splits   int
}

func (rt *benchRouter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Prompt string `json:"prompt"`
	}
	_ = json.Unmarshal(body, &req)
	tokens := len(strings.Fields(req.Prompt)) // loadgen's words are one token each

	rt.mu.Lock()
	dec := rt.decoders[0]
	for _, d := range rt.decoders[1:] {
		if rt.inFlight[d] < rt.inFlight[dec] {
			dec = d
		}
	}
	rt.inFlight[dec]++
	prefill := ""
	if len(rt.prefill) > 0 {
		cands := make([]pdpick.Candidate, len(rt.prefill))
		for i, p := range rt.prefill {
			cands[i] = pdpick.Candidate{Address: p, Role: registry.RolePrefill, Ready: true, PendingPrefillTokens: rt.pending[p]}
		}
		d := pdpick.Decide(tokens, pdpick.Candidate{Address: dec, Role: registry.RoleDecode, Ready: true}, cands, rt.policy)
		if d.Split {
			prefill = d.Prefill
			rt.pending[prefill] += tokens
			rt.splits++
		}
	}
	rt.mu.Unlock()
	released := false
	release := func() {
		rt.mu.Lock()
		if !released && prefill != "" {
			rt.pending[prefill] -= tokens
		}
		released = true
		rt.mu.Unlock()
	}
	defer func() {
		release()
		rt.mu.Lock()
		rt.inFlight[dec]--
		rt.mu.Unlock()
	}()

	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(&url.URL{Scheme: "http", Host: dec})
			if prefill != "" {
				pr.Out.Header.Set(pd.PrefillerHeader, prefill)
			}
		},
		Transport:     rt.transport,
		FlushInterval: -1,
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	proxy.ServeHTTP(&firstWrite{ResponseWriter: w, first: release}, r)
}

// firstWrite calls first when the first body bytes go out: the first token.
type firstWrite struct {
	http.ResponseWriter
	first func()
}

func (f *firstWrite) Write(b []byte) (int, error) {
	f.first()
	return f.ResponseWriter.Write(b)
}

func (f *firstWrite) Flush() {
	if fl, ok := f.ResponseWriter.(http.Flusher); ok {
		fl.Flush()
	}
}

// BenchmarkDisaggregation runs one workload of long prompts (8,000
// tokens, 64 output tokens, Poisson arrivals) against four simulated
// servers at real time, twice: "whole", each server doing whole requests;
// "pd", two prefill servers and two decode servers behind their sidecars,
// with the default NIXL transfer model. It reports TTFT and inter-token
// latency (ms) of each:
//
//	go test -run '^$' -bench Disaggregation -benchtime 1x ./internal/pd/sidecar/
func BenchmarkDisaggregation(b *testing.B) {
	const (
		rate     = 4.0 // requests per second over the four servers
		duration = 30 * time.Second
		prompt   = 8000
		output   = 64
	)
	simArgs := []string{"-time-scale", "1", "-max-model-len", "16384", "-kv-connector", "NixlConnector"}
	run := func(b *testing.B, rt *benchRouter) *load.Report {
		srv := httptest.NewServer(rt)
		defer srv.Close()
		rep, err := load.Run(context.Background(), load.Config{
			URL: srv.URL, API: load.APICompletions, Model: "meta-llama/Meta-Llama-3-8B-Instruct",
			Workload: load.Workload{Kind: load.WorkloadRandom, Input: load.Fixed(prompt), Output: load.Fixed(output)},
			Arrival:  load.ArrivalPoisson, Stages: []load.Stage{{Rate: rate, Duration: duration}}, Seed: 1,
			Timeout: 2 * time.Minute,
		})
		if err != nil {
			b.Fatal(err)
		}
		if rep.Total.Failed > 0 || rep.Total.Completed == 0 {
			b.Fatalf("%d completed, %d failed: %v", rep.Total.Completed, rep.Total.Failed, rep.Total.ErrorExamples)
		}
		return rep
	}
	report := func(b *testing.B, rep *load.Report) {
		t := rep.Total
		b.ReportMetric(t.TTFT.P50Ms, "ttft-p50-ms")
		b.ReportMetric(t.TTFT.P90Ms, "ttft-p90-ms")
		b.ReportMetric(t.ITL.P50Ms, "itl-p50-ms")
		b.ReportMetric(t.ITL.P99Ms, "itl-p99-ms")
		b.ReportMetric(t.E2E.P50Ms, "e2e-p50-ms")
		b.ReportMetric(float64(t.Completed), "requests")
	}
	transport := &http.Transport{MaxIdleConnsPerHost: 256}
	defer transport.CloseIdleConnections()

	b.Run("whole", func(b *testing.B) {
		var servers []string
		for range 4 {
			servers = append(servers, startSim(b, simArgs...).addr)
		}
		for b.Loop() {
			report(b, run(b, &benchRouter{decoders: servers, transport: transport, inFlight: map[string]int{}, pending: map[string]int{}}))
		}
	})
	b.Run("pd", func(b *testing.B) {
		p1, p2 := startSim(b, simArgs...), startSim(b, simArgs...)
		allowed := map[string]bool{p1.addr: true, p2.addr: true}
		var sidecars []string
		for range 2 {
			d := startSim(b, simArgs...)
			h, err := New(Config{Decoder: &url.URL{Scheme: "http", Host: d.addr}, Allowed: func(hp string) bool { return allowed[hp] }})
			if err != nil {
				b.Fatal(err)
			}
			s := httptest.NewServer(h)
			b.Cleanup(s.Close)
			sidecars = append(sidecars, strings.TrimPrefix(s.URL, "http://"))
		}
		pol := pdpick.PolicyFrom(&registry.Disaggregation{}, 1<<30, 0)
		for b.Loop() {
			rt := &benchRouter{decoders: sidecars, prefill: []string{p1.addr, p2.addr}, policy: pol, transport: transport,
				inFlight: map[string]int{}, pending: map[string]int{}}
			rep := run(b, rt)
			if rt.splits != int(rep.Total.Sent) {
				b.Errorf("%d of %d requests split", rt.splits, rep.Total.Sent)
			}
			report(b, rep)
		}
	})
}
