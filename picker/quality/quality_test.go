package quality

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/registry"
)

const (
	poolName  = "fleet"
	modelName = "llama"
)

// fleetConfig sizes the simulated fleet.
type fleetConfig struct {
	sims      int
	timeScale float64
	gpuBlocks int
	scrape    time.Duration
	// simArgs are extra vllm-sim flags (e.g. -max-num-seqs).
	simArgs []string
	// ownScrapes: replicas that share picks still read every endpoint
	// themselves (peers.Options.NoReadings).
	ownScrapes bool
}

// fleet is N vllm-sim processes behind one picker (or several replicas)
// and the data plane.
type fleet struct {
	t     testing.TB
	url   string
	addrs []string
	// sims are the simulators' processes (for their CPU time).
	sims []*testutil.Process
	// pickerAddrs are the replicas' addresses, listed in the state's
	// replicas (as a replicas block would) when there are several.
	pickerAddrs []string
	pub         *registry.Publisher
	srvs        []*picker.Server
	version     uint64
	// admission is the pool's admission block use publishes (nil: the
	// defaults).
	admission *registry.Admission
}

func startFleet(t testing.TB, cfg fleetConfig) *fleet {
	t.Helper()
	return startReplicaFleet(t, cfg, 1, false)
}

// startReplicaFleet is startFleet with replicas pickers reading the same
// registry state, the data plane using them in turn (as Envoy's picker
// cluster does); with share, they share their picks (picker/peers).
func startReplicaFleet(t testing.TB, cfg fleetConfig, replicas int, share bool) *fleet {
	t.Helper()
	bin := testutil.Binary(t, "vllm-sim")
	var addrs []string
	var sims []*testutil.Process
	for i := range cfg.sims {
		port := testutil.FreePort(t)
		args := append([]string{"-port", strconv.Itoa(port), "-model", modelName,
			"-time-scale", strconv.FormatFloat(cfg.timeScale, 'g', -1, 64),
			// Room for the mixed workload's 8,000-token prompts with
			// 1,024-token answers.
			"-max-model-len", "10240",
			"-num-gpu-blocks", strconv.Itoa(cfg.gpuBlocks), "-seed", strconv.Itoa(i + 1), "-log-level", "warn"}, cfg.simArgs...)
		if d := os.Getenv("SWITCHYARD_QUALITY_METRICS_DELAY"); d != "" {
			// Each /metrics answer takes this long, as real vLLM's page
			// costs its API server ~3-5 ms: the scraper's engine budget
			// then spaces scrapes as it would for real servers.
			args = append(args, "-metrics-delay", d)
		}
		sims = append(sims, testutil.Start(t, fmt.Sprintf("vllm-sim-%d", i), bin, args...))
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(port))
	}
	for _, a := range addrs {
		testutil.WaitHTTP(t, "http://"+a+"/health", 15*time.Second)
	}
	f := startPickers(t, addrs, cfg.scrape, replicas, share, cfg.ownScrapes, decisionLog(t))
	f.sims = sims
	return f
}

// simCPU is the simulators' CPU time so far (user plus system, from
// /proc; zero where unreadable).
func (f *fleet) simCPU() time.Duration {
	var total time.Duration
	for _, p := range f.sims {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Cmd.Process.Pid))
		if err != nil {
			continue
		}
		s := string(raw)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(fields) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(fields[11], 10, 64)
		st, _ := strconv.ParseInt(fields[12], 10, 64)
		total += time.Duration(ut+st) * 10 * time.Millisecond // clock ticks of 1/100 s
	}
	return total
}

// startPickers runs replicas pickers (sharing their picks or not) for the
// model servers at addrs, and the data plane in front of them.
func startPickers(t testing.TB, addrs []string, scrape time.Duration, replicas int, share, ownScrapes bool, logger *slog.Logger) *fleet {
	t.Helper()
	sort.Strings(addrs)
	f := &fleet{t: t, addrs: addrs}
	var lis []net.Listener
	for range replicas {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lis = append(lis, l)
		f.pickerAddrs = append(f.pickerAddrs, l.Addr().String())
	}
	pickerAddrs := f.pickerAddrs
	f.pub = registry.NewPublisher(f.state(nil))
	var meshes []*peers.Mesh
	for i := range replicas {
		srv := picker.New(f.pub, picker.Options{Metrics: metrics.Options{Interval: scrape}}, logger)
		f.srvs = append(f.srvs, srv)
		lis := lis[i]
		g := grpc.NewServer(srv.GRPCServerOptions()...)
		srv.Register(g)
		if share {
			m := peers.New(srv, peers.Options{Self: fmt.Sprintf("replica-%d", i), NoReadings: ownScrapes})
			srv.UsePeers(m)
			m.Register(g)
			meshes = append(meshes, m)
		}
		ctx, cancel := context.WithCancel(context.Background())
		runDone := make(chan struct{})
		go func() { defer close(runDone); _ = srv.Run(ctx) }()
		go func() { _ = g.Serve(lis) }()
		t.Cleanup(func() {
			g.Stop()
			cancel()
			<-runDone
		})
	}
	for i, m := range meshes {
		var others []string
		for j, a := range pickerAddrs {
			if j != i {
				others = append(others, a)
			}
		}
		m.SetPeers(others)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = m.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
	}
	for _, m := range meshes {
		testutil.Eventually(t, 10*time.Second, "replicas sharing picks", func() error {
			for _, p := range m.Stats().Peers {
				if !p.Connected {
					return fmt.Errorf("%s not connected", p.Address)
				}
			}
			return nil
		})
	}
	if useEnvoy() && len(pickerAddrs) == 1 {
		f.url = startEnvoyDataPlane(t, pickerAddrs[0], addrs)
	} else {
		f.url = startDataPlane(t, pickerAddrs...)
	}
	return f
}

// decisionLog returns a debug logger writing JSON lines to the file
// SWITCHYARD_QUALITY_LOG names (every decision with its scores and, for
// predicted-ttft, every candidate's prediction), or nil.
func decisionLog(t testing.TB) *slog.Logger {
	path := os.Getenv("SWITCHYARD_QUALITY_LOG")
	if path == "" {
		return nil
	}
	fh, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fh.Close() })
	return slog.New(slog.NewJSONHandler(fh, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (f *fleet) state(sc *registry.Scheduling) *registry.State {
	return f.stateWith(sc, nil)
}

// stateWith is state with the pool's admission block.
func (f *fleet) stateWith(sc *registry.Scheduling, adm *registry.Admission) *registry.State {
	st := registry.Empty()
	f.version++
	st.Version = f.version
	p := &registry.Pool{Name: poolName, Engine: registry.EngineVLLM, Scheduling: sc, Admission: adm}
	for _, a := range f.addrs {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a})
	}
	st.Pools[poolName] = p
	st.Models[modelName] = &registry.Model{Name: modelName, Pool: poolName}
	if len(f.pickerAddrs) > 1 {
		// Each replica scrapes every endpoint: they share its engine
		// budget.
		for i, a := range f.pickerAddrs {
			st.Replicas = append(st.Replicas, registry.Replica{ID: fmt.Sprintf("replica-%d", i), Address: a})
		}
	}
	return st
}

// use switches the pool to profile and waits until the picker applied it.
// A profile may carry weight overrides for tuning: "default:kv-cache=0.5,queue=3".
func (f *fleet) use(profile string) {
	f.t.Helper()
	profile, w, _ := strings.Cut(profile, ":")
	sc := &registry.Scheduling{Profile: profile}
	if w != "" {
		sc.Scorers = map[string]float64{}
		for _, kv := range strings.Split(w, ",") {
			k, v, _ := strings.Cut(kv, "=")
			x, err := strconv.ParseFloat(v, 64)
			if err != nil {
				f.t.Fatalf("SWITCHYARD_QUALITY_WEIGHTS %q: %v", kv, err)
			}
			sc.Scorers[k] = x
		}
	}
	f.apply(f.stateWith(sc, f.admission))
}

// coldStart makes the next run start with nothing learned: the pool's
// endpoints leave the picker's state (its prefix index, load counters and
// scrape history of them go with them), every simulator empties its
// prefix cache, and they come back under profile. Profiles run one after
// another on one fleet; without it each inherits the cache placement and
// the picker's view that the one before it left.
func (f *fleet) coldStart(profile string) {
	f.t.Helper()
	addrs := f.addrs
	f.addrs = nil
	f.use(profile)
	f.addrs = addrs
	for _, a := range addrs {
		testutil.Eventually(f.t, 10*time.Second, a+" empties its prefix cache", func() error {
			resp, err := http.Post("http://"+a+"/reset_prefix_cache", "application/json", nil)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			var out struct {
				Success bool `json:"success"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
				return fmt.Errorf("HTTP %d: %w", resp.StatusCode, err)
			}
			if !out.Success {
				return errors.New("refused (requests still running)")
			}
			return nil
		})
	}
	f.use(profile)
}

// apply publishes st and waits until every picker applied it.
func (f *fleet) apply(st *registry.State) {
	f.t.Helper()
	f.pub.Publish(st)
	testutil.Eventually(f.t, 5*time.Second, fmt.Sprintf("state %d applied", st.Version), func() error {
		for _, srv := range f.srvs {
			if v := srv.Stats().Version; v != st.Version {
				return fmt.Errorf("version %d, want %d", v, st.Version)
			}
		}
		return nil
	})
}

// run drives the fleet with profile: a warm-up stage then the measured
// stage, returning the measured stage's report.
func (f *fleet) run(profile string, w load.Workload, arrival load.ArrivalKind, warm, measure load.Stage, seed uint64) load.StageReport {
	f.t.Helper()
	st := f.runStages(profile, w, arrival, []load.Stage{warm, measure}, seed)
	return st[len(st)-1]
}

func (f *fleet) runStages(profile string, w load.Workload, arrival load.ArrivalKind, stages []load.Stage, seed uint64) []load.StageReport {
	f.t.Helper()
	f.use(profile)
	rep, err := load.Run(context.Background(), load.Config{
		URL: f.url, API: load.APIChat, Model: modelName, Workload: w, Arrival: arrival,
		Stages: stages, Seed: seed, MaxInFlight: 2000,
		Timeout: 60 * time.Second, DrainTimeout: 30 * time.Second,
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return rep.Stages
}

// saturation finds round-robin's saturation rate for w: a closed-loop run
// gives a first estimate, then an open-loop sweep (Poisson, rising rates
// from 0.9x the estimate) keeps the highest rate before the knee: no
// failures and TTFT p50 within 1.5x the first (lightest) stage's.
func (f *fleet) saturation(w load.Workload, closed load.StageReport, step time.Duration, seed uint64) (float64, []load.StageReport) {
	return f.sweepSaturation(w, load.ArrivalPoisson, []float64{0.9, 1.05, 1.2, 1.35, 1.5, 1.7, 1.9}, closed, step, seed,
		func(first, r load.StageReport) bool { return r.TTFT.P50Ms <= 1.5*first.TTFT.P50Ms })
}

// sweepSaturation is saturation with the sweep's arrival process, its
// rates as multiples of the closed-loop throughput, and the test of a
// stage before the knee (besides no failures), given the first stage.
func (f *fleet) sweepSaturation(w load.Workload, arrival load.ArrivalKind, ks []float64, closed load.StageReport, step time.Duration, seed uint64,
	beforeKnee func(first, r load.StageReport) bool) (float64, []load.StageReport) {
	f.t.Helper()
	est := closed.RequestThroughput
	var stages []load.Stage
	for _, k := range ks {
		stages = append(stages, load.Stage{Rate: est * k, Duration: step})
	}
	reps := f.runStages("round-robin", w, arrival, stages, seed)
	best := stages[0].Rate
	for i, r := range reps {
		if !beforeKnee(reps[0], r) || r.Failed > 0 {
			break
		}
		best = stages[i].Rate
	}
	return best, reps
}

type row struct {
	load    string
	profile string
	rate    float64
	r       load.StageReport
}

func table(rows []row) string {
	var b strings.Builder
	b.WriteString("| workload / load | profile | offered req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | throughput req/s | prefix hit rate | failed |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		rate := "closed loop"
		if r.rate > 0 {
			rate = fmt.Sprintf("%.0f", r.rate)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.0f | %.0f | %.0f | %.1f | %.1f%% | %d |\n", r.load, r.profile, rate,
			r.r.TTFT.P50Ms, r.r.TTFT.P90Ms, r.r.TTFT.P99Ms, r.r.RequestThroughput, 100*r.r.PrefixCacheHitRate, r.r.Failed)
	}
	return b.String()
}

// TestQualitySmoke is the seconds-long variant: a tiny shared-prefix
// workload on four fast simulators whose KV caches hold only part of it.
// Prefix-aware default routing must hit the cache clearly more often than
// round-robin.
func TestQualitySmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts four vllm-sim processes")
	}
	f := startFleet(t, fleetConfig{sims: 4, timeScale: 20, gpuBlocks: 96, scrape: 20 * time.Millisecond})
	w := load.Workload{Kind: load.WorkloadSharedPrefix, Groups: 8, UsersPerGroup: 4, SystemLen: 256, QuestionLen: 16, Output: load.Fixed(8)}
	warm := load.Stage{Rate: 40, Duration: time.Second}
	measure := load.Stage{Rate: 40, Duration: 2 * time.Second}
	rr := f.run("round-robin", w, load.ArrivalPoisson, warm, measure, 11)
	def := f.run("default", w, load.ArrivalPoisson, warm, measure, 12)
	t.Logf("\n%s", table([]row{{"smoke", "round-robin", 40, rr}, {"smoke", "default", 40, def}}))
	if rr.Completed == 0 || def.Completed == 0 || rr.Failed+def.Failed > 0 {
		t.Fatalf("completed %d/%d, failed %d/%d", rr.Completed, def.Completed, rr.Failed, def.Failed)
	}
	if def.PrefixCacheHitRate < rr.PrefixCacheHitRate+0.15 {
		t.Errorf("prefix hit rate: default %.2f, round-robin %.2f; want default clearly higher", def.PrefixCacheHitRate, rr.PrefixCacheHitRate)
	}
}

// TestQuality is the full comparison (tens of minutes): set
// SWITCHYARD_QUALITY=1. It measures round-robin's saturation rate on the
// shared-prefix workload, then runs each profile unloaded (10 % of it,
// after a warm-up at 50 %, so the prefixes are cached) and at 50, 80 and
// 95 %; the two candidate profiles (weighted, predicted-ttft) repeat their
// 80 and 95 % runs SWITCHYARD_QUALITY_RUNS times. Then a workload without
// shared prefixes and a mixed one (prompts of 100-8,000 tokens, answers
// of 16-1,024) at 80 % of round-robin's saturation on each (for the mixed
// one, its closed-loop throughput: its answers outlast the sweep's
// stages). Knobs:
// SWITCHYARD_QUALITY_SCALE (simulator -time-scale, default 1),
// SWITCHYARD_QUALITY_SECONDS (measured seconds per run, default 15),
// SWITCHYARD_QUALITY_BLOCKS (-num-gpu-blocks, 3000), SWITCHYARD_QUALITY_SEQS
// (-max-num-seqs, simulator default 256), SWITCHYARD_QUALITY_GROUPS /
// _USERS / _SYSTEM / _OUTPUT (the shared-prefix workload: 32 x 16, 2048
// tokens, 128), SWITCHYARD_QUALITY_PROFILES (comma list),
// SWITCHYARD_QUALITY_ONLY (prefix, random or mixed),
// SWITCHYARD_QUALITY_RR_SAT / _RANDOM_SAT / _MIXED_SAT (skip a saturation
// measurement), SWITCHYARD_QUALITY_METRICS_DELAY (vllm-sim -metrics-delay,
// e.g. 4ms: each page answered as slowly as real vLLM's).
func TestQuality(t *testing.T) {
	if os.Getenv("SWITCHYARD_QUALITY") == "" {
		t.Skip("set SWITCHYARD_QUALITY=1 to run the routing-quality comparison (minutes)")
	}
	scale := envFloat("SWITCHYARD_QUALITY_SCALE", 1)
	secs := envFloat("SWITCHYARD_QUALITY_SECONDS", 15)
	blocks := int(envFloat("SWITCHYARD_QUALITY_BLOCKS", 3000))
	seqs := int(envFloat("SWITCHYARD_QUALITY_SEQS", 0))
	var simArgs []string
	if seqs > 0 {
		simArgs = []string{"-max-num-seqs", strconv.Itoa(seqs)}
	}
	f := startFleet(t, fleetConfig{sims: 4, timeScale: scale, gpuBlocks: blocks, scrape: 50 * time.Millisecond, simArgs: simArgs})
	w := load.Workload{Kind: load.WorkloadSharedPrefix,
		Groups: int(envFloat("SWITCHYARD_QUALITY_GROUPS", 32)), UsersPerGroup: int(envFloat("SWITCHYARD_QUALITY_USERS", 16)),
		SystemLen: int(envFloat("SWITCHYARD_QUALITY_SYSTEM", 2048)), QuestionLen: 128, Output: load.Fixed(int(envFloat("SWITCHYARD_QUALITY_OUTPUT", 128)))}
	q := &experiment{t: t, f: f, dur: time.Duration(secs * float64(time.Second)), seed: 100,
		runs: int(envFloat("SWITCHYARD_QUALITY_RUNS", 1)), conc: int(envFloat("SWITCHYARD_QUALITY_CONCURRENCY", 160))}
	q.warm = q.dur / 3
	defer func() {
		seqsNote := "256"
		if seqs > 0 {
			seqsNote = strconv.Itoa(seqs)
		}
		fmt.Printf("\nRouting quality: 4 x vllm-sim (-time-scale %g, -num-gpu-blocks %d, -max-num-seqs %s), shared prefix %d x %d users, %d-token system prompt; measured %v per run after %v warm-up\n\n%s\n%s\n",
			scale, blocks, seqsNote, w.Groups, w.UsersPerGroup, w.SystemLen, q.dur, q.warm, table(q.rows), strings.Join(q.summary, "\n"))
	}()
	only := os.Getenv("SWITCHYARD_QUALITY_ONLY")
	if only == "" || only == "prefix" {
		q.prefixRuns(w)
	}
	if only == "" || only == "random" {
		q.otherRuns("random", load.Workload{Kind: load.WorkloadRandom, Input: load.Range{Min: 256, Max: 2048}, Output: load.Fixed(128)}, "SWITCHYARD_QUALITY_RANDOM_SAT", false)
	}
	if only == "" || only == "mixed" {
		q.otherRuns("mixed", load.Workload{Kind: load.WorkloadRandom, Input: load.Range{Min: 100, Max: 8000}, Output: load.Range{Min: 16, Max: 1024}}, "SWITCHYARD_QUALITY_MIXED_SAT", true)
	}
}

// experiment is one TestQuality run: its fleet, settings and results.
type experiment struct {
	t          *testing.T
	f          *fleet
	dur, warm  time.Duration
	seed       uint64
	runs, conc int
	rows       []row
	summary    []string
	// cold: every run starts cold (fleet.coldStart).
	cold bool
}

func (q *experiment) nextSeed() uint64 { q.seed++; return q.seed }

func (q *experiment) note(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	q.summary = append(q.summary, s)
	q.t.Log(s)
}

// saturation returns round-robin's saturation rate on w (or the value of
// env), adding the measurement's rows. With closedOnly it is the
// closed-loop throughput: requests that run for seconds outlast the
// sweep's stages, whose TTFTs then say nothing about the knee.
func (q *experiment) saturation(label string, w load.Workload, env string, closedOnly bool) float64 {
	if v := envFloat(env, 0); v > 0 {
		return v
	}
	closed := q.f.run("round-robin", w, load.ArrivalConcurrency, load.Stage{Concurrency: q.conc, Duration: q.warm}, load.Stage{Concurrency: q.conc, Duration: q.dur}, q.nextSeed())
	q.rows = append(q.rows, row{fmt.Sprintf("%s saturation (%d in flight)", label, q.conc), "round-robin", 0, closed})
	if closedOnly {
		q.note("%s: round-robin's closed-loop throughput (%d in flight) %.1f req/s", label, q.conc, closed.RequestThroughput)
		return closed.RequestThroughput
	}
	sat, sweep := q.f.saturation(w, closed, q.dur/2, q.nextSeed())
	for _, r := range sweep {
		q.rows = append(q.rows, row{label + " sweep", "round-robin", r.Rate, r})
	}
	q.note("%s: round-robin saturates at %.1f req/s", label, sat)
	return sat
}

// unloaded measures p at 10 % of sat after a warm-up at 50 %, so its
// prefixes are where it puts them.
func (q *experiment) unloaded(label, p string, w load.Workload, sat float64) load.StageReport {
	reps := q.f.runStages(p, w, load.ArrivalPoisson, []load.Stage{{Rate: sat / 2, Duration: q.warm}, {Rate: sat / 10, Duration: 2 * q.dur}}, q.nextSeed())
	r := reps[len(reps)-1]
	q.rows = append(q.rows, row{label + " unloaded (10%)", p, sat / 10, r})
	return r
}

func (q *experiment) at(label, p string, w load.Workload, rate float64, seed uint64, dur time.Duration) load.StageReport {
	r := q.f.run(p, w, load.ArrivalPoisson, load.Stage{Rate: rate, Duration: q.warm}, load.Stage{Rate: rate, Duration: dur}, seed)
	q.rows = append(q.rows, row{label, p, rate, r})
	q.t.Logf("%s %s: TTFT p50 %.0f ms, p90 %.0f ms, %.1f req/s, hit %.2f", label, p, r.TTFT.P50Ms, r.TTFT.P90Ms, r.RequestThroughput, r.PrefixCacheHitRate)
	return r
}

// candidates are the profiles the summary compares.
var candidates = []string{"weighted", "predicted-ttft"}

func (q *experiment) prefixRuns(w load.Workload) {
	profiles := []string{"round-robin", "random", "least-queue", "weighted", "predicted-ttft"}
	if p := os.Getenv("SWITCHYARD_QUALITY_PROFILES"); p != "" {
		profiles = strings.Split(p, ",")
	}
	if os.Getenv("SWITCHYARD_QUALITY_RR_SAT") == "" {
		for _, p := range profiles {
			if !slices.Contains(candidates, p) {
				continue
			}
			r := q.f.run(p, w, load.ArrivalConcurrency, load.Stage{Concurrency: q.conc, Duration: q.warm}, load.Stage{Concurrency: q.conc, Duration: q.dur}, q.nextSeed())
			q.rows = append(q.rows, row{fmt.Sprintf("shared-prefix saturation (%d in flight)", q.conc), p, 0, r})
			q.note("shared-prefix, %d in flight: %s %.1f req/s", q.conc, p, r.RequestThroughput)
		}
	}
	sat := q.saturation("shared-prefix", w, "SWITCHYARD_QUALITY_RR_SAT", false)
	type result struct {
		unloaded load.StageReport
		p90      map[float64][]float64
		hit      map[float64][]float64
	}
	res := map[string]*result{}
	for _, p := range profiles {
		r := &result{p90: map[float64][]float64{}, hit: map[float64][]float64{}}
		res[p] = r
		r.unloaded = q.unloaded("shared-prefix", p, w, sat)
		q.t.Logf("unloaded %s: TTFT p90 %.0f ms", p, r.unloaded.TTFT.P90Ms)
		for _, frac := range []float64{0.5, 0.8, 0.95} {
			n := 1
			if frac >= 0.8 && slices.Contains(candidates, p) {
				n = max(q.runs, 1)
			}
			for k := range n {
				label := fmt.Sprintf("shared-prefix %.0f%%", frac*100)
				if n > 1 {
					label += fmt.Sprintf(" (run %d)", k+1)
				}
				rep := q.at(label, p, w, frac*sat, q.nextSeed(), q.dur)
				r.p90[frac] = append(r.p90[frac], rep.TTFT.P90Ms)
				r.hit[frac] = append(r.hit[frac], rep.PrefixCacheHitRate)
			}
		}
	}
	base := res["weighted"]
	for _, p := range profiles {
		r := res[p]
		u := r.unloaded.TTFT.P90Ms
		line := fmt.Sprintf("shared-prefix %s: unloaded p90 %.0f ms", p, u)
		for _, frac := range []float64{0.8, 0.95} {
			lo, hi := slices.Min(r.p90[frac]), slices.Max(r.p90[frac])
			med := median(r.p90[frac])
			line += fmt.Sprintf("; %.0f%%: p90 %.0f ms (%.2fx unloaded", frac*100, med, med/u)
			if len(r.p90[frac]) > 1 {
				line += fmt.Sprintf(", %d runs %.0f-%.0f ms, max/min %.2f", len(r.p90[frac]), lo, hi, hi/lo)
			}
			line += fmt.Sprintf("), hit rate %.3f", median(r.hit[frac]))
			if base != nil && p != "weighted" {
				line += fmt.Sprintf(" (%.2fx weighted)", median(r.hit[frac])/median(base.hit[frac]))
			}
		}
		q.note("%s", line)
	}
}

// otherRuns: a workload without shared prefixes at 80 % of round-robin's
// saturation rate on it, every profile on the same seed (the prompts
// share nothing, so each run sees the same arrivals and prompts).
func (q *experiment) otherRuns(label string, w load.Workload, satEnv string, closedOnly bool) {
	sat := q.saturation(label, w, satEnv, closedOnly)
	profiles := []string{"least-queue", "weighted", "predicted-ttft"}
	p90 := map[string][]float64{}
	n := max(q.runs, 1)
	for k := range n {
		// One seed per round, the profiles in turn within it.
		seed := q.nextSeed()
		l := label + " 80%"
		if n > 1 {
			l += fmt.Sprintf(" (run %d)", k+1)
		}
		for _, p := range profiles {
			r := q.at(l, p, w, 0.8*sat, seed, 2*q.dur)
			p90[p] = append(p90[p], r.TTFT.P90Ms)
		}
	}
	lq := median(p90["least-queue"])
	for _, p := range profiles {
		line := fmt.Sprintf("%s 80%%: %s p90 %.0f ms", label, p, median(p90[p]))
		if n > 1 {
			line += fmt.Sprintf(" (median of %d, %.0f-%.0f)", n, slices.Min(p90[p]), slices.Max(p90[p]))
		}
		if p != "least-queue" {
			line += fmt.Sprintf(", %.3fx least-queue", median(p90[p])/lq)
		}
		q.note("%s", line)
	}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func envFloat(name string, def float64) float64 {
	if v := os.Getenv(name); v != "" {
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			return f
		}
	}
	return def
}
