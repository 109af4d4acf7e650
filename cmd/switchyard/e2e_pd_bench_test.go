package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/testutil"
)

// pdBenchFleet is one fleet of four simulated servers behind Envoy and
// switchyard: whole servers (prefill 0), or prefill servers and decode
// servers behind pd-sidecars in a disaggregated pool.
type pdBenchFleet struct {
	name             string
	prefill, decode  int
	prefillThreshold int // the policy's prefill_queue_threshold (0: the default)
}

// pdBenchClass is one stream of requests of a workload: Poisson arrivals
// at rate of random prompts of input tokens asking for output tokens.
type pdBenchClass struct {
	name          string
	rate          float64
	input, output int
}

// start runs the fleet: its simulators in real time (Llama-3-8B on an
// H100, the NIXL transfer 2 ms + 3 us a token), sidecars, switchyard and
// Envoy; it returns Envoy's URL and the fleet.
func (fl pdBenchFleet) start(b *testing.B) (string, *fleet) {
	b.Helper()
	simArgs := []string{"-max-model-len", "16384", "-log-level", "warn"}
	if fl.prefill > 0 {
		simArgs = append(simArgs, "-kv-connector", "NixlConnector")
	}
	var body strings.Builder
	if fl.prefill == 0 {
		var eps []string
		for range fl.decode {
			eps = append(eps, startSim(b, simOptions{timeScale: 1, extra: simArgs}).Addr)
		}
		fmt.Fprintf(&body, "pool \"bench\" {\n  endpoints = [%s]\n}\n", quoteList(eps))
	} else {
		body.WriteString("pool \"bench\" {\n")
		var prefillers []string
		for range fl.prefill {
			a := startSim(b, simOptions{timeScale: 1, extra: simArgs}).Addr
			prefillers = append(prefillers, a)
			fmt.Fprintf(&body, "  endpoint %q { role = \"prefill\" }\n", a)
		}
		bin := testutil.Binary(b, "pd-sidecar")
		for range fl.decode {
			d := startSim(b, simOptions{timeScale: 1, extra: simArgs})
			sc := testutil.FreeAddr(b)
			testutil.Start(b, "pd-sidecar "+sc, bin, "-listen", sc, "-decoder", "http://"+d.Addr,
				"-prefillers", strings.Join(prefillers, ","), "-log-level", "warn")
			testutil.WaitHTTP(b, "http://"+sc+"/health", 10*time.Second)
			fmt.Fprintf(&body, "  endpoint %q { role = \"decode\" }\n", sc)
		}
		body.WriteString("  disaggregation {\n    min_prompt_tokens = 1024\n")
		if fl.prefillThreshold > 0 {
			fmt.Fprintf(&body, "    prefill_queue_threshold = %d\n", fl.prefillThreshold)
		}
		body.WriteString("  }\n}\n")
	}
	body.WriteString("model \"m-a\" {\n  pool = \"bench\"\n}\n")
	f := newFleet(b, body.String(), fleetOptions{envoyConcurrency: 2})
	return "http://" + f.listen, f
}

// BenchmarkE2EDisaggregation compares fleets of four simulated servers in
// real time, through Envoy and the picker, on workloads of long prompts
// (8,000 tokens) under load: four whole servers, and disaggregated pools
// (2 prefill + 2 decode, 1 + 3) whose P/D stage splits the long prompts
// (min_prompt_tokens 1024; "always" sets prefill_queue_threshold so high
// that every long prompt is split, as phase 1's stand-in router did).
// Each run is 5 s of warm-up, then 30 s measured. It reports each
// request class's TTFT and inter-token latency (ms) and, for
// disaggregated pools, the share of long prompts split (split-%):
//
//	go test -run '^$' -bench E2EDisaggregation -benchtime 1x -timeout 30m ./cmd/switchyard/
//
// Workloads: "long" (8k in, 64 out, 4/s: prefill-heavy), "long-out" (8k
// in, 512 out, 1.5/s: decode-heavy), "mixed" (chat of 256 in, 256 out at
// 12/s beside 8k-token documents, 64 out, at 1/s).
func BenchmarkE2EDisaggregation(b *testing.B) {
	whole := pdBenchFleet{name: "whole-4", decode: 4}
	pd22 := pdBenchFleet{name: "pd-2p2d", prefill: 2, decode: 2}
	pd22always := pdBenchFleet{name: "pd-2p2d-always", prefill: 2, decode: 2, prefillThreshold: 1 << 20}
	pd13 := pdBenchFleet{name: "pd-1p3d", prefill: 1, decode: 3}
	for _, wl := range []struct {
		name    string
		classes []pdBenchClass
		fleets  []pdBenchFleet
	}{
		{"long", []pdBenchClass{{"", 4, 8000, 64}}, []pdBenchFleet{whole, pd22, pd22always}},
		{"long-out", []pdBenchClass{{"", 1.5, 8000, 512}}, []pdBenchFleet{whole, pd22, pd13}},
		{"mixed", []pdBenchClass{{"chat-", 12, 256, 256}, {"doc-", 1, 8000, 64}}, []pdBenchFleet{whole, pd13, pd22}},
	} {
		for _, fl := range wl.fleets {
			b.Run(wl.name+"/"+fl.name, func(b *testing.B) {
				url, f := fl.start(b)
				for b.Loop() {
					reps := pdBenchRun(b, url, wl.classes)
					for i, c := range wl.classes {
						s := reps[i]
						b.ReportMetric(s.TTFT.P50Ms, c.name+"ttft-p50-ms")
						b.ReportMetric(s.TTFT.P90Ms, c.name+"ttft-p90-ms")
						b.ReportMetric(s.ITL.P50Ms, c.name+"itl-p50-ms")
						b.ReportMetric(s.ITL.P99Ms, c.name+"itl-p99-ms")
						b.ReportMetric(s.ITL.P999Ms, c.name+"itl-p99.9-ms")
						b.ReportMetric(s.E2E.P50Ms, c.name+"e2e-p50-ms")
					}
					if fl.prefill > 0 {
						fams := scrapeMetrics(b, f.admin)
						var split, long float64
						for _, d := range []string{"split", "below-threshold", "no-prefill-server", "prefill-saturated"} {
							v, _ := metricValue(fams, "switchyard_pd_decisions_total", map[string]string{"pool": "bench", "decision": d})
							if d == "split" {
								split = v
							}
							long += v
						}
						if long > 0 {
							b.ReportMetric(100*split/long, "split-%")
						}
					}
				}
			})
		}
	}
}

// pdBenchRun sends each class's load to url at once, 5 s of warm-up then
// 30 s measured, and returns each class's measured stage.
func pdBenchRun(b *testing.B, url string, classes []pdBenchClass) []load.StageReport {
	b.Helper()
	out := make([]load.StageReport, len(classes))
	errs := make([]error, len(classes))
	var wg sync.WaitGroup
	for i, c := range classes {
		wg.Go(func() {
			rep, err := load.Run(context.Background(), load.Config{
				URL: url, API: load.APICompletions, Model: "m-a",
				Workload: load.Workload{Kind: load.WorkloadRandom, Input: load.Fixed(c.input), Output: load.Fixed(c.output)},
				Arrival:  load.ArrivalPoisson, Seed: uint64(i + 1), Timeout: 5 * time.Minute,
				Stages: []load.Stage{{Rate: c.rate, Duration: 5 * time.Second}, {Rate: c.rate, Duration: 30 * time.Second}},
			})
			switch {
			case err != nil:
				errs[i] = err
			case rep.Total.Failed > 0 || len(rep.Stages) < 2 || rep.Stages[1].Completed == 0:
				errs[i] = fmt.Errorf("class %q: %d failed: %v", c.name, rep.Total.Failed, rep.Total.ErrorExamples)
			default:
				out[i] = rep.Stages[1]
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	return out
}
