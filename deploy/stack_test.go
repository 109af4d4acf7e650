package deploy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/deploy/composetest"
	"github.com/switchyard/switchyard/internal/testutil"
)

// The stack's model and the LoRA adapter only vllm-sim-3 serves.
const (
	stackModel = "meta-llama/Llama-3.1-8B-Instruct"
	stackLoRA  = "sql-lora"
	loraHost   = "vllm-sim-3"
	// loadWorkers is the number of requests in flight during a fault: a
	// killed process can fail at most the ones it was handling.
	loadWorkers = 4
	// faultRequests is how many requests a fault's window counts.
	faultRequests = 200
)

// TestComposeStack runs docker-compose.yaml in a real engine (issue 26):
// the unmodified file, moved only to a free subnet and loopback host ports
// and a project name of its own, with certificates devcerts writes under
// umask 077. It checks requests through Envoy, the faults the stack must
// survive with the failed requests counted, and the fixes of what the
// first real run found. It prints the fault table (docs/deployment.md):
//
//	make test-compose
func TestComposeStack(t *testing.T) {
	e := composetest.Require(t)
	s := startStack(t, e)

	t.Run("requests", s.checkRequests)
	t.Run("one-off-run", s.checkOneOffRun)
	t.Run("consul-quiet-and-offline", s.checkConsulQuiet)
	t.Run("kill-ads-replica", s.faultKillADSReplica)
	t.Run("crash-other-replica", s.faultCrashOtherReplica)
	t.Run("restart-consul", s.faultRestartConsul)
	t.Run("rotate-certificates", s.faultRotateCertificates)
	t.Run("down-up", s.faultDownUp)

	var b strings.Builder
	b.WriteString("| fault | requests | failed | notes |\n|---|---|---|---|\n")
	for _, r := range s.table {
		fmt.Fprintf(&b, "| %s | %d | %d | %s |\n", r.fault, r.requests, r.failed, r.notes)
	}
	t.Logf("fault table (%d workers, chat completions through Envoy; load %s):\n%s", loadWorkers, loadavg(), b.String())
}

// stack is the running compose project and how the test reaches it.
type stack struct {
	p        *composetest.Project
	reloc    composetest.Relocation
	tls      string // the certificates' directory (make compose-certs' output)
	envoy    string // http://127.0.0.1:port of Envoy's listener
	consul   string // http://127.0.0.1:port of Consul's HTTP API
	admin    map[string]string
	replicas []string
	sims     []string
	simAddr  map[string]string // service -> its moved ip:port
	client   *http.Client
	table    []faultRow
}

type faultRow struct {
	fault            string
	requests, failed int
	notes            string
}

// startStack brings the stack up on a free subnet and loopback ports with
// freshly generated certificates, and waits until every service is
// healthy.
func startStack(t *testing.T, e *composetest.Engine) *stack {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	from, err := netip.ParsePrefix(p.Networks[stackNetwork].Ipam.Config[0].Subnet)
	if err != nil {
		t.Fatal(err)
	}
	s := &stack{admin: map[string]string{}, simAddr: map[string]string{},
		client: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: loadWorkers}}}
	s.reloc = composetest.Relocation{From: from, To: e.FreeSubnet(t, netip.MustParsePrefix("10.231.0.0/16"), from)}
	t.Logf("stack subnet %s (the file's %s)", s.reloc.To, s.reloc.From)

	// The certificates `make compose-certs` makes, for the moved replica
	// addresses, under the restrictive umask that once left the stack
	// unhealthy (directories 0700).
	s.tls = filepath.Join(t.TempDir(), "tls")
	var reps []string
	for _, r := range replicaServices(t, p) {
		s.replicas = append(s.replicas, r.Name)
		reps = append(reps, r.Name+"="+s.reloc.Addr(staticIP(t, r, stackNetwork)).String())
	}
	s.devcerts(t, "-replicas", strings.Join(reps, ","))
	for _, d := range []string{"switchyard-1", "envoy"} {
		if info, err := os.Stat(filepath.Join(s.tls, d)); err != nil || info.Mode().Perm() != 0o755 {
			t.Fatalf("devcerts under umask 077 made %s with mode %v (%v), want 0755", d, info.Mode().Perm(), err)
		}
	}
	mounts := map[string]string{}
	for _, d := range []string{"switchyard-1", "switchyard-2", "envoy"} {
		mounts[filepath.Join(root, composeTLSDir, d)] = filepath.Join(s.tls, d)
	}
	moved, err := composetest.Override(p, composetest.Move{Reloc: s.reloc, Dir: t.TempDir(), Mounts: mounts,
		HostPort: func(string, uint32) int { return testutil.FreePort(t) }})
	if err != nil {
		t.Fatal(err)
	}
	for _, sim := range simServices(p) {
		s.sims = append(s.sims, sim.Name)
		flags, _ := flagValues(sim.Command)
		s.simAddr[sim.Name] = s.reloc.Addr(staticIP(t, sim, stackNetwork)).String() + ":" + flags["port"]
	}
	listener := readHCLConfig(t, bindSourceFor(t, replicaServices(t, p)[0], switchyardConfigTarget)).listeners["public"]
	_, lport := hostPort(t, "listener", listener)
	s.envoy = fmt.Sprintf("http://127.0.0.1:%d", moved.Ports[svcEnvoy][uint32(lport)])
	s.consul = fmt.Sprintf("http://127.0.0.1:%d", moved.Ports[svcConsul][8500])
	for _, r := range replicaServices(t, p) {
		_, admin := hostPort(t, "admin", serveFlags(t, r)["admin-addr"])
		s.admin[r.Name] = fmt.Sprintf("http://127.0.0.1:%d", moved.Ports[r.Name][uint32(admin)])
	}

	// Builds behind this machine's TLS-intercepting proxy trust its CA
	// the way docs/deployment.md tells users to: the build-ca secret.
	env := map[string]string{}
	if ca := hostCABundle(); ca != "" {
		env["SWITCHYARD_BUILD_CA"] = ca
	}
	s.p = e.NewProject(t, composetest.Options{
		Files:    []string{filepath.Join(root, composeFile)},
		Override: moved.Override,
		Env:      env,
	})
	start := time.Now()
	s.p.Up(t, 20*time.Minute, "--build")
	t.Logf("project %s up and healthy in %v", s.p.Name, time.Since(start).Round(time.Second))
	return s
}

// hostCABundle is the CA bundle this host trusts, for the build secret.
func hostCABundle() string {
	for _, f := range []string{os.Getenv("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"} {
		if f != "" {
			if _, err := os.Stat(f); err == nil {
				return f
			}
		}
	}
	return ""
}

// devcerts runs cmd/devcerts into the stack's certificate directory under
// umask 077 (issue 26: the directories it made were unreadable then).
func (s *stack) devcerts(t *testing.T, args ...string) {
	t.Helper()
	bin := testutil.Binary(t, "devcerts")
	cmd := exec.Command("sh", append([]string{"-c", `umask 077; exec "$@"`, "sh", bin, "-out", s.tls}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("devcerts: %v\n%s", err, out)
	}
}

// chat sends one chat completion through Envoy and returns the response
// headers; an error for anything but 200.
func (s *stack) chat(ctx context.Context, model, content string) (http.Header, error) {
	body := map[string]any{"model": model, "max_tokens": 8, "messages": []map[string]string{
		{"role": "system", "content": "You are the switchyard compose test's assistant. Answer briefly and precisely, and say which server you are."},
		{"role": "user", "content": content},
	}}
	return s.post(ctx, "/v1/chat/completions", body)
}

func (s *stack) post(ctx context.Context, path string, body any) (http.Header, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.envoy+path, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", resp.Status, truncate(string(out), 200))
	}
	var r struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if err := json.Unmarshal(out, &r); err != nil || len(r.Choices) == 0 {
		return nil, fmt.Errorf("200 without choices: %s", truncate(string(out), 200))
	}
	return resp.Header, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// getJSONFrom reads url into v with the stack's client.
func (s *stack) getJSON(url string, v any) error {
	resp, err := s.client.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("GET %s: %s %s", url, resp.Status, truncate(string(b), 200))
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// replicaStatus is the part of a replica's /api/status the test reads.
type replicaStatus struct {
	ReplicaID string `json:"replica_id"`
	Envoys    []struct {
		ID      string `json:"id"`
		Streams int    `json:"streams"`
	} `json:"envoys"`
	Replicas []struct {
		ID      string `json:"id"`
		Self    bool   `json:"self"`
		Sharing bool   `json:"sharing"`
	} `json:"replicas"`
	Store *struct {
		WarmSaves int64 `json:"warm_saves"`
		Restored  struct {
			PrefixBlocks int `json:"prefix_blocks"`
			FailingEps   int `json:"failing_endpoints"`
		} `json:"restored"`
	} `json:"store"`
	TLS *struct {
		Reloads uint64 `json:"reloads"`
	} `json:"tls"`
}

func (s *stack) status(replica string) (replicaStatus, error) {
	var st replicaStatus
	err := s.getJSON(s.admin[replica]+"/api/status", &st)
	return st, err
}

// load runs one fault under steady load: loadWorkers requests in flight,
// inject after the first 30, then until faultRequests have finished (and
// inject has returned). It records the row and returns the result.
func (s *stack) load(t *testing.T, fault string, inject func() string) composetest.Result {
	t.Helper()
	var n atomic.Int64
	l := composetest.StartLoad(loadWorkers, func(ctx context.Context) error {
		_, err := s.chat(ctx, stackModel, fmt.Sprintf("question %d", n.Add(1)%16))
		return err
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := l.WaitDone(ctx, 30); err != nil {
		l.Stop()
		t.Fatalf("%s: no steady load before the fault: %v", fault, err)
	}
	injected := time.Now()
	notes := inject()
	err := l.WaitDone(ctx, faultRequests)
	r := l.Stop()
	if err != nil {
		t.Errorf("%s: %v", fault, err)
	}
	if len(r.Failures) > 0 {
		// When the failed requests were sent, relative to the fault:
		// before it, they were in flight; after, they were new.
		var when []string
		for _, f := range r.Failures {
			when = append(when, fmt.Sprintf("%+dms", f.Start.Sub(injected).Milliseconds()))
		}
		notes += "; the failed requests were sent at " + strings.Join(when, ", ") + " from the fault"
	}
	s.table = append(s.table, faultRow{fault: fault, requests: r.Requests, failed: len(r.Failures), notes: notes})
	t.Logf("%s: %s; %s", fault, r, notes)
	return r
}

// checkRequests: chat and completions answer through Envoy; the LoRA
// adapter goes only to the host that serves it; both replicas share
// their picks.
func (s *stack) checkRequests(t *testing.T) {
	ctx := context.Background()
	if _, err := s.chat(ctx, stackModel, "hello"); err != nil {
		t.Fatalf("chat: %v", err)
	}
	if _, err := s.post(ctx, "/v1/completions", map[string]any{"model": stackModel, "prompt": "Say hello", "max_tokens": 8}); err != nil {
		t.Fatalf("completions: %v", err)
	}
	before := map[string]float64{}
	for _, sim := range s.sims {
		before[sim] = s.simRequests(t, sim)
	}
	want := s.simAddr[loraHost]
	for i := range 20 {
		h, err := s.chat(ctx, stackLoRA, fmt.Sprintf("SELECT %d", i))
		if err != nil {
			t.Fatalf("%s request %d: %v", stackLoRA, i, err)
		}
		if seen := h.Get("x-destination-seen"); seen == "" || strings.Trim(seen, " ") != want {
			t.Errorf("%s request %d was sent to %q, want only %s (%s)", stackLoRA, i, seen, want, loraHost)
		}
	}
	for _, sim := range s.sims {
		got := s.simRequests(t, sim) - before[sim]
		if sim == loraHost && got < 20 {
			t.Errorf("%s served %v of the 20 %s requests", sim, got, stackLoRA)
		}
		if sim != loraHost && got != 0 {
			t.Errorf("%s, which does not load %s, served %v requests meanwhile", sim, stackLoRA, got)
		}
	}
	testutil.Eventually(t, 30*time.Second, "both replicas share their picks with each other", func() error {
		for _, r := range s.replicas {
			st, err := s.status(r)
			if err != nil {
				return err
			}
			for _, x := range st.Replicas {
				if !x.Self && !x.Sharing {
					return fmt.Errorf("%s does not share with %s: %+v", r, x.ID, st.Replicas)
				}
			}
			if len(st.Replicas) != len(s.replicas) {
				return fmt.Errorf("%s lists %+v", r, st.Replicas)
			}
		}
		return nil
	})
}

// simRequests reads a simulator's finished-request counter from its own
// address on the stack's network.
func (s *stack) simRequests(t *testing.T, sim string) float64 {
	t.Helper()
	resp, err := s.client.Get("http://" + s.simAddr[sim] + "/metrics")
	if err != nil {
		t.Fatalf("%s metrics: %v", sim, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, m := range regexp.MustCompile(`(?m)^vllm:request_success_total\{[^}]*\} (\S+)$`).FindAllStringSubmatch(string(b), -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		total += v
	}
	return total
}

// checkOneOffRun: `docker compose run` of the one-off service works while
// the replicas run (a one-off of a replica service takes its static
// address and fails: issue 26).
func (s *stack) checkOneOffRun(t *testing.T) {
	out := s.p.Must(t, 5*time.Minute, "run", "--rm", "--no-deps", svcCLI, "validate", "-config="+switchyardConfigTarget)
	if !strings.Contains(out, "ok:") {
		t.Errorf("docker compose run %s validate: %s", svcCLI, out)
	}
}

// checkConsulQuiet: nothing registers the GPU hosts without their profile
// (their failing checks were most of Consul's log), and the update check
// that errors offline is off.
func (s *stack) checkConsulQuiet(t *testing.T) {
	var self struct {
		DebugConfig struct{ DisableUpdateCheck bool }
	}
	if err := s.getJSON(s.consul+"/v1/agent/self", &self); err != nil {
		t.Fatal(err)
	}
	if !self.DebugConfig.DisableUpdateCheck {
		t.Error("Consul's update check is on")
	}
	var services map[string][]string
	if err := s.getJSON(s.consul+"/v1/catalog/services", &services); err != nil {
		t.Fatal(err)
	}
	var entries []struct{ Service struct{ ID string } }
	if err := s.getJSON(s.consul+"/v1/health/service/vllm", &entries); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range entries {
		ids = append(ids, e.Service.ID)
	}
	sort.Strings(ids)
	if !slices.Equal(ids, s.sims) {
		t.Errorf("Consul lists vllm instances %v, want the simulators %v only", ids, s.sims)
	}
	logs := s.p.Logs(t, svcConsul)
	for _, bad := range []string{"vllm-gpu", "checkpoint", "update check"} {
		if strings.Contains(strings.ToLower(logs), bad) {
			t.Errorf("Consul's log mentions %q:\n%s", bad, grepLines(logs, bad))
		}
	}
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(strings.ToLower(l), sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// adsHolder returns the replica holding Envoy's ADS stream.
func (s *stack) adsHolder(t *testing.T) string {
	t.Helper()
	var holder string
	testutil.Eventually(t, 30*time.Second, "one replica holds Envoy's ADS stream", func() error {
		var holders []string
		for _, r := range s.replicas {
			st, err := s.status(r)
			if err != nil {
				continue // a replica that is down holds nothing
			}
			for _, e := range st.Envoys {
				if e.Streams > 0 {
					holders = append(holders, r)
				}
			}
		}
		if len(holders) != 1 {
			return fmt.Errorf("holders %v", holders)
		}
		holder = holders[0]
		return nil
	})
	return holder
}

func (s *stack) other(replica string) string {
	for _, r := range s.replicas {
		if r != replica {
			return r
		}
	}
	return ""
}

// registered returns the IDs of a Consul service's instances with their
// aggregate check status.
func (s *stack) registered(service string) (map[string]string, error) {
	var entries []struct {
		Service struct{ ID string }
		Checks  []struct{ Status string }
	}
	if err := s.getJSON(s.consul+"/v1/health/service/"+service, &entries); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, e := range entries {
		status := "passing"
		for _, c := range e.Checks {
			if c.Status != "passing" {
				status = c.Status
			}
		}
		out[e.Service.ID] = status
	}
	return out, nil
}

// faultKillADSReplica: `docker kill` of the replica holding Envoy's ADS
// stream (the engine does not restart it). Only requests it was handling
// may fail; Envoy moves its ADS stream to the other replica. Consul then
// removes the dead replica after its check has been critical for a minute
// (issue 26: it stayed forever), while a model server that is down as
// long stays registered, and passes again when it is back.
func (s *stack) faultKillADSReplica(t *testing.T) {
	victim := s.adsHolder(t)
	survivor := s.other(victim)
	var killed time.Time
	r := s.load(t, "docker kill of the replica holding Envoy's ADS stream", func() string {
		killed = time.Now()
		s.p.Kill(t, victim, "KILL")
		return victim + " killed; Envoy's ADS moved to " + s.adsHolderAfter(t, survivor)
	})
	if len(r.Failures) > loadWorkers {
		t.Errorf("%d requests failed, more than the %d in flight when %s died: %v", len(r.Failures), loadWorkers, victim, r.Failures)
	}

	// A model server down for as long stays registered (critical).
	stopped := s.sims[1]
	s.p.Must(t, time.Minute, "stop", stopped)
	testutil.Eventually(t, 3*time.Minute, victim+" removed from Consul", func() error {
		reg, err := s.registered(replicaConsulService)
		if err != nil {
			return err
		}
		if st, ok := reg[victim]; ok {
			return fmt.Errorf("%s still registered (%s) %v after the kill", victim, st, time.Since(killed).Round(time.Second))
		}
		return nil
	})
	reaped := time.Since(killed).Round(time.Second)
	reg, err := s.registered("vllm")
	if err != nil {
		t.Fatal(err)
	}
	if st := reg[stopped]; st != "critical" {
		t.Errorf("%s, stopped as long as %s was dead, is %q in Consul; want still registered, critical", stopped, victim, st)
	}
	s.p.Must(t, time.Minute, "start", stopped)
	testutil.Eventually(t, time.Minute, stopped+" passing again", func() error {
		reg, err := s.registered("vllm")
		if err != nil {
			return err
		}
		if reg[stopped] != "passing" {
			return fmt.Errorf("%s is %q", stopped, reg[stopped])
		}
		return nil
	})
	s.table = append(s.table, faultRow{fault: "replica dead (docker kill), its Consul registration", notes: fmt.Sprintf("removed %v after the kill; a model server stopped as long stayed registered (critical) and passed again on start", reaped)})

	// Back: it registers again and both replicas list each other.
	s.p.Must(t, time.Minute, "start", victim)
	s.p.WaitHealthy(t, 2*time.Minute, victim)
	testutil.Eventually(t, time.Minute, victim+" registered and passing again", func() error {
		reg, err := s.registered(replicaConsulService)
		if err != nil {
			return err
		}
		if reg[victim] != "passing" || reg[survivor] != "passing" {
			return fmt.Errorf("replicas %v", reg)
		}
		return nil
	})
}

// adsHolderAfter waits until want holds Envoy's ADS stream and says how
// long that took.
func (s *stack) adsHolderAfter(t *testing.T, want string) string {
	t.Helper()
	start := time.Now()
	testutil.Eventually(t, time.Minute, want+" holds Envoy's ADS stream", func() error {
		st, err := s.status(want)
		if err != nil {
			return err
		}
		for _, e := range st.Envoys {
			if e.Streams > 0 {
				return nil
			}
		}
		return errors.New("no stream yet")
	})
	return fmt.Sprintf("%s within %v", want, time.Since(start).Round(100*time.Millisecond))
}

// faultCrashOtherReplica: the replica without Envoy's ADS stream crashes
// (SIGKILL of its process from the host, as the OOM killer would); Docker
// restarts it. Only requests it was handling may fail.
func (s *stack) faultCrashOtherReplica(t *testing.T) {
	victim := s.other(s.adsHolder(t))
	before := s.p.Inspect(t, victim)
	r := s.load(t, "kill -9 of the other replica's process (Docker restarts it)", func() string {
		killed := time.Now()
		if err := syscall.Kill(before.Pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill -9 %d (%s): %v", before.Pid, victim, err)
		}
		var restarted time.Duration
		testutil.Eventually(t, time.Minute, victim+" restarted by Docker", func() error {
			st := s.p.Inspect(t, victim)
			if st.RestartCount <= before.RestartCount || !st.Running {
				return fmt.Errorf("restarts %d, %s", st.RestartCount, st.Status)
			}
			restarted = st.StartedAt.Sub(killed)
			return nil
		})
		s.p.WaitHealthy(t, 2*time.Minute, victim)
		return fmt.Sprintf("%s restarted by Docker after %v, healthy after %v", victim, restarted.Round(100*time.Millisecond), time.Since(killed).Round(100*time.Millisecond))
	})
	if len(r.Failures) > loadWorkers {
		t.Errorf("%d requests failed, more than the %d in flight when %s died: %v", len(r.Failures), loadWorkers, victim, r.Failures)
	}
}

// faultRestartConsul: the replicas keep routing to what they last saw
// while Consul restarts; no request fails.
func (s *stack) faultRestartConsul(t *testing.T) {
	r := s.load(t, "docker restart consul", func() string {
		start := time.Now()
		s.p.Must(t, 2*time.Minute, "restart", svcConsul)
		s.p.WaitHealthy(t, 2*time.Minute, svcConsul)
		return fmt.Sprintf("Consul healthy again after %v", time.Since(start).Round(100*time.Millisecond))
	})
	if len(r.Failures) > 0 {
		t.Errorf("requests failed while Consul restarted: %v", r.Failures)
	}
	testutil.Eventually(t, time.Minute, "every replica and simulator passing in Consul again", func() error {
		for svc, want := range map[string][]string{replicaConsulService: s.replicas, "vllm": s.sims} {
			reg, err := s.registered(svc)
			if err != nil {
				return err
			}
			for _, id := range want {
				if reg[id] != "passing" {
					return fmt.Errorf("%s: %v", svc, reg)
				}
			}
		}
		return nil
	})
}

// faultRotateCertificates: `make compose-certs` again under load: both
// replicas and Envoy load the new certificates without a failed request,
// and Envoy never sees a certificate next to another key (issue 26:
// KEY_VALUES_MISMATCH on every rotation).
func (s *stack) faultRotateCertificates(t *testing.T) {
	reloads := map[string]uint64{}
	for _, r := range s.replicas {
		st, err := s.status(r)
		if err != nil || st.TLS == nil {
			t.Fatalf("%s status: %v %+v", r, err, st.TLS)
		}
		reloads[r] = st.TLS.Reloads
	}
	res := s.load(t, "certificate rotation (make compose-certs again)", func() string {
		start := time.Now()
		s.devcerts(t)
		serial := fmt.Sprintf("%x", readCert(t, filepath.Join(s.tls, "envoy", "cert.pem")).SerialNumber)
		testutil.Eventually(t, time.Minute, "replicas and Envoy on the new certificates", func() error {
			for _, r := range s.replicas {
				st, err := s.status(r)
				if err != nil {
					return err
				}
				if st.TLS == nil || st.TLS.Reloads <= reloads[r] {
					return fmt.Errorf("%s has not reloaded", r)
				}
			}
			certs, err := s.envoyAdmin("/certs")
			if err != nil {
				return err
			}
			if !strings.Contains(strings.ToLower(certs), serial) {
				return fmt.Errorf("Envoy does not serve the new client certificate %s yet", serial)
			}
			return nil
		})
		return fmt.Sprintf("replicas and Envoy on the new certificates after %v", time.Since(start).Round(100*time.Millisecond))
	})
	if len(res.Failures) > 0 {
		t.Errorf("requests failed during the rotation: %v", res.Failures)
	}
	stats, err := s.envoyAdmin("/stats?filter=key_rotation_failed")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`(?m)^(\S*key_rotation_failed): (\d+)`).FindAllStringSubmatch(stats, -1) {
		if m[2] != "0" {
			t.Errorf("Envoy %s = %s: it saw a certificate with another key", m[1], m[2])
		}
	}
	if logs := s.p.Logs(t, svcEnvoy); strings.Contains(logs, "KEY_VALUES_MISMATCH") {
		t.Errorf("Envoy logged KEY_VALUES_MISMATCH:\n%s", grepLines(logs, "key_values_mismatch"))
	}
}

// envoyAdmin GETs a path of Envoy's admin server, which listens on the
// container's loopback only, from inside the container (bash's /dev/tcp,
// as the compose health check does).
func (s *stack) envoyAdmin(path string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	script := `exec 3<>/dev/tcp/127.0.0.1/9901 && printf 'GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' "$1" >&3 && cat <&3`
	out, err := s.p.Exec(ctx, svcEnvoy, "bash", "-c", script, "admin", path)
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, out)
	}
	if !strings.HasPrefix(out, "HTTP/1.1 200") {
		return "", fmt.Errorf("Envoy admin %s: %s", path, truncate(out, 300))
	}
	return out, nil
}

// faultDownUp: `docker compose down` then `up` keeps Consul's data and
// the replicas' picker memory. down stops the replicas before the model
// servers, so no replica records them as failing (issue 26: every server
// restored as failing on the next up).
func (s *stack) faultDownUp(t *testing.T) {
	marker := fmt.Sprintf("kept-%d", time.Now().UnixNano())
	req, err := http.NewRequest(http.MethodPut, s.consul+"/v1/kv/switchyard-test/marker", strings.NewReader(marker))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// Prefix memory to keep: a few rounds of the same prompts, and a save
	// of each replica's memory after them.
	for i := range 32 {
		if _, err := s.chat(context.Background(), stackModel, fmt.Sprintf("question %d", i%16)); err != nil {
			t.Fatal(err)
		}
	}
	saves := map[string]int64{}
	for _, r := range s.replicas {
		st, err := s.status(r)
		if err != nil || st.Store == nil {
			t.Fatalf("%s: %v %+v", r, err, st.Store)
		}
		saves[r] = st.Store.WarmSaves
	}
	testutil.Eventually(t, 30*time.Second, "the replicas saved their memory", func() error {
		for _, r := range s.replicas {
			if st, err := s.status(r); err != nil || st.Store == nil || st.Store.WarmSaves <= saves[r] {
				return fmt.Errorf("%s: no save yet (%v)", r, err)
			}
		}
		return nil
	})

	since := time.Now()
	s.p.Must(t, 3*time.Minute, "down")
	until := time.Now()
	stopped := map[string]time.Time{}
	for _, ev := range s.p.Events(t, "die", since, until) {
		stopped[ev.Service] = ev.Time
	}
	for _, r := range s.replicas {
		for _, sim := range s.sims {
			if stopped[r].IsZero() || stopped[sim].IsZero() || !stopped[r].Before(stopped[sim]) {
				t.Errorf("down stopped %s at %v and %s at %v; the replicas must stop first", r, stopped[r].Format(time.StampMilli), sim, stopped[sim].Format(time.StampMilli))
			}
		}
	}

	start := time.Now()
	s.p.Up(t, 5*time.Minute)
	notes := fmt.Sprintf("healthy again %v after up", time.Since(start).Round(time.Second))
	var kv []struct{ Value []byte }
	if err := s.getJSON(s.consul+"/v1/kv/switchyard-test/marker", &kv); err != nil || len(kv) != 1 || string(kv[0].Value) != marker {
		t.Errorf("Consul lost its data over down/up: %v %+v", err, kv)
	}
	for _, r := range s.replicas {
		st, err := s.status(r)
		if err != nil || st.Store == nil {
			t.Fatalf("%s: %v", r, err)
		}
		if st.Store.Restored.PrefixBlocks == 0 {
			t.Errorf("%s restored no prefix memory", r)
		}
		if st.Store.Restored.FailingEps != 0 {
			t.Errorf("%s restored %d endpoints as failing: it saw the model servers stop before it did", r, st.Store.Restored.FailingEps)
		}
		notes += fmt.Sprintf("; %s restored %d prefix blocks, %d failing endpoints", r, st.Store.Restored.PrefixBlocks, st.Store.Restored.FailingEps)
	}
	if _, err := s.chat(context.Background(), stackModel, "after up"); err != nil {
		t.Errorf("chat after up: %v", err)
	}
	s.table = append(s.table, faultRow{fault: "docker compose down, then up", notes: notes + "; Consul's KV kept"})
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
