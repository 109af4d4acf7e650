package main

import (
	"bufio"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
)

// BenchmarkStepTime measures how an engine's step time grows with its
// batch, on real vLLM (the CPU build, the tiny model) and on the
// simulator with the same cache: the engine's own inter-token latency
// (vllm:inter_token_latency_seconds) with 1, 2, 4 and 8 requests decoding
// side by side, and its prefill time per uncached prompt token (from the
// latencies of 1,024- and 32-token prompts with one output token) alone
// and with 7 requests decoding. It reports each as a metric, and the ratios
// that matter to routing: itl8/itl1 (the batch slowdown) and
// prefill-busy/prefill-alone.
//
//	go test -run '^$' -bench StepTime -benchtime 1x ./cmd/vllm-sim/
//
// Timings of CPU vLLM on shared cores move with the machine's load; run it
// on a quiet machine.
func BenchmarkStepTime(b *testing.B) {
	b.Run("real-vllm", func(b *testing.B) {
		py := realvllm.Require(b)
		m := realvllm.EnsureModel(b, py)
		srv := realvllm.StartFleet(b, py, m, realvllm.Options{Name: "tiny", BlockSize: 32, GPUBlocks: 512})[0]
		for range b.N {
			measureStepTime(b, srv.URL())
		}
	})
	b.Run("sim", func(b *testing.B) {
		s := startSim(b, "-model", "tiny", "-max-model-len", "2048", "-block-size", "32", "-num-gpu-blocks", "512",
			"-max-num-seqs", "8", "-time-scale", "1")
		for range b.N {
			measureStepTime(b, "http://"+s.addr)
		}
	})
}

// measureStepTime runs the measurement once against the server at base.
func measureStepTime(b *testing.B, base string) {
	client := &http.Client{Timeout: 5 * time.Minute}
	defer client.CloseIdleConnections()
	seq := 1000
	next := func(n int) []int { seq++; return evictionPrompt(seq, n) }
	run := func(prompt []int, maxTokens int) {
		body := fmt.Sprintf(`{"model":"tiny","prompt":%s,"max_tokens":%d,"ignore_eos":true}`, intsJSON(prompt), maxTokens)
		resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
	itl := map[int]float64{}
	for _, n := range []int{1, 2, 4, 8} {
		before := scrapeSums(b, client, base)
		var wg sync.WaitGroup
		for range n {
			p := next(64)
			wg.Go(func() { run(p, 128) })
		}
		wg.Wait()
		d := scrapeSums(b, client, base).sub(before)
		itl[n] = d.itlSum / d.itlCount * 1000
		b.ReportMetric(itl[n], fmt.Sprintf("itl%d-ms", n))
	}
	b.ReportMetric(itl[8]/itl[1], "itl8/itl1")
	prefill := func(decoding int) float64 {
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for range decoding {
			p := next(64)
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
						run(p, 64)
					}
				}
			})
		}
		if decoding > 0 {
			time.Sleep(500 * time.Millisecond) // let them start decoding
		}
		// Per uncached token: the latency of a 1,024-token prompt less
		// that of a 32-token one (fixed costs cancel), medians of 3.
		timed := func(n int) float64 {
			var ts []float64
			for range 3 {
				start := time.Now()
				run(next(n), 1)
				ts = append(ts, time.Since(start).Seconds())
			}
			slices.Sort(ts)
			return ts[1]
		}
		long, short := timed(1024), timed(32)
		close(stop)
		wg.Wait()
		return (long - short) / (1024 - 32) * 1e6
	}
	alone, busy := prefill(0), prefill(7)
	b.ReportMetric(alone, "prefill-alone-us/token")
	b.ReportMetric(busy, "prefill-busy-us/token")
	b.ReportMetric(busy/alone, "prefill-busy/alone")
}

func intsJSON(xs []int) string {
	var sb strings.Builder
	sb.WriteByte('[')
	for i, x := range xs {
		if i > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(strconv.Itoa(x))
	}
	sb.WriteByte(']')
	return sb.String()
}

// engineSums are cumulative figures of a metrics page.
type engineSums struct {
	itlSum, itlCount float64
}

func (a engineSums) sub(o engineSums) engineSums {
	return engineSums{a.itlSum - o.itlSum, a.itlCount - o.itlCount}
}

func scrapeSums(b *testing.B, c *http.Client, base string) engineSums {
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	var s engineSums
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			continue
		}
		switch name {
		case "vllm:inter_token_latency_seconds_sum":
			s.itlSum += v
		case "vllm:inter_token_latency_seconds_count":
			s.itlCount += v
		}
	}
	return s
}
