package quality

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
)

// The tail benchmark (issue 27): a fleet under cache pressure at high
// load. Four simulators each run at most 8 sequences, hold about 15 of
// the shared-prefix workload's 24 long system prompts in their KV cache
// (so the fleet holds them all only when they are partitioned), take
// 20 ms a step with one request and twice that with a full batch (so a
// 64-token answer holds a slot 1.3-2.6 s, and slots, not prefill, bound
// a well-routed fleet), and compute prefill at 150 µs a token. Two
// workloads:
//
//   - shared: shared-prefix chat, 24 groups x 8 users, 1,024-token system
//     prompts, 64-token questions, 64 streamed tokens, Poisson arrivals;
//   - short-long: many short prompts (32-256 tokens, nothing shared), one
//     in twenty long (one of 6 documents of 2,048 tokens and a new
//     64-token question), 64 streamed tokens, bursty arrivals
//     (load.ArrivalBursty).
//
// For each workload it measures round-robin's saturation (see
// tailWorkload), each profile's unloaded p90 TTFT (10 % of saturation,
// at least 150 requests, after a warm-up at 50 %), then every profile at
// 50, 80, 95 and 105 % of the saturation, SWITCHYARD_TAIL_RUNS times (5). A run
// starts cold (empty caches, nothing learned: the profiles run one after
// another on one fleet, and would otherwise inherit each other's cache
// placement), then warms up a third as long as the measured stage at the
// same rate; one seed per run and load, the same for every profile. `make bench-tail`
// runs it; knobs:
//
//	SWITCHYARD_TAIL_RUNS      runs per profile and load (5)
//	SWITCHYARD_TAIL_SECONDS   measured seconds per run (40)
//	SWITCHYARD_TAIL_SCALE     simulator -time-scale (1)
//	SWITCHYARD_TAIL_PROFILES  comma list (round-robin,least-queue,weighted,predicted-ttft,cache-aware)
//	SWITCHYARD_TAIL_LOADS     comma list of percentages (50,80,95,105)
//	SWITCHYARD_TAIL_WORKLOADS comma list (shared,short-long)
//	SWITCHYARD_TAIL_SAT_SHARED, SWITCHYARD_TAIL_SAT_SHORT_LONG
//	                          round-robin's saturation in req/s at scale 1
//	                          (skips measuring it; scaled with the simulators)
//	SWITCHYARD_TAIL_OUT       also write the tables to this file
//	SWITCHYARD_QUALITY_LOG    every decision, JSON lines, to this file
//	SWITCHYARD_QUALITY_ENVOY  1: through real Envoy, not the in-process data plane
//	SWITCHYARD_TAIL_UNLOADED  0: skip the unloaded runs (no p90 / unloaded column)
//	SWITCHYARD_TAIL_COLD      0: every run starts from the caches and the
//	                          picker's view the profile before it left, not
//	                          cold (fleet.coldStart) as by default
//	SWITCHYARD_TAIL_STALL     freeze every simulator (SIGSTOP) this long half way
//	                          through each measured stage: how a profile recovers
//	                          from a stall of the fleet's host (0: none)

// tailSimArgs are the simulators' flags of the regime, besides
// -time-scale and -num-gpu-blocks.
var tailSimArgs = []string{
	"-max-num-seqs", "8",
	"-batch-slowdown", "2",
	"-prefill-time-per-token", "150us",
	"-step-time", "20ms",
}

// tailBlocks is each simulator's KV cache: 15 of the 24 system prompts of
// 1,024 tokens (64 blocks of 16).
const tailBlocks = 15 * 64

// tailWorkload is one workload of the benchmark. Round-robin's
// saturation is the knee of a sweep of rising rates (ks times its
// closed-loop throughput with every slot of the fleet busy and as many
// requests waiting) with the workload's own arrivals: the last rate whose
// stage passes beforeKnee (given the lightest stage) with no failures.
type tailWorkload struct {
	name        string
	w           load.Workload
	arrival     load.ArrivalKind
	ks          []float64
	beforeKnee  func(first, r load.StageReport) bool
	kneeMeaning string
}

func tailWorkloads() []tailWorkload {
	return []tailWorkload{
		// Round-robin hits the cache about half the time here, so its
		// p50 sits between hits and misses and cannot mark a knee; its
		// p90 (a miss) is steady until queues build. The closed loop
		// (many prompts in flight at once, so more eviction) runs below
		// what open-loop arrivals sustain.
		{"shared", load.Workload{Kind: load.WorkloadSharedPrefix, Groups: 24, UsersPerGroup: 8, SystemLen: 1024,
			QuestionLen: 64, Output: load.Fixed(64)}, load.ArrivalPoisson,
			[]float64{0.9, 1.05, 1.2, 1.35, 1.5, 1.7, 1.9, 2.1},
			func(first, r load.StageReport) bool { return r.TTFT.P90Ms <= 2*first.TTFT.P90Ms },
			"TTFT p90 within 2x the lightest stage's"},
		// Bursts saturate a fleet at a lower mean rate than its capacity;
		// p50 is a short prompt's.
		{"short-long", load.Workload{Kind: load.WorkloadShortLong, Input: load.Range{Min: 32, Max: 256},
			Groups: 6, SystemLen: 2048, QuestionLen: 64, LongFraction: 0.05, Output: load.Fixed(64)}, load.ArrivalBursty,
			[]float64{0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1},
			func(first, r load.StageReport) bool { return r.TTFT.P50Ms <= 1.5*first.TTFT.P50Ms },
			"TTFT p50 within 1.5x the lightest stage's"},
	}
}

// tailResult is one profile's runs at one load.
type tailResult struct {
	reps []load.StageReport
}

func (r *tailResult) values(f func(load.StageReport) float64) []float64 {
	out := make([]float64, len(r.reps))
	for i, rep := range r.reps {
		out[i] = f(rep)
	}
	return out
}

// spread renders the median of xs and, with more than one, their range.
func spread(xs []float64, format string) string {
	s := fmt.Sprintf(format, median(xs))
	if len(xs) > 1 {
		s += fmt.Sprintf(" ("+format+"–"+format+")", slices.Min(xs), slices.Max(xs))
	}
	return s
}

func envList(name, def string) []string {
	v := os.Getenv(name)
	if v == "" {
		v = def
	}
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// TestTail is the tail benchmark; set SWITCHYARD_TAIL=1 (hours at the
// defaults; see the knobs above).
func TestTail(t *testing.T) {
	if os.Getenv("SWITCHYARD_TAIL") == "" {
		t.Skip("set SWITCHYARD_TAIL=1 to run the tail benchmark (make bench-tail)")
	}
	scale := envFloat("SWITCHYARD_TAIL_SCALE", 1)
	dur := time.Duration(envFloat("SWITCHYARD_TAIL_SECONDS", 40) * float64(time.Second))
	runs := int(envFloat("SWITCHYARD_TAIL_RUNS", 5))
	profiles := envList("SWITCHYARD_TAIL_PROFILES", "round-robin,least-queue,weighted,predicted-ttft,cache-aware")
	var loads []float64
	for _, s := range envList("SWITCHYARD_TAIL_LOADS", "50,80,95,105") {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("SWITCHYARD_TAIL_LOADS: %v", err)
		}
		loads = append(loads, v/100)
	}
	only := envList("SWITCHYARD_TAIL_WORKLOADS", "shared,short-long")

	f := startFleet(t, fleetConfig{sims: 4, timeScale: scale, gpuBlocks: tailBlocks, scrape: 50 * time.Millisecond, simArgs: tailSimArgs})
	q := &experiment{t: t, f: f, dur: dur, warm: dur / 3, seed: 2700, conc: 64, cold: os.Getenv("SWITCHYARD_TAIL_COLD") != "0"}
	var out strings.Builder
	start := "each from what the profile before it left"
	if q.cold {
		start = "each from cold"
	}
	fmt.Fprintf(&out, "Tail benchmark: 4 x vllm-sim %s -num-gpu-blocks %d -time-scale %g; %d run(s) of %v after %v warm-up, %s; load average at start %s\n",
		strings.Join(tailSimArgs, " "), tailBlocks, scale, runs, dur, q.warm, start, loadAvg())
	for _, tw := range tailWorkloads() {
		if !slices.Contains(only, tw.name) {
			continue
		}
		out.WriteString(q.tailWorkload(tw, profiles, loads, runs, scale))
	}
	fmt.Fprintf(&out, "\nload average at end %s\n", loadAvg())
	fmt.Printf("\n%s\n", out.String())
	if p := os.Getenv("SWITCHYARD_TAIL_OUT"); p != "" {
		if err := os.WriteFile(p, []byte(out.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// tailWorkload runs one workload and returns its tables.
func (q *experiment) tailWorkload(tw tailWorkload, profiles []string, loads []float64, runs int, scale float64) string {
	env := "SWITCHYARD_TAIL_SAT_" + strings.ToUpper(strings.ReplaceAll(tw.name, "-", "_"))
	sat := envFloat(env, 0) * scale
	if sat == 0 {
		closed := q.f.run("round-robin", tw.w, load.ArrivalConcurrency, load.Stage{Concurrency: q.conc, Duration: q.warm}, load.Stage{Concurrency: q.conc, Duration: q.dur}, q.nextSeed())
		q.t.Logf("%s: round-robin, %d in flight: %.1f req/s", tw.name, q.conc, closed.RequestThroughput)
		var sweep []load.StageReport
		sat, sweep = q.f.sweepSaturation(tw.w, tw.arrival, tw.ks, closed, q.dur/2, q.nextSeed(), tw.beforeKnee)
		for _, r := range sweep {
			q.t.Logf("%s sweep, round-robin at %.1f req/s: TTFT p50 %.0f ms, p90 %.0f ms, hit %.3f", tw.name, r.Rate, r.TTFT.P50Ms, r.TTFT.P90Ms, r.PrefixCacheHitRate)
		}
		q.t.Logf("%s: knee: %s", tw.name, tw.kneeMeaning)
	}
	q.note("%s: round-robin saturates at %.1f req/s (%.1f at scale 1)", tw.name, sat, sat/scale)
	unloaded := map[string]load.StageReport{}
	// At least 150 requests unloaded: its p90 is the reference.
	udur := max(2*q.dur, time.Duration(150/(sat/10)*float64(time.Second)))
	for _, p := range profiles {
		if os.Getenv("SWITCHYARD_TAIL_UNLOADED") == "0" {
			break
		}
		if q.cold {
			q.f.coldStart(p)
		}
		reps := q.f.runStages(p, tw.w, tw.arrival, []load.Stage{{Rate: sat / 2, Duration: q.warm}, {Rate: sat / 10, Duration: udur}}, q.nextSeed())
		unloaded[p] = reps[len(reps)-1]
		q.t.Logf("%s unloaded %s: p90 %.0f ms, hit %.3f", tw.name, p, unloaded[p].TTFT.P90Ms, unloaded[p].PrefixCacheHitRate)
	}
	res := map[string]map[float64]*tailResult{}
	for _, p := range profiles {
		res[p] = map[float64]*tailResult{}
		for _, l := range loads {
			res[p][l] = &tailResult{}
		}
	}
	for k := range runs {
		for _, l := range loads {
			seed := q.nextSeed()
			for _, p := range profiles {
				if q.cold {
					q.f.coldStart(p)
				}
				stop := q.stallAt(q.warm + q.dur/2)
				reps := q.f.runStages(p, tw.w, tw.arrival, []load.Stage{{Rate: l * sat, Duration: q.warm}, {Rate: l * sat, Duration: q.dur}}, seed)
				stop()
				r := reps[len(reps)-1]
				res[p][l].reps = append(res[p][l].reps, r)
				q.t.Logf("%s run %d %.0f%% %s: TTFT p50 %.0f p90 %.0f p99 %.0f ms, hit %.3f, %.1f req/s, failed %d",
					tw.name, k+1, l*100, p, r.TTFT.P50Ms, r.TTFT.P90Ms, r.TTFT.P99Ms, r.PrefixCacheHitRate, r.RequestThroughput, r.Failed)
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n### %s (round-robin saturates at %.1f req/s; %d run(s): median (min–max); times and rates at scale 1)\n\n", tw.name, sat/scale, runs)
	b.WriteString("| load | profile | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | p90 / unloaded | hit ratio | throughput req/s | failed |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	for _, p := range profiles {
		u, ok := unloaded[p]
		if !ok {
			continue
		}
		fmt.Fprintf(&b, "| unloaded (10%%) | %s | %.0f | %.0f | %.0f | 1.00 | %.3f | %.1f | %d |\n", p, u.TTFT.P50Ms*scale, u.TTFT.P90Ms*scale, u.TTFT.P99Ms*scale, u.PrefixCacheHitRate, u.RequestThroughput/scale, u.Failed)
	}
	for _, l := range loads {
		for _, p := range profiles {
			r := res[p][l]
			u := unloaded[p].TTFT.P90Ms
			p90 := r.values(func(s load.StageReport) float64 { return s.TTFT.P90Ms * scale })
			rel := make([]float64, len(p90))
			for i, v := range p90 {
				rel[i] = v / (u * scale)
			}
			relS := "–"
			if u > 0 {
				relS = spread(rel, "%.2f")
			}
			failed := 0.0
			for _, s := range r.reps {
				failed += float64(s.Failed)
			}
			fmt.Fprintf(&b, "| %.0f%% | %s | %s | %s | %s | %s | %s | %s | %.0f |\n", l*100, p,
				spread(r.values(func(s load.StageReport) float64 { return s.TTFT.P50Ms * scale }), "%.0f"),
				spread(p90, "%.0f"),
				spread(r.values(func(s load.StageReport) float64 { return s.TTFT.P99Ms * scale }), "%.0f"),
				relS,
				spread(r.values(func(s load.StageReport) float64 { return s.PrefixCacheHitRate }), "%.3f"),
				spread(r.values(func(s load.StageReport) float64 { return s.RequestThroughput / scale }), "%.1f"),
				failed)
		}
	}
	if lq := res["least-queue"]; lq != nil {
		b.WriteString("\np90 against least-queue (median of runs):")
		for _, l := range loads {
			base := median(lq[l].values(func(s load.StageReport) float64 { return s.TTFT.P90Ms }))
			fmt.Fprintf(&b, "\n- %.0f%%:", l*100)
			for _, p := range profiles {
				if p == "least-queue" {
					continue
				}
				fmt.Fprintf(&b, " %s %.2fx", p, median(res[p][l].values(func(s load.StageReport) float64 { return s.TTFT.P90Ms }))/base)
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// stallAt freezes every simulator for SWITCHYARD_TAIL_STALL, after, from
// now; the function it returns cancels a stall not begun and ends one
// under way.
func (q *experiment) stallAt(after time.Duration) func() {
	var d time.Duration
	if v := os.Getenv("SWITCHYARD_TAIL_STALL"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			q.t.Fatalf("SWITCHYARD_TAIL_STALL: %v", err)
		}
	}
	if d <= 0 {
		return func() {}
	}
	var mu sync.Mutex
	stopped := false
	signal := func(sig syscall.Signal) {
		for _, p := range q.f.sims {
			if err := p.Signal(sig); err != nil {
				q.t.Errorf("stall: %s: %v", p.Name, err)
			}
		}
	}
	cont := func() {
		mu.Lock()
		defer mu.Unlock()
		if stopped {
			signal(syscall.SIGCONT)
			stopped = false
		}
	}
	var resume *time.Timer
	start := time.AfterFunc(after, func() {
		mu.Lock()
		defer mu.Unlock()
		signal(syscall.SIGSTOP)
		stopped = true
		resume = time.AfterFunc(d, cont)
	})
	return func() {
		start.Stop()
		mu.Lock()
		r := resume
		mu.Unlock()
		if r != nil {
			r.Stop()
		}
		cont()
	}
}

// loadAvg is the first three fields of /proc/loadavg, or "?".
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
