package quality

import (
	"context"
	"fmt"
	"net"
	"os"
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
}

// fleet is N vllm-sim processes behind one picker (or several replicas)
// and the data plane.
type fleet struct {
	t       testing.TB
	url     string
	addrs   []string
	pub     *registry.Publisher
	srvs    []*picker.Server
	version uint64
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
	for i := range cfg.sims {
		port := testutil.FreePort(t)
		args := append([]string{"-port", strconv.Itoa(port), "-model", modelName,
			"-time-scale", strconv.FormatFloat(cfg.timeScale, 'g', -1, 64),
			"-num-gpu-blocks", strconv.Itoa(cfg.gpuBlocks), "-seed", strconv.Itoa(i + 1), "-log-level", "warn"}, cfg.simArgs...)
		testutil.Start(t, fmt.Sprintf("vllm-sim-%d", i), bin, args...)
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(port))
	}
	for _, a := range addrs {
		testutil.WaitHTTP(t, "http://"+a+"/health", 15*time.Second)
	}
	sort.Strings(addrs)
	f := &fleet{t: t, addrs: addrs}
	f.pub = registry.NewPublisher(f.state(nil))
	var pickerAddrs []string
	var meshes []*peers.Mesh
	for i := range replicas {
		srv := picker.New(f.pub, picker.Options{Metrics: metrics.Options{Interval: cfg.scrape}}, nil)
		f.srvs = append(f.srvs, srv)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		pickerAddrs = append(pickerAddrs, lis.Addr().String())
		g := grpc.NewServer(srv.GRPCServerOptions()...)
		srv.Register(g)
		if share {
			m := peers.New(srv, peers.Options{Self: fmt.Sprintf("replica-%d", i)})
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
	f.url = startDataPlane(t, pickerAddrs...)
	return f
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
	f.t.Helper()
	est := closed.RequestThroughput
	var stages []load.Stage
	for _, k := range []float64{0.9, 1.05, 1.2, 1.35, 1.5, 1.7, 1.9} {
		stages = append(stages, load.Stage{Rate: est * k, Duration: step})
	}
	reps := f.runStages("round-robin", w, load.ArrivalPoisson, stages, seed)
	best := stages[0].Rate
	for i, r := range reps {
		if r.TTFT.P50Ms > 1.5*reps[0].TTFT.P50Ms || r.Failed > 0 {
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

// TestQuality is the full comparison (minutes): set SWITCHYARD_QUALITY=1.
// Knobs: SWITCHYARD_QUALITY_SCALE (simulator -time-scale, default 1),
// SWITCHYARD_QUALITY_SECONDS (measured seconds per run, default 15).
func TestQuality(t *testing.T) {
	if os.Getenv("SWITCHYARD_QUALITY") == "" {
		t.Skip("set SWITCHYARD_QUALITY=1 to run the routing-quality comparison (minutes)")
	}
	scale := envFloat("SWITCHYARD_QUALITY_SCALE", 1)
	secs := envFloat("SWITCHYARD_QUALITY_SECONDS", 15)
	blocks := int(envFloat("SWITCHYARD_QUALITY_BLOCKS", 3000))
	f := startFleet(t, fleetConfig{sims: 4, timeScale: scale, gpuBlocks: blocks, scrape: 50 * time.Millisecond})
	w := load.Workload{Kind: load.WorkloadSharedPrefix,
		Groups: int(envFloat("SWITCHYARD_QUALITY_GROUPS", 32)), UsersPerGroup: int(envFloat("SWITCHYARD_QUALITY_USERS", 16)),
		SystemLen: int(envFloat("SWITCHYARD_QUALITY_SYSTEM", 2048)), QuestionLen: 128, Output: load.Fixed(int(envFloat("SWITCHYARD_QUALITY_OUTPUT", 128)))}
	dur := time.Duration(secs * float64(time.Second))
	warmDur := dur / 3
	seed := uint64(100)
	next := func() uint64 { seed++; return seed }
	var rows []row
	defer func() {
		fmt.Printf("\nRouting quality: 4 x vllm-sim (-time-scale %g, -num-gpu-blocks %d), measured %v per run after %v warm-up\n\n%s\n",
			scale, blocks, dur, warmDur, table(rows))
	}()
	only := os.Getenv("SWITCHYARD_QUALITY_ONLY") // "prefix" or "random"
	conc := int(envFloat("SWITCHYARD_QUALITY_CONCURRENCY", 160))
	if only != "random" {
		rows = append(rows, f.prefixRuns(t, w, conc, dur, warmDur, next)...)
	}
	if only != "prefix" {
		rows = append(rows, f.randomRuns(t, conc, dur, warmDur, next)...)
	}
}

func (f *fleet) prefixRuns(t *testing.T, w load.Workload, conc int, dur, warmDur time.Duration, next func() uint64) []row {
	var rows []row
	// Saturation: closed loop, enough requests in flight to queue everywhere.
	sat := map[string]load.StageReport{}
	for _, p := range []string{"round-robin", "default"} {
		r := f.run(p, w, load.ArrivalConcurrency, load.Stage{Concurrency: conc, Duration: warmDur}, load.Stage{Concurrency: conc, Duration: dur}, next())
		sat[p] = r
		rows = append(rows, row{fmt.Sprintf("shared-prefix saturation (%d in flight)", conc), p, 0, r})
		t.Logf("saturation %s: %.1f req/s", p, r.RequestThroughput)
	}
	rrSat, sweep := f.saturation(w, sat["round-robin"], dur/2, next())
	for _, r := range sweep {
		rows = append(rows, row{"shared-prefix sweep", "round-robin", r.Rate, r})
	}
	t.Logf("round-robin saturation rate: %.1f req/s", rrSat)
	for _, frac := range []float64{0.5, 0.8, 0.95} {
		rate := frac * rrSat
		for _, p := range []string{"round-robin", "random", "least-queue", "default"} {
			r := f.run(p, w, load.ArrivalPoisson, load.Stage{Rate: rate, Duration: warmDur}, load.Stage{Rate: rate, Duration: dur}, next())
			rows = append(rows, row{fmt.Sprintf("shared-prefix %.0f%%", frac*100), p, rate, r})
			t.Logf("%.0f%% %s: TTFT p90 %.0f ms, %.1f req/s, hit %.2f", frac*100, p, r.TTFT.P90Ms, r.RequestThroughput, r.PrefixCacheHitRate)
		}
	}
	return rows
}

// randomRuns: no shared prefix, random prompts at 80% of round-robin's
// saturation rate on that workload.
func (f *fleet) randomRuns(t *testing.T, conc int, dur, warmDur time.Duration, next func() uint64) []row {
	var rows []row
	rw := load.Workload{Kind: load.WorkloadRandom, Input: load.Range{Min: 256, Max: 2048}, Output: load.Fixed(128)}
	rrate := envFloat("SWITCHYARD_QUALITY_RANDOM_SAT", 0) // skip the measurement when set
	if rrate == 0 {
		rsat := f.run("round-robin", rw, load.ArrivalConcurrency, load.Stage{Concurrency: conc, Duration: warmDur}, load.Stage{Concurrency: conc, Duration: dur}, next())
		rows = append(rows, row{fmt.Sprintf("random saturation (%d in flight)", conc), "round-robin", 0, rsat})
		var rsweep []load.StageReport
		rrate, rsweep = f.saturation(rw, rsat, dur/2, next())
		for _, r := range rsweep {
			rows = append(rows, row{"random sweep", "round-robin", r.Rate, r})
		}
	}
	// Same seed for both: random prompts share nothing, so the runs see
	// identical arrivals and prompts.
	rseed := next()
	profiles := []string{"least-queue", "default"}
	if p := os.Getenv("SWITCHYARD_QUALITY_RANDOM_PROFILES"); p != "" {
		profiles = strings.Split(p, ";")
	}
	for _, p := range profiles {
		rate := 0.8 * rrate
		r := f.run(p, rw, load.ArrivalPoisson, load.Stage{Rate: rate, Duration: warmDur}, load.Stage{Rate: rate, Duration: 2 * dur}, rseed)
		rows = append(rows, row{"random 80%", p, rate, r})
		t.Logf("random 80%% %s: TTFT p90 %.0f ms, %.1f req/s", p, r.TTFT.P90Ms, r.RequestThroughput)
	}
	return rows
}

func envFloat(name string, def float64) float64 {
	if v := os.Getenv(name); v != "" {
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			return f
		}
	}
	return def
}
