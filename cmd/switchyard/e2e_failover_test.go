package main

// End-to-end failover of the picker (issue 23): a replica that dies must
// fail no request that was not using it, and a picker that stalls for a
// second must fail none at all.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker"
)

// pickerStats reads Envoy's counters of the picker cluster whose names
// match re (an /stats filter), for the logs.
func pickerStats(envoyAdm, re string) string {
	out, _ := httpGetString(envoyAdm + "/stats?filter=" + re)
	return strings.Join(strings.Fields(out), " ")
}

// TestE2EReplicaDeathFailsNoNewRequest kills (SIGKILL) a replica that does
// not hold Envoy's ADS stream under steady load on a fail-closed pool, 20
// times, restarting it each time: every request that started after a
// kill, and ended before the next one, succeeds. Those requests cannot be
// using the dead picker, so none may fail because of it: Envoy retries
// the ext_proc stream elsewhere when it cannot reach the dead picker (its
// first streams find the connection refused or reset before anything
// ejected it). Requests whose stream was open at a kill may fail; they
// are counted and logged.
func TestE2EReplicaDeathFailsNoNewRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, three switchyards and simulators")
	}
	t.Parallel()
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newReplicaFleet(t, 3, fmt.Sprintf(`pool "main" {
  failure_mode = "fail_closed"
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), replicaOptions{peers: true})
	var ads string
	testutil.Eventually(t, 10*time.Second, "an ADS stream", func() error {
		if ads = f.adsReplica(); ads == "" {
			return errors.New("no replica holds the stream")
		}
		return nil
	})
	var victims []*replicaProc
	for _, r := range f.replicas {
		if r.id != ads {
			victims = append(victims, r)
		}
	}
	fl := &fleet{listen: f.listen}
	// Short streamed answers (20 tokens, a few ms at the simulators'
	// 50x) from 8 workers: every picker has streams opening all the time.
	l := startLoader(t, fl, 8, 2*time.Millisecond, func(w, i int) infReq {
		return infReq{model: "m-a", prompt: fmt.Sprintf("worker %d request %d", w, i), maxTokens: 20, stream: true}
	})
	l.waitFor(t, 100, time.Time{}, 20*time.Second, "load before the first kill")

	const cycles = 20
	var kills []time.Time
	for c := range cycles {
		v := victims[c%len(victims)]
		// The kill time is taken before the signal: Kill returns once
		// the process is reaped, after Envoy may have seen it die.
		killed := time.Now()
		v.process().Kill()
		kills = append(kills, killed)
		// Requests keep starting while the picker is dead: at least 50
		// of them before it comes back.
		l.waitFor(t, 50, killed, 20*time.Second, "load after a kill")
		f.start(v)
		testutil.Eventually(t, 20*time.Second, v.id+" healthy in Envoy again", func() error {
			healthy, err := f.healthyPickers()
			if err != nil {
				return err
			}
			if !slices.Contains(healthy, v.extproc) {
				return fmt.Errorf("healthy pickers %v", healthy)
			}
			return nil
		})
	}
	l.waitFor(t, 50, time.Now(), 20*time.Second, "load after the last restart")
	l.stopLoad()

	all := l.outcomes()
	var after, open []outcome
	for _, o := range all {
		// kills[i] is the first kill at or after the request's start.
		i, _ := slices.BinarySearchFunc(kills, o.start, func(k, s time.Time) int { return k.Compare(s) })
		if i < len(kills) && kills[i].Before(o.end) {
			open = append(open, o) // a kill caught it in flight
			continue
		}
		if i > 0 {
			after = append(after, o)
		}
	}
	n, ex := failures(after)
	nOpen, exOpen := failures(open)
	t.Logf("%d kills of a non-ADS replica; %d requests in all; %d started after a kill and ended before the next, %d failed %q; "+
		"%d were in flight at a kill, %d failed %q; Envoy: %s", cycles, len(all), len(after), n, ex, len(open), nOpen, exOpen,
		pickerStats(f.envoyAdm, `cluster\.switchyard/picker\.(upstream_rq_retry|upstream_rq_retry_success|upstream_cx_connect_fail|outlier_detection\.ejections_enforced_total|upstream_rq_retry_limit_exceeded)$`))
	if len(after) < cycles*50 {
		t.Errorf("only %d requests started after the kills", len(after))
	}
	if n > 0 {
		t.Errorf("%d of %d requests that started after a kill failed: %q", n, len(after), ex)
	}
}

// openLoop starts a request every interval, each in its own goroutine
// (open loop: a stalled request does not hold back the next), until
// stop; outcomes returns what finished.
type openLoop struct {
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	outs  []outcome
}

func startOpenLoop(t *testing.T, base string, every time.Duration, next func(i int) infReq) *openLoop {
	l := &openLoop{stopc: make(chan struct{})}
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-l.stopc:
				return
			case <-tick.C:
			}
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				o := outcome{start: time.Now()}
				resp, err := sendTo(client, base, next(i), nil)
				o.end = time.Now()
				switch {
				case err != nil:
					o.err = err.Error()
				case resp.status != http.StatusOK:
					o.err = fmt.Sprintf("status %d: %s", resp.status, truncate(string(resp.body), 200))
				default:
					o.ok = true
				}
				l.mu.Lock()
				l.outs = append(l.outs, o)
				l.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(l.stop)
	return l
}

// stop ends the sending and waits for the requests in flight; safe to
// call twice.
func (l *openLoop) stop() {
	select {
	case <-l.stopc:
	default:
		close(l.stopc)
	}
	l.wg.Wait()
}

func (l *openLoop) outcomes() []outcome {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.outs)
}

// TestE2EPickerStallFailsNothing stops (SIGSTOP) the only switchyard, the
// picker of a fail-closed pool, for 1 s and then for 2 s under steady
// load through Envoy: no request fails. A stalled picker (a GC pause, a
// busy VM not scheduling it) keeps its connections, so only Envoy's health
// checks could take it out; they must not before about 3 s without an
// answer (ir.DefaultPickerHealthTimeout x ir.DefaultPickerUnhealthyThreshold),
// while a picker that really died is still taken out at once
// (TestE2EReplicaDeathFailsNoNewRequest, TestE2EPickerDown).
func TestE2EPickerStallFailsNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and simulators")
	}
	t.Parallel()
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf(`pool "main" {
  failure_mode = "fail_closed"
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), fleetOptions{})
	// A request every 10 ms whatever the others do: during a stall they
	// pile up waiting for the picker.
	l := startOpenLoop(t, "http://"+f.listen, 10*time.Millisecond, func(i int) infReq {
		return infReq{model: "m-a", prompt: fmt.Sprintf("request %d", i), maxTokens: 20, stream: true}
	})
	f.mu.Lock()
	sy := f.sy
	f.mu.Unlock()
	// A failed test must not leave the process stopped.
	t.Cleanup(func() { _ = sy.Signal(syscall.SIGCONT) })
	waitDone := func(n int, from time.Time, what string) {
		testutil.Eventually(t, 20*time.Second, what, func() error {
			if got := len(between(l.outcomes(), from, time.Time{})); got < n {
				return fmt.Errorf("%d of %d requests", got, n)
			}
			return nil
		})
	}
	waitDone(100, time.Time{}, "load before the stalls")
	for _, stall := range []time.Duration{time.Second, 2 * time.Second} {
		if err := sy.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		// The stall is the condition under test, not a wait for an outcome.
		time.Sleep(stall)
		if err := sy.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		waitDone(100, time.Now(), "load after the stall")
		during := between(l.outcomes(), stopped, stopped.Add(stall))
		slowest := time.Duration(0)
		for _, o := range during {
			slowest = max(slowest, o.end.Sub(o.start))
		}
		t.Logf("%v stall: %d requests started during it, the slowest took %v; Envoy: %s", stall, len(during), slowest.Round(time.Millisecond),
			pickerStats(f.envoyAdm, `cluster\.switchyard/picker\.(health_check\.(failure|network_failure)|outlier_detection\.ejections_enforced_total)$`))
		if len(during) < int(stall/(20*time.Millisecond)) {
			t.Errorf("only %d requests started during the %v stall", len(during), stall)
		}
	}
	l.stop()
	all := l.outcomes()
	if n, ex := failures(all); n > 0 {
		t.Errorf("%d of %d requests failed across the stalls: %q", n, len(all), ex)
	}
}

// TestE2EReplicaRestartReadyOnlyInStep kills (SIGKILL) and restarts one of
// three replicas (static peers, each with its own -store) ten times and,
// from the moment it starts, reads its readiness as tightly as it can:
// /readyz and the picker's readiness health service (what Envoy's picker
// cluster checks). Whenever either says ready, the replica must already
// serve the ClusterLoadAssignment versions the other two serve and list
// all three replicas. (It once was ready at once on its persisted state,
// which had no replicas: a picker cluster of itself alone.) After each
// restart the pick sharing rejoins both ways within a second, and at the
// end every replica names the others by their -replica-id in its status
// and its metrics, although the configuration lists addresses.
func TestE2EReplicaRestartReadyOnlyInStep(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three switchyards and simulators")
	}
	t.Parallel()
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	// No Envoy: what a replica serves is read from its own status.
	f := &replicaFleet{t: t, dir: t.TempDir(), listen: testutil.FreeAddr(t)}
	var peers []string
	for i := range 3 {
		r := &replicaProc{id: fmt.Sprintf("r%d", i+1), extproc: testutil.FreeAddr(t), xds: testutil.FreeAddr(t), admin: testutil.FreeAddr(t)}
		r.args = []string{"-store", filepath.Join(t.TempDir(), r.id+".db")}
		f.replicas = append(f.replicas, r)
		peers = append(peers, strconv.Quote(r.extproc))
	}
	testutil.WriteFile(t, f.dir, "switchyard.hcl", fmt.Sprintf(`listener "public" {
  address = %q
}
replicas {
  peers = [%s]
}
pool "main" {
  failure_mode = "fail_closed"
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, f.listen, strings.Join(peers, ", "), s1.Addr, s2.Addr))
	t.Cleanup(func() {
		for _, r := range f.replicas {
			r.mu.Lock()
			procs := append(append([]*testutil.Process(nil), r.old...), r.proc)
			r.mu.Unlock()
			for _, p := range procs {
				if p != nil {
					p.Stop()
					if t.Failed() {
						t.Logf("--- output of %s ---\n%s", p.Name, tail(p.Output(), 4000))
					}
				}
			}
		}
	})
	for _, r := range f.replicas {
		f.start(r)
	}
	// What the others serve: every replica the same versions and all
	// three replicas.
	var want string
	testutil.Eventually(t, 20*time.Second, "the replicas agree", func() error {
		want = ""
		for _, r := range f.replicas {
			st, err := r.status()
			if err != nil {
				return err
			}
			v := st.XDS.Versions["ClusterLoadAssignment"]
			if len(st.Replicas) != 3 || v == "" || want != "" && v != want {
				return fmt.Errorf("%s serves %q with %d replicas (others %q)", r.id, v, len(st.Replicas), want)
			}
			want = v
		}
		return nil
	})

	victim := f.replicas[1]
	conn, err := grpc.NewClient(victim.extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	grpcReady := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		r, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: picker.HealthExtProc})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}
	httpReady := func() bool {
		resp, err := http.Get("http://" + victim.admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	const restarts = 10
	samples, readySamples := 0, 0
	var readyAfter, rejoined []time.Duration
	for i := range restarts {
		victim.process().Kill()
		started := time.Now()
		p := f.launch(victim)
		// Read until the replica has been ready for 100 ms.
		var firstReady time.Time
		for firstReady.IsZero() || time.Since(firstReady) < 100*time.Millisecond {
			if p.Exited() {
				t.Fatalf("restart %d: %s exited:\n%s", i, victim.id, tail(p.Output(), 4000))
			}
			if time.Since(started) > 20*time.Second {
				t.Fatalf("restart %d: %s not ready within 20 s", i, victim.id)
			}
			h, g := httpReady(), grpcReady()
			st, err := victim.status()
			samples++
			if !h && !g || err != nil {
				continue
			}
			readySamples++
			if firstReady.IsZero() {
				firstReady = time.Now()
				readyAfter = append(readyAfter, firstReady.Sub(started))
			}
			if v := st.XDS.Versions["ClusterLoadAssignment"]; v != want || len(st.Replicas) != 3 {
				t.Fatalf("restart %d, +%v: ready (/readyz %v, gRPC %v) while serving ClusterLoadAssignment %q with %d replicas; the others serve %q with 3",
					i, time.Since(started).Round(time.Millisecond), h, g, v, len(st.Replicas), want)
			}
			if !st.Ready {
				t.Errorf("restart %d: /readyz %v, gRPC %v, but /api/status says not ready: %s", i, h, g, st.NotReady)
			}
		}
		// The pick sharing rejoins: both ways, with every other replica.
		testutil.Eventually(t, 10*time.Second, "the restarted replica shares picks again", func() error {
			return sharingEverywhere(f.replicas)
		})
		rejoined = append(rejoined, time.Since(started))
	}
	t.Logf("%d restarts: %d reads, %d of them ready, all in step with the others; ready %v after each start; "+
		"picks shared both ways with every replica %v after each start", restarts, samples, readySamples, readyAfter, rejoined)
	slices.Sort(rejoined)
	if median := rejoined[len(rejoined)/2]; median > time.Second {
		t.Errorf("pick sharing rejoined a median %v after the restart, want within a second", median)
	}

	// One name per replica everywhere: each row of every replica's status
	// and every peer label of its metrics is a -replica-id, never a static
	// peer's address.
	for _, r := range f.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		for _, rep := range st.Replicas {
			if want := f.byAddr(rep.Address).id; rep.ID != want || !rep.Self && rep.From != want {
				t.Errorf("%s lists %s as %q (from %q), want %q", r.id, rep.Address, rep.ID, rep.From, want)
			}
		}
		m, err := httpGetString("http://" + r.admin + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		for _, other := range f.replicas {
			if other == r {
				continue
			}
			for _, series := range []string{"switchyard_replica_sharing", "switchyard_replica_lag_seconds", "switchyard_replica_events_dropped_total"} {
				if !strings.Contains(m, series+`{peer="`+other.id+`"}`) {
					t.Errorf("%s /metrics has no %s for %s", r.id, series, other.id)
				}
			}
			if strings.Contains(m, `peer="`+other.extproc+`"`) {
				t.Errorf("%s /metrics labels %s by its address %s", r.id, other.id, other.extproc)
			}
		}
	}
}

// sharingEverywhere reports nil once every replica streams its picks to
// every other and receives theirs.
func sharingEverywhere(rs []*replicaProc) error {
	for _, r := range rs {
		st, err := r.status()
		if err != nil {
			return err
		}
		for _, rep := range st.Replicas {
			if !rep.Self && (!rep.Sharing || rep.From == "") {
				return fmt.Errorf("%s: replica %s sharing %v, from %q", r.id, rep.Address, rep.Sharing, rep.From)
			}
		}
	}
	return nil
}

func (f *replicaFleet) byAddr(extproc string) *replicaProc {
	for _, r := range f.replicas {
		if r.extproc == extproc {
			return r
		}
	}
	return &replicaProc{}
}
