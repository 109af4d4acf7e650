package quality

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/registry"
)

// Admission experiments' wire names: the pool reads a request's flow and
// priority from these headers.
const (
	tenantHeader   = "x-tenant"
	priorityHeader = "x-priority"
)

// class is one stream of requests in an admission experiment: its share
// of the offered rate (open loop) or its concurrency (closed loop), and
// the headers that make it a tenant or a priority.
type class struct {
	name        string
	share       float64
	concurrency int
	headers     map[string]string
}

// runClasses drives the fleet with every class at once, each its own
// load.Run (its own seed), and returns each class's measured stage (the
// last). rate is the total offered rate of the open-loop stages.
func (f *fleet) runClasses(w load.Workload, arrival load.ArrivalKind, rate float64, warm, measure time.Duration, classes []class, seed uint64) map[string]load.StageReport {
	f.t.Helper()
	out := map[string]load.StageReport{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, c := range classes {
		var stages []load.Stage
		for _, d := range []time.Duration{warm, measure} {
			if d > 0 {
				stages = append(stages, load.Stage{Rate: rate * c.share, Concurrency: c.concurrency, Duration: d})
			}
		}
		h := http.Header{}
		for k, v := range c.headers {
			h.Set(k, v)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rep, err := load.Run(context.Background(), load.Config{
				URL: f.url, API: load.APIChat, Model: modelName, Workload: w, Arrival: arrival, Headers: h,
				Stages: stages, Seed: seed + uint64(i)*1000, MaxInFlight: 20000,
				Timeout: 90 * time.Second, DrainTimeout: 60 * time.Second,
			})
			if err != nil {
				f.t.Error(err)
				return
			}
			mu.Lock()
			out[c.name] = rep.Stages[len(rep.Stages)-1]
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

// jain is Jain's fairness index of xs: 1 when equal, 1/n when one has all.
func jain(xs ...float64) float64 {
	var sum, sq float64
	for _, x := range xs {
		sum += x
		sq += x * x
	}
	if sq == 0 {
		return 1
	}
	return sum * sum / (float64(len(xs)) * sq)
}

// served is a stage's tokens served per second of its window.
func served(r load.StageReport) float64 {
	if r.WindowS == 0 {
		return 0
	}
	return float64(r.PromptTokens+r.OutputTokens) / r.WindowS
}

// onlyShed reports whether every failed request of r was a 429 or 503
// (an answer with a reason), nothing lost to timeouts or broken streams.
func onlyShed(r load.StageReport) error {
	var other []string
	for kind, n := range r.Errors {
		if kind != "http 429" && kind != "http 503" {
			other = append(other, fmt.Sprintf("%s x%d (%s)", kind, n, r.ErrorExamples[kind]))
		}
	}
	if len(other) > 0 || r.Cancelled > 0 {
		return fmt.Errorf("lost requests: %s, %d cancelled", strings.Join(other, ", "), r.Cancelled)
	}
	return nil
}

type admissionRow struct {
	experiment, setting, class string
	rate                       float64
	r                          load.StageReport
}

func admissionTable(rows []admissionRow) string {
	var b strings.Builder
	b.WriteString("| experiment | admission | class | offered req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | completed | 429 | 503 | served tok/s |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		rate := "closed loop"
		if r.rate > 0 {
			rate = fmt.Sprintf("%.1f", r.rate)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %.0f | %.0f | %.0f | %d | %d | %d | %.0f |\n", r.experiment, r.setting, r.class, rate,
			r.r.TTFT.P50Ms, r.r.TTFT.P90Ms, r.r.TTFT.P99Ms, r.r.Completed, r.r.Statuses[429], r.r.Statuses[503], served(r.r))
	}
	return b.String()
}

// admissionBlock is the experiments' admission block: flows and
// priorities from headers, the given fairness; off when disabled.
func admissionBlock(disabled bool, fairness string) *registry.Admission {
	return &registry.Admission{Disabled: disabled, Fairness: fairness, FlowHeader: tenantHeader,
		PriorityHeader: priorityHeader, PriorityMin: 0, PriorityMax: 1}
}

// TestQualityAdmissionSmoke (seconds): a burst of twice what four fast
// simulators sustain, a fifth of it high priority, through the admission
// queue: high-priority requests wait clearly less than the rest, and
// every request is answered (a response, or 429/503 with a reason).
func TestQualityAdmissionSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts vllm-sim processes")
	}
	f := startFleet(t, fleetConfig{sims: 4, timeScale: 5, gpuBlocks: 2000, scrape: 20 * time.Millisecond,
		simArgs: []string{"-max-num-seqs", "4"}})
	f.admission = admissionBlock(false, "")
	w := load.Workload{Kind: load.WorkloadRandom, Input: load.Range{Min: 64, Max: 256}, Output: load.Fixed(32)}
	f.use("default")
	classes := []class{{name: "high", share: 0.2, headers: map[string]string{priorityHeader: "1"}}, {name: "normal", share: 0.8}}
	// Four simulators of four sequences, 32 tokens at ~8 ms a step scaled
	// 5x: ~100 req/s, a sixth of the 600 offered. (Scaled 20x, a quiet
	// machine's simulators kept up with what the load generator could
	// offer: nothing queued long and both classes had the same p90.)
	res := f.runClasses(w, load.ArrivalPoisson, 600, time.Second, 3*time.Second, classes, 31)
	hi, lo := res["high"], res["normal"]
	t.Logf("\n%s", admissionTable([]admissionRow{{"smoke burst", "on", "high", 120, hi}, {"smoke burst", "on", "normal", 480, lo}}))
	for _, r := range []load.StageReport{hi, lo} {
		if err := onlyShed(r); err != nil {
			t.Error(err)
		}
	}
	if hi.Completed == 0 || lo.Completed == 0 {
		t.Fatalf("completed %d high, %d normal", hi.Completed, lo.Completed)
	}
	if q := f.srvs[0].AdmissionStats(); len(q) != 1 || q[0].Enqueued == 0 {
		t.Fatalf("nothing waited in the admission queue: %+v (the burst did not saturate the pool)", q)
	}
	if hi.TTFT.P90Ms >= lo.TTFT.P90Ms {
		t.Errorf("high-priority TTFT p90 %.0f ms, normal %.0f ms: priority must wait less", hi.TTFT.P90Ms, lo.TTFT.P90Ms)
	}
}

// TestQualityAdmission (SWITCHYARD_QUALITY=1, about 10 minutes) measures
// issue 13's targets on four simulators (real time unless
// SWITCHYARD_QUALITY_SCALE): round-robin's saturation rate first (the
// admission queue off), the unloaded TTFT p90 (10 % of it), then
//
//   - burst: 2x saturation for SWITCHYARD_QUALITY_BURST_SECONDS (30), 20 %
//     high priority, admission on and off;
//   - noisy tenant: tenant A at 10x tenant B's rate, 1.5x saturation in
//     all, with each fairness policy and off; then both backlogged
//     (closed loop, A with 10x B's concurrency): Jain's index of served
//     tokens;
//   - steady: 95 % of saturation, admission on;
//   - overload: 10x saturation for 60 s with a 4 MiB byte bound: the
//     queue's bytes stay bounded and every request is answered.
func TestQualityAdmission(t *testing.T) {
	if os.Getenv("SWITCHYARD_QUALITY") == "" {
		t.Skip("set SWITCHYARD_QUALITY=1 to run the admission experiments (minutes)")
	}
	scale := envFloat("SWITCHYARD_QUALITY_SCALE", 1)
	seqs := int(envFloat("SWITCHYARD_QUALITY_SEQS", 8))
	f := startFleet(t, fleetConfig{sims: 4, timeScale: scale, gpuBlocks: int(envFloat("SWITCHYARD_QUALITY_BLOCKS", 3000)),
		scrape: 50 * time.Millisecond, simArgs: []string{"-max-num-seqs", fmt.Sprint(seqs)}})
	w := load.Workload{Kind: load.WorkloadRandom, Input: load.Range{Min: 128, Max: 1024}, Output: load.Fixed(int(envFloat("SWITCHYARD_QUALITY_OUTPUT", 64)))}
	dur := time.Duration(envFloat("SWITCHYARD_QUALITY_SECONDS", 20) * float64(time.Second))
	burst := time.Duration(envFloat("SWITCHYARD_QUALITY_BURST_SECONDS", 30) * float64(time.Second))
	warm := dur / 4
	sched := &registry.Scheduling{QueueThreshold: int(envFloat("SWITCHYARD_QUALITY_QUEUE_THRESHOLD", 0)),
		KVThreshold: envFloat("SWITCHYARD_QUALITY_KV_THRESHOLD", 0)}
	only := os.Getenv("SWITCHYARD_QUALITY_ONLY") // comma-separated experiments
	want := func(name string) bool { return only == "" || strings.Contains(","+only+",", ","+name+",") }
	var rows []admissionRow
	defer func() {
		fmt.Printf("\nAdmission: 4 x vllm-sim (-time-scale %g, -max-num-seqs %d), random %v-token prompts, %d output tokens\n\n%s\n",
			scale, seqs, w.Input, w.Output.Min, admissionTable(rows))
	}()
	use := func(adm *registry.Admission, profile string) {
		f.admission = adm
		f.t.Helper()
		st := f.stateWith(&registry.Scheduling{Profile: profile, QueueThreshold: sched.QueueThreshold, KVThreshold: sched.KVThreshold}, adm)
		f.apply(st)
	}
	seed := uint64(900)
	next := func() uint64 { seed += 7; return seed }

	sat := envFloat("SWITCHYARD_QUALITY_RR_SAT", 0)
	if sat == 0 {
		use(admissionBlock(true, ""), "round-robin")
		conc := 4 * seqs * 3
		closed := f.runClasses(w, load.ArrivalConcurrency, 0, warm, dur, []class{{name: "all", concurrency: conc}}, next())["all"]
		rows = append(rows, admissionRow{"saturation", "off", "round-robin", 0, closed})
		f.admission = admissionBlock(true, "")
		var sweep []load.StageReport
		sat, sweep = f.saturationWith(w, closed, dur/2, next(), func() { use(admissionBlock(true, ""), "round-robin") })
		for _, r := range sweep {
			rows = append(rows, admissionRow{"saturation sweep", "off", "round-robin", r.Rate, r})
		}
	}
	t.Logf("round-robin saturation: %.1f req/s", sat)

	use(admissionBlock(false, ""), "default")
	unloaded := f.runClasses(w, load.ArrivalPoisson, 0.1*sat, warm, dur, []class{{name: "all", share: 1}}, next())["all"]
	rows = append(rows, admissionRow{"unloaded (10%)", "on", "all", 0.1 * sat, unloaded})
	base := unloaded.TTFT.P90Ms
	t.Logf("unloaded TTFT p90 %.0f ms", base)

	if want("steady") {
		for _, off := range []bool{false, true} {
			use(admissionBlock(off, ""), "default")
			r := f.runClasses(w, load.ArrivalPoisson, 0.95*sat, warm, dur, []class{{name: "all", share: 1}}, next())["all"]
			rows = append(rows, admissionRow{"steady 95%", onOff(off), "all", 0.95 * sat, r})
			t.Logf("steady 95%% admission %s: TTFT p90 %.0f ms = %.2fx unloaded (target <= 2x)", onOff(off), r.TTFT.P90Ms, r.TTFT.P90Ms/base)
		}
	}
	if want("burst") {
		for _, off := range []bool{false, true} {
			use(admissionBlock(off, ""), "default")
			classes := []class{{name: "high", share: 0.2, headers: map[string]string{priorityHeader: "1"}}, {name: "normal", share: 0.8}}
			stopTrace := f.traceWaiting(t)
			res := f.runClasses(w, load.ArrivalPoisson, 2*sat, 0, burst, classes, next())
			stopTrace()
			for _, c := range classes {
				rows = append(rows, admissionRow{"burst 2x", onOff(off), c.name, 2 * sat * c.share, res[c.name]})
				if err := onlyShed(res[c.name]); err != nil {
					t.Errorf("burst, admission %s, %s: %v", onOff(off), c.name, err)
				}
			}
			t.Logf("burst 2x admission %s: high-priority TTFT p90 %.0f ms = %.2fx unloaded (target <= 1.5x on, >= 5x off); queue wait p90 by band: %s",
				onOff(off), res["high"].TTFT.P90Ms, res["high"].TTFT.P90Ms/base, f.queueWaits())
		}
	}
	if want("noisy") {
		for _, setting := range []struct {
			name     string
			off      bool
			fairness string
		}{{"on, tokens", false, "tokens"}, {"on, round-robin", false, "round-robin"}, {"off", true, ""}} {
			use(admissionBlock(setting.off, setting.fairness), "default")
			// Tenants are named per setting: the queue remembers what a
			// flow received lately (10 s half-life), and the previous
			// setting's tenant A must not start this one in debt.
			tenantA, tenantB := "A-"+setting.name, "B-"+setting.name
			classes := []class{{name: "A", share: 10.0 / 11, headers: map[string]string{tenantHeader: tenantA}},
				{name: "B", share: 1.0 / 11, headers: map[string]string{tenantHeader: tenantB}}}
			res := f.runClasses(w, load.ArrivalPoisson, 1.5*sat, warm, dur, classes, next())
			for _, c := range classes {
				rows = append(rows, admissionRow{"noisy tenant 10:1, 1.5x", setting.name, c.name, 1.5 * sat * c.share, res[c.name]})
			}
			t.Logf("noisy tenant, %s: B's TTFT p90 %.0f ms = %.2fx unloaded (target <= 1.5x)", setting.name, res["B"].TTFT.P90Ms, res["B"].TTFT.P90Ms/base)
			// Both backlogged: closed loop, A with 10x B's requests in
			// flight, B alone enough to fill every server's batch (so it
			// always has requests waiting for the dispatcher).
			c := 4 * seqs
			tenantA, tenantB = tenantA+"-backlogged", tenantB+"-backlogged"
			classes = []class{{name: "A", concurrency: 10 * c, headers: map[string]string{tenantHeader: tenantA}},
				{name: "B", concurrency: c, headers: map[string]string{tenantHeader: tenantB}}}
			// Tokens dispatched per flow over the measured stage, from the
			// picker's queue (the clients' windows differ: A's answers come
			// late and stretch its window past the stage).
			var before, after map[string]uint64
			sampled := make(chan struct{})
			go func() {
				defer close(sampled)
				time.Sleep(warm)
				before = f.dispatchedTokens()
				time.Sleep(dur)
				after = f.dispatchedTokens()
			}()
			res = f.runClasses(w, load.ArrivalConcurrency, 0, warm, dur, classes, next())
			<-sampled
			for _, cl := range classes {
				rows = append(rows, admissionRow{fmt.Sprintf("both backlogged (%d:%d in flight)", 10*c, c), setting.name, cl.name, 0, res[cl.name]})
			}
			a, b := float64(after[tenantA]-before[tenantA]), float64(after[tenantB]-before[tenantB])
			if setting.off {
				// No queue: the clients' own figures.
				a, b = served(res["A"]), served(res["B"])
			}
			t.Logf("both backlogged, %s: tokens dispatched A %.0f, B %.0f in %v, Jain %.3f (target >= 0.9)", setting.name, a, b, dur, jain(a, b))
		}
	}
	if want("overload") {
		const bound = 4 << 20
		adm := admissionBlock(false, "")
		adm.MaxQueuedBytes = bound
		adm.MaxQueued = 100000 // the byte bound is what bites
		use(adm, "default")
		var peakBytes int64
		var peakHeap uint64
		stop := make(chan struct{})
		sampled := make(chan struct{})
		go func() {
			defer close(sampled)
			tk := time.NewTicker(100 * time.Millisecond)
			defer tk.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tk.C:
				}
				for _, q := range f.srvs[0].AdmissionStats() {
					var b int64
					for _, w := range q.Waiting {
						b += w.Bytes
					}
					peakBytes = max(peakBytes, b)
				}
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				peakHeap = max(peakHeap, ms.HeapInuse)
			}
		}()
		od := time.Duration(envFloat("SWITCHYARD_QUALITY_OVERLOAD_SECONDS", 60) * float64(time.Second))
		r := f.runClasses(w, load.ArrivalPoisson, 10*sat, 0, od, []class{{name: "all", share: 1}}, next())["all"]
		close(stop)
		<-sampled
		rows = append(rows, admissionRow{fmt.Sprintf("overload 10x, %v", od), "on, 4 MiB bound", "all", 10 * sat, r})
		t.Logf("overload 10x for %v: %d sent, %d completed, 429 %d, 503 %d; peak queued bytes %d (bound %d); peak heap in use (whole test process) %d MiB",
			od, r.Sent, r.Completed, r.Statuses[429], r.Statuses[503], peakBytes, bound, peakHeap>>20)
		if peakBytes > bound {
			t.Errorf("queued bytes peaked at %d, above the %d bound", peakBytes, bound)
		}
		if err := onlyShed(r); err != nil {
			t.Error(err)
		}
	}
}

func onOff(off bool) string {
	if off {
		return "off"
	}
	return "on"
}

// queueWaits summarises the admission queue's dispatched waits per band
// since the fleet started: p90 as a histogram bucket bound.
func (f *fleet) queueWaits() string {
	var parts []string
	bounds := admission.WaitBounds()
	for _, q := range f.srvs[0].AdmissionStats() {
		for k, h := range q.Wait {
			if k.Outcome != admission.OutcomeDispatched || h.Count == 0 {
				continue
			}
			p90 := bounds[len(bounds)-1]
			for i, c := range h.Cumulative {
				if float64(c) >= 0.9*float64(h.Count) {
					p90 = bounds[i]
					break
				}
			}
			parts = append(parts, fmt.Sprintf("band %d: %d waited, p90 <= %g ms", k.Priority, h.Count, 1000*p90))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, "; ")
}

// traceWaiting (SWITCHYARD_QUALITY_TRACE=1) samples every simulator's
// queue every 20 ms until the returned stop is called, then logs how
// often each had requests waiting: what the admission queue let through
// beyond the servers' batches.
func (f *fleet) traceWaiting(t *testing.T) (stop func()) {
	if os.Getenv("SWITCHYARD_QUALITY_TRACE") == "" {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	hist := make([]map[int]int, len(f.addrs))
	go func() {
		defer close(finished)
		tk := time.NewTicker(20 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-done:
				return
			case <-tk.C:
			}
			for i, a := range f.addrs {
				if hist[i] == nil {
					hist[i] = map[int]int{}
				}
				resp, err := http.Get("http://" + a + "/metrics")
				if err != nil {
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				for _, line := range strings.Split(string(b), "\n") {
					if strings.HasPrefix(line, "vllm:num_requests_waiting") {
						var v float64
						fmt.Sscan(line[strings.LastIndex(line, " ")+1:], &v)
						hist[i][int(v)]++
					}
				}
			}
		}
	}()
	return func() {
		close(done)
		<-finished
		for i, h := range hist {
			t.Logf("sim %d waiting-queue samples (length: count): %v", i, h)
		}
	}
}

// dispatchedTokens returns the prompt tokens the admission queue has
// dispatched per flow.
func (f *fleet) dispatchedTokens() map[string]uint64 {
	out := map[string]uint64{}
	for _, q := range f.srvs[0].AdmissionStats() {
		for _, fl := range q.Flows {
			out[fl.Flow] += fl.DispatchedTokens
		}
	}
	return out
}

// saturationWith is saturation with reapply called before the sweep (the
// sweep switches the profile through use, which would publish the
// fleet's default admission block).
func (f *fleet) saturationWith(w load.Workload, closed load.StageReport, step time.Duration, seed uint64, reapply func()) (float64, []load.StageReport) {
	f.t.Helper()
	est := closed.RequestThroughput
	var stages []load.Stage
	for _, k := range []float64{0.9, 1.05, 1.2, 1.35, 1.5, 1.7, 1.9} {
		stages = append(stages, load.Stage{Rate: est * k, Duration: step})
	}
	reapply()
	rep, err := load.Run(context.Background(), load.Config{
		URL: f.url, API: load.APIChat, Model: modelName, Workload: w, Arrival: load.ArrivalPoisson,
		Stages: stages, Seed: seed, MaxInFlight: 2000, Timeout: 60 * time.Second, DrainTimeout: 30 * time.Second,
	})
	if err != nil {
		f.t.Fatal(err)
	}
	best := stages[0].Rate
	for i, r := range rep.Stages {
		if r.TTFT.P50Ms > 1.5*rep.Stages[0].TTFT.P50Ms || r.Failed > 0 {
			break
		}
		best = stages[i].Rate
	}
	return best, rep.Stages
}
