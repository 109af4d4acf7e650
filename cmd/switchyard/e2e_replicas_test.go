package main

// End-to-end replicas (issue 12): several switchyard processes serving one
// configuration, one real Envoy using all of them.

import (
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/testutil"
)

// replicaProc is one switchyard replica of a replicaFleet.
type replicaProc struct {
	id, extproc, xds, admin string
	args                    []string
	env                     []string
	mu                      sync.Mutex
	proc                    *testutil.Process
	old                     []*testutil.Process
}

// replicaFleet is several switchyard replicas reading one configuration
// directory, and one Envoy whose bootstrap lists every replica's xDS
// server.
type replicaFleet struct {
	t        *testing.T
	dir      string
	listen   string
	replicas []*replicaProc
	nodeID   string
	envoyAdm string
	client   *http.Client
}

// replicaOptions tune newReplicaFleet.
type replicaOptions struct {
	// peers puts a static peers list of every replica in the
	// configuration's replicas block.
	peers bool
	// extraReplicasBlock is more content of the replicas block.
	extraReplicasBlock string
	// prelude goes before everything else in the configuration (a top-level
	// consul block, say).
	prelude string
	// env is extra environment for every replica.
	env []string
	// store gives every replica a -store of its own.
	store bool
	// args are more serve flags for every replica.
	args []string
}

func newReplicaFleet(t *testing.T, n int, body string, o replicaOptions) *replicaFleet {
	t.Helper()
	f := &replicaFleet{t: t, dir: t.TempDir(), listen: testutil.FreeAddr(t), nodeID: "e2e-" + strings.ReplaceAll(t.Name(), "/", "-"),
		client: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}}
	t.Cleanup(f.client.CloseIdleConnections)
	var peers, xdsServers []string
	for i := range n {
		r := &replicaProc{id: fmt.Sprintf("r%d", i+1), extproc: testutil.FreeAddr(t), xds: testutil.FreeAddr(t), admin: testutil.FreeAddr(t), env: o.env}
		if o.store {
			r.args = []string{"-store", filepath.Join(t.TempDir(), r.id+".db")}
		}
		r.args = append(r.args, o.args...)
		f.replicas = append(f.replicas, r)
		peers = append(peers, strconv.Quote(r.extproc))
		xdsServers = append(xdsServers, r.xds)
	}
	block := o.extraReplicasBlock
	if o.peers {
		block += "\n  peers = [" + strings.Join(peers, ", ") + "]\n"
	}
	config := fmt.Sprintf("%s\nlistener \"public\" {\n  address = %q\n}\n\nreplicas {\n%s}\n\n%s", o.prelude, f.listen, block, body)
	testutil.WriteFile(t, f.dir, "switchyard.hcl", config)
	t.Cleanup(func() {
		for _, r := range f.replicas {
			r.mu.Lock()
			procs := append(append([]*testutil.Process(nil), r.old...), r.proc)
			r.mu.Unlock()
			for _, p := range procs {
				if p == nil {
					continue
				}
				p.Stop()
				if t.Failed() {
					t.Logf("--- output of %s (%s) ---\n%s", p.Name, r.id, tail(p.Output(), 6000))
				}
			}
		}
	})
	for _, r := range f.replicas {
		f.start(r)
	}
	adminPort := testutil.FreePort(t)
	f.envoyAdm = fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	bs, err := envoy.Bootstrap(envoy.Params{NodeID: f.nodeID, NodeCluster: "e2e", XDSServers: xdsServers, AdminPort: adminPort})
	if err != nil {
		t.Fatal(err)
	}
	path := testutil.WriteFile(t, t.TempDir(), "envoy.yaml", bs)
	ev := testutil.Start(t, "envoy", testutil.EnvoyPath(t), "-c", path, "--use-dynamic-base-id", "-l", "warning", "--concurrency", "2")
	testutil.Eventually(t, 30*time.Second, "Envoy uses every replica", func() error {
		if ev.Exited() {
			return errors.New("envoy exited:\n" + tail(ev.Output(), 4000))
		}
		healthy, err := f.healthyPickers()
		if err != nil {
			return err
		}
		if len(healthy) != n {
			return fmt.Errorf("healthy pickers in Envoy: %v", healthy)
		}
		resp, err := f.client.Get("http://" + f.listen + "/e2e-probe")
		if err != nil {
			return err
		}
		resp.Body.Close()
		return nil
	})
	return f
}

// start starts (or restarts) replica r on its ports and waits for /readyz.
func (f *replicaFleet) start(r *replicaProc) {
	f.t.Helper()
	p := f.launch(r)
	testutil.Eventually(f.t, 20*time.Second, r.id+" /readyz", func() error {
		if p.Exited() {
			return errors.New(r.id + " exited:\n" + tail(p.Output(), 4000))
		}
		resp, err := http.Get("http://" + r.admin + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz %d", resp.StatusCode)
		}
		return nil
	})
}

// launch starts (or restarts) replica r on its ports without waiting.
func (f *replicaFleet) launch(r *replicaProc) *testutil.Process {
	f.t.Helper()
	args := append([]string{"serve", "-config", f.dir, "-extproc-addr", r.extproc, "-xds-addr", r.xds,
		"-admin-addr", r.admin, "-replica-id", r.id, "-log-level", "info"}, r.args...)
	p := testutil.StartNoCleanupEnv(f.t, "switchyard "+r.id, testutil.Binary(f.t, "switchyard"), r.env, args...)
	r.mu.Lock()
	if r.proc != nil {
		r.old = append(r.old, r.proc)
	}
	r.proc = p
	r.mu.Unlock()
	return p
}

func (r *replicaProc) process() *testutil.Process {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc
}

// status reads a replica's /api/status.
func (r *replicaProc) status() (*status, error) {
	f := &fleet{admin: r.admin}
	return f.status()
}

// healthyPickers lists the picker hosts Envoy's picker cluster holds as
// healthy.
func (f *replicaFleet) healthyPickers() ([]string, error) {
	out, err := httpGetString(f.envoyAdm + "/clusters")
	if err != nil {
		return nil, err
	}
	var hosts []string
	for _, l := range strings.Split(out, "\n") {
		rest, ok := strings.CutPrefix(l, "switchyard/picker::")
		if !ok {
			continue
		}
		addr, flags, ok := strings.Cut(rest, "::health_flags::")
		if ok && flags == "healthy" {
			hosts = append(hosts, addr)
		}
	}
	return hosts, nil
}

// adsReplica returns the replica holding the Envoy's ADS stream ("" none).
func (f *replicaFleet) adsReplica() string {
	for _, r := range f.replicas {
		st, err := r.status()
		if err != nil {
			continue
		}
		for _, n := range st.Envoys {
			if n.ID == f.nodeID && n.Streams > 0 {
				return r.id
			}
		}
	}
	return ""
}

func (f *replicaFleet) replica(id string) *replicaProc {
	for _, r := range f.replicas {
		if r.id == id {
			return r
		}
	}
	return nil
}

// TestE2EReplicas runs three replicas from a static peers list behind one
// Envoy: each lists all three and Envoy spreads ext_proc streams over
// them; when the replica holding Envoy's ADS stream is killed (SIGKILL)
// under load on a fail-closed pool, Envoy reconnects to another with no
// configuration churn, requests started more than a second after the
// kill all succeed, and the restarted replica takes traffic again.
func TestE2EReplicas(t *testing.T) {
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

	for _, r := range f.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		self := 0
		for _, rep := range st.Replicas {
			if rep.Self {
				self++
				if rep.Address != r.extproc {
					t.Errorf("%s marks %s as itself", r.id, rep.Address)
				}
			}
		}
		if len(st.Replicas) != 3 || self != 1 || st.ReplicaID != r.id {
			t.Fatalf("%s lists replicas %+v (self %d, id %q)", r.id, st.Replicas, self, st.ReplicaID)
		}
	}

	// Envoy spreads requests over the replicas' pickers.
	for i := range 60 {
		resp, err := sendTo(f.client, "http://"+f.listen, infReq{model: "m-a", prompt: fmt.Sprintf("spread %d", i), maxTokens: 1}, nil)
		checkOK(t, resp, err, "m-a")
	}
	for _, r := range f.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		if st.Picker.Picked == 0 {
			t.Errorf("replica %s picked nothing of 60 requests", r.id)
		}
	}

	// Kill the replica holding the ADS stream, under load.
	var ads string
	testutil.Eventually(t, 10*time.Second, "an ADS stream", func() error {
		if ads = f.adsReplica(); ads == "" {
			return errors.New("no replica holds the stream")
		}
		return nil
	})
	cdsVersion := func() string {
		out, _ := httpGetString(f.envoyAdm + "/stats?filter=^cluster_manager.cds.version_text$")
		return strings.TrimSpace(out)
	}
	// A reconnecting Envoy is sent the same versions again (the snapshot
	// cache answers a new stream in full); no cluster or listener may be
	// added or modified by that.
	updates := func() string {
		out, _ := httpGetString(f.envoyAdm + "/stats?filter=^(cluster_manager.cluster_(added|modified|removed)|listener_manager.listener_(added|modified|removed))$")
		return strings.TrimSpace(out)
	}
	versionBefore, updatesBefore := cdsVersion(), updates()
	fl := &fleet{listen: f.listen}
	// Streamed answers of 200 tokens (~30 ms at the simulators' 50x), so
	// that streams are open on the victim when it dies.
	l := startLoader(t, fl, 4, 5*time.Millisecond, func(w, i int) infReq {
		return infReq{model: "m-a", prompt: fmt.Sprintf("worker %d request %d", w, i), maxTokens: 200, stream: true}
	})
	l.waitFor(t, 100, time.Time{}, 20*time.Second, "load before the kill")
	victim := f.replica(ads)
	victim.process().Kill()
	killed := time.Now()
	testutil.Eventually(t, 20*time.Second, "Envoy's ADS stream on another replica", func() error {
		if now := f.adsReplica(); now == "" || now == ads {
			return fmt.Errorf("stream on %q", now)
		}
		return nil
	})
	l.waitFor(t, 600, killed.Add(time.Second), 60*time.Second, "load after the kill")
	if v, u := cdsVersion(), updates(); v != versionBefore || u != updatesBefore {
		t.Errorf("configuration churn on ADS failover: %q -> %q, updates %q -> %q", versionBefore, v, updatesBefore, u)
	}

	// The killed replica comes back and takes traffic within 3 s of
	// being ready.
	f.start(victim)
	back := time.Now()
	before, err := victim.status()
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 3*time.Second, "the restarted replica picks again", func() error {
		st, err := victim.status()
		if err != nil {
			return err
		}
		if st.Picker.Picked <= before.Picker.Picked {
			return errors.New("no pick yet")
		}
		return nil
	})
	rejoined := time.Since(back)
	l.stopLoad()

	all := l.outcomes()
	late := between(all, killed.Add(time.Second), time.Time{})
	n, ex := failures(late)
	early := between(all, killed, killed.Add(time.Second))
	nEarly, exEarly := failures(early)
	// Requests whose stream was open at the kill: those on the victim's
	// picker may fail (Envoy loses the ext_proc stream mid-answer).
	var open []outcome
	for _, o := range all {
		if o.start.Before(killed) && o.end.After(killed) {
			open = append(open, o)
		}
	}
	nOpen, exOpen := failures(open)
	t.Logf("ADS failover from %s; %d requests in all; %d open at the kill, %d failed (%.2f%% of the run) %q; "+
		"%d started in the second after it, %d failed %q; %d after that, %d failed; rejoined after %v",
		ads, len(all), len(open), nOpen, 100*float64(nOpen)/float64(len(all)), exOpen,
		len(early), nEarly, exEarly, len(late), n, rejoined.Round(time.Millisecond))
	if n > 0 {
		t.Errorf("%d of %d requests started more than 1 s after the kill failed: %q", n, len(late), ex)
	}
	if all, lost := len(all), nOpen+nEarly; float64(lost) > 0.01*float64(all) {
		t.Errorf("%d of %d requests lost to the kill (open then, or started within a second): want <= 1%%", lost, all)
	}
}

// add starts one more replica on fresh ports (not in Envoy's bootstrap:
// Envoy learns its picker through EDS).
func (f *replicaFleet) add(env []string) *replicaProc {
	f.t.Helper()
	r := &replicaProc{id: fmt.Sprintf("r%d", len(f.replicas)+1), extproc: testutil.FreeAddr(f.t), xds: testutil.FreeAddr(f.t), admin: testutil.FreeAddr(f.t), env: env}
	f.replicas = append(f.replicas, r)
	f.start(r)
	return r
}

// TestE2EReplicasConsul: replicas that find each other through Consul.
// Each registers itself (picker address, /readyz check) and lists the
// others; a replica started later joins every replica's list and Envoy's
// picker cluster without restarting anything, and one stopped leaves both
// at once (it deregisters on its way out).
func TestE2EReplicasConsul(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Consul, Envoy, switchyards and simulators")
	}
	t.Parallel()
	c := testutil.StartConsul(t)
	s1 := startSim(t, simOptions{})
	prelude := fmt.Sprintf("consul {\n  address = %q\n}\n", "http://"+c.Addr)
	f := newReplicaFleet(t, 2, fmt.Sprintf("pool \"main\" {\n  endpoints = [%q]\n}\nmodel \"m-a\" {\n  pool = \"main\"\n}\n", s1.Addr),
		replicaOptions{prelude: prelude, extraReplicasBlock: "  consul_service = \"switchyard\"\n"})
	listed := func(want int) error {
		for _, r := range f.replicas {
			if p := r.process(); p == nil || p.Exited() {
				continue
			}
			st, err := r.status()
			if err != nil {
				return err
			}
			if len(st.Replicas) != want {
				return fmt.Errorf("%s lists %d replicas, want %d", r.id, len(st.Replicas), want)
			}
		}
		healthy, err := f.healthyPickers()
		if err != nil {
			return err
		}
		if len(healthy) != want {
			return fmt.Errorf("Envoy's picker cluster has %v", healthy)
		}
		return nil
	}
	testutil.Eventually(t, 20*time.Second, "two replicas listed everywhere", func() error { return listed(2) })
	// Every replica says which one holds Envoy's ADS stream (it reads the
	// others' reports at the admin addresses they registered).
	testutil.Eventually(t, 20*time.Second, "every replica names the ADS replica's Envoy", func() error {
		ads := f.adsReplica()
		if ads == "" {
			return errors.New("no replica holds the stream")
		}
		holder := f.replica(ads).extproc
		for _, r := range f.replicas {
			st, err := r.status()
			if err != nil {
				return err
			}
			for _, rep := range st.Replicas {
				if rep.Address == holder && (!rep.EnvoysKnown || !slices.Contains(rep.Envoys, f.nodeID)) {
					return fmt.Errorf("%s says replica %s holds Envoys %v (known %v)", r.id, rep.ID, rep.Envoys, rep.EnvoysKnown)
				}
			}
		}
		return nil
	})

	r3 := f.add(nil)
	joined := time.Now()
	testutil.Eventually(t, 20*time.Second, "the third replica listed everywhere", func() error { return listed(3) })
	t.Logf("a new replica was in every list and in Envoy's picker cluster %v after it was ready", time.Since(joined).Round(time.Millisecond))
	testutil.Eventually(t, 10*time.Second, "the new replica picks", func() error {
		resp, err := sendTo(f.client, "http://"+f.listen, infReq{model: "m-a", prompt: "x", maxTokens: 1}, nil)
		checkOK(t, resp, err, "m-a")
		st, err := r3.status()
		if err != nil {
			return err
		}
		if st.Picker.Picked == 0 {
			return errors.New("no pick on the new replica yet")
		}
		return nil
	})

	r3.process().Stop()
	left := time.Now()
	testutil.Eventually(t, 20*time.Second, "the stopped replica gone everywhere", func() error { return listed(2) })
	t.Logf("a stopped replica left every list and Envoy's picker cluster %v after SIGTERM", time.Since(left).Round(time.Millisecond))
}

// TestE2EReplicasRollingUpgrade stops and restarts each of three replicas
// in turn (SIGTERM: each drains, then stops) under steady streaming load
// on a fail-closed pool: no request fails. Before that, the replicas share
// their picks (each counts the others' picks).
func TestE2EReplicasRollingUpgrade(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, three switchyards and simulators")
	}
	t.Parallel()
	s1, s2 := startSim(t, simOptions{timeScale: 10}), startSim(t, simOptions{timeScale: 10})
	f := newReplicaFleet(t, 3, fmt.Sprintf(`pool "main" {
  failure_mode = "fail_closed"
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), replicaOptions{peers: true})
	fl := &fleet{listen: f.listen}
	l := startLoader(t, fl, 6, 10*time.Millisecond, func(w, i int) infReq {
		return infReq{model: "m-a", prompt: fmt.Sprintf("worker %d request %d", w, i), maxTokens: 16, stream: i%2 == 0}
	})
	l.waitFor(t, 100, time.Time{}, 30*time.Second, "load before the upgrade")
	testutil.Eventually(t, 10*time.Second, "every replica learns the others' picks", func() error {
		for _, r := range f.replicas {
			st, err := r.status()
			if err != nil {
				return err
			}
			if st.Picker.PeerPicks == 0 {
				return fmt.Errorf("%s has no pick from the other replicas", r.id)
			}
		}
		return nil
	})
	start := time.Now()
	for _, r := range f.replicas {
		stopped := time.Now()
		old := r.process()
		old.Stop() // SIGTERM: drain, then stop
		t.Logf("%s stopped after %v: %s", r.id, time.Since(stopped).Round(time.Millisecond), grepLines(old.Output(), "drain"))
		f.start(r)
		before, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, 10*time.Second, r.id+" picks again", func() error {
			st, err := r.status()
			if err != nil {
				return err
			}
			if st.Picker.Picked <= before.Picker.Picked {
				return errors.New("no pick yet")
			}
			return nil
		})
		t.Logf("%s upgraded: stopped, restarted and picking %v after SIGTERM", r.id, time.Since(stopped).Round(time.Millisecond))
	}
	l.waitFor(t, 100, time.Now(), 30*time.Second, "load after the upgrade")
	l.stopLoad()
	outs := between(l.outcomes(), start, time.Time{})
	n, ex := failures(outs)
	t.Logf("rolling upgrade of 3 replicas: %d requests, %d failed %q", len(outs), n, ex)
	if n > 0 {
		t.Errorf("%d of %d requests failed during the rolling upgrade: %q", n, len(outs), ex)
	}
}
