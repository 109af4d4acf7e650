package main

// End-to-end harness: real vllm-sim processes, the switchyard binary and a
// real Envoy bootstrapped from envoy.Bootstrap, all on 127.0.0.1 with free
// ports. Every e2e_*_test.go file builds its fleet with newFleet.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/testutil"
)

// settle is how long an end-to-end test waits for an outcome that takes
// milliseconds on an idle machine (an edit or a registration reaching
// Envoy and the picker, a member leaving, routing resuming) before calling
// it lost. It is generous on purpose: these tests run in parallel on small
// shared machines, and a deadline is not a latency target. The tests log
// the latencies they see; benchmarks measure them.
const settle = 30 * time.Second

// e2eModels is what every simulator serves by default, so any model a
// test routes is answered by whichever sim the request reaches. "m-chat"
// is deliberately absent: it only exists as a client name the picker
// rewrites to "m-chat-v2", so an unrewritten request would get a 404.
var e2eModels = []string{"m-a", "m-b", "m-chat-v2", "m-open", "m-closed"}

// sim is one running cmd/vllm-sim.
type sim struct {
	Addr string
	proc *testutil.Process
}

type simOptions struct {
	timeScale int      // default 50
	models    []string // default e2eModels
	extra     []string // more flags
}

// startSim starts a simulator on a free port and waits for /health.
func startSim(t testing.TB, o simOptions) *sim {
	t.Helper()
	if o.timeScale == 0 {
		o.timeScale = 50
	}
	if o.models == nil {
		o.models = e2eModels
	}
	port := testutil.FreePort(t)
	args := append([]string{"-host", "127.0.0.1", "-port", strconv.Itoa(port),
		"-model", o.models[0], "-served-model-name", strings.Join(o.models, ","),
		"-time-scale", strconv.Itoa(o.timeScale), "-log-level", "warn"}, o.extra...)
	s := &sim{Addr: fmt.Sprintf("127.0.0.1:%d", port)}
	s.proc = testutil.Start(t, "vllm-sim "+s.Addr, testutil.Binary(t, "vllm-sim"), args...)
	testutil.WaitHTTP(t, "http://"+s.Addr+"/health", 10*time.Second)
	return s
}

// requests returns how many inference requests the sim finished, from its
// vllm:request_success_total counters.
func (s *sim) requests() (int, error) {
	resp, err := http.Get("http://" + s.Addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n := 0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "vllm:request_success_total") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("metrics line %q: %w", line, err)
		}
		n += int(v)
	}
	return n, sc.Err()
}

// fleet is one switchyard process, one Envoy and the HCL configuration
// directory switchyard watches. Either process can be killed and
// restarted on the same ports.
type fleet struct {
	t         testing.TB
	dir       string
	listen    string // the HCL listener address Envoy binds
	extproc   string
	xds       string
	admin     string
	nodeID    string
	envoyArgs []string
	envoyAdm  string
	bootstrap string
	syArgs    []string // extra switchyard serve flags (fleetOptions)
	syEnv     []string // extra switchyard environment (fleetOptions)

	mu    sync.Mutex
	sy    *testutil.Process
	envoy *testutil.Process
	old   []*testutil.Process // earlier runs, for output on failure

	client *http.Client
}

type fleetOptions struct {
	envoyConcurrency int // default 1
	// switchyardArgs are extra `switchyard serve` flags (e.g. -store) and
	// switchyardEnv extra "KEY=value" environment (e.g. CONSUL_HTTP_ADDR),
	// used on every (re)start.
	switchyardArgs []string
	switchyardEnv  []string
	// envoyTLSDir, when set, makes Envoy connect to switchyard with mutual
	// TLS from this certificate directory (envoy.TLSLayout).
	envoyTLSDir string
}

// newFleet writes config (a body of pool/model/routing blocks; the
// listener block is added here), starts switchyard and Envoy, and waits
// until Envoy ACKed the current version, its listener answers and the
// picker is healthy in Envoy.
func newFleet(t testing.TB, config string, o fleetOptions) *fleet {
	t.Helper()
	if o.envoyConcurrency == 0 {
		o.envoyConcurrency = 1
	}
	f := &fleet{
		t:       t,
		dir:     t.TempDir(),
		listen:  testutil.FreeAddr(t),
		extproc: testutil.FreeAddr(t),
		xds:     testutil.FreeAddr(t),
		admin:   testutil.FreeAddr(t),
		nodeID:  "e2e-" + strings.ReplaceAll(t.Name(), "/", "-"),
		syArgs:  o.switchyardArgs,
		syEnv:   o.switchyardEnv,
		client: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			MaxIdleConnsPerHost: 64, MaxConnsPerHost: 0, DisableCompression: true,
		}},
	}
	t.Cleanup(f.client.CloseIdleConnections)
	adminPort := testutil.FreePort(t)
	f.envoyAdm = fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	host, port, _ := net.SplitHostPort(f.xds)
	xdsPort, _ := strconv.Atoi(port)
	bs, err := envoy.Bootstrap(envoy.Params{NodeID: f.nodeID, NodeCluster: "e2e", XDSHost: host, XDSPort: xdsPort, AdminPort: adminPort, TLSDir: o.envoyTLSDir})
	if err != nil {
		t.Fatal(err)
	}
	f.bootstrap = testutil.WriteFile(t, t.TempDir(), "envoy.yaml", bs)
	f.envoyArgs = []string{"-c", f.bootstrap, "--use-dynamic-base-id", "-l", "warning",
		"--concurrency", strconv.Itoa(o.envoyConcurrency)}

	t.Cleanup(func() {
		f.mu.Lock()
		procs := append(append([]*testutil.Process(nil), f.old...), f.sy, f.envoy)
		f.mu.Unlock()
		for _, p := range procs {
			if p == nil {
				continue
			}
			p.Stop()
			if t.Failed() {
				t.Logf("--- output of %s ---\n%s", p.Name, tail(p.Output(), 8000))
			}
		}
	})

	f.writeConfig(config)
	f.startSwitchyard()
	f.startEnvoy()
	f.waitConverged()
	return f
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "...\n" + s[len(s)-n:]
}

// hcl returns the full configuration: the fleet's listener plus body.
func (f *fleet) hcl(body string) string {
	return fmt.Sprintf("listener \"public\" {\n  address = %q\n}\n\n%s", f.listen, body)
}

// writeConfig replaces the configuration atomically (write, then rename)
// and returns the time of the rename, when switchyard can first see it.
func (f *fleet) writeConfig(body string) time.Time {
	f.t.Helper()
	tmp := filepath.Join(f.dir, "switchyard.hcl.tmp")
	if err := os.WriteFile(tmp, []byte(f.hcl(body)), 0o644); err != nil {
		f.t.Fatal(err)
	}
	at := time.Now()
	if err := os.Rename(tmp, filepath.Join(f.dir, "switchyard.hcl")); err != nil {
		f.t.Fatal(err)
	}
	return at
}

// startSwitchyard starts `switchyard serve` on the fleet's ports and waits
// for /readyz.
func (f *fleet) startSwitchyard() {
	f.t.Helper()
	args := append([]string{"serve", "-config", f.dir, "-extproc-addr", f.extproc, "-xds-addr", f.xds,
		"-admin-addr", f.admin, "-log-level", "info"}, f.syArgs...)
	p := testutil.StartNoCleanupEnv(f.t, "switchyard", testutil.Binary(f.t, "switchyard"), f.syEnv, args...)
	f.mu.Lock()
	if f.sy != nil {
		f.old = append(f.old, f.sy)
	}
	f.sy = p
	f.mu.Unlock()
	testutil.Eventually(f.t, 15*time.Second, "switchyard /readyz", func() error {
		if p.Exited() {
			return errors.New("switchyard exited:\n" + tail(p.Output(), 4000))
		}
		resp, err := http.Get("http://" + f.admin + "/readyz")
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

// killSwitchyard SIGKILLs switchyard (picker and xDS at once).
func (f *fleet) killSwitchyard() {
	f.mu.Lock()
	p := f.sy
	f.mu.Unlock()
	p.Kill()
}

// stopSwitchyard stops switchyard gracefully (SIGTERM).
func (f *fleet) stopSwitchyard() {
	f.mu.Lock()
	p := f.sy
	f.mu.Unlock()
	p.Stop()
}

// startEnvoy starts a new Envoy process with the fleet's bootstrap and
// waits for its admin /ready.
func (f *fleet) startEnvoy() {
	f.t.Helper()
	p := testutil.StartNoCleanup(f.t, "envoy", testutil.EnvoyPath(f.t), f.envoyArgs...)
	f.mu.Lock()
	if f.envoy != nil {
		f.old = append(f.old, f.envoy)
	}
	f.envoy = p
	f.mu.Unlock()
	testutil.Eventually(f.t, 15*time.Second, "Envoy admin /ready", func() error {
		if p.Exited() {
			return errors.New("envoy exited:\n" + tail(p.Output(), 4000))
		}
		resp, err := http.Get(f.envoyAdm + "/ready")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/ready %d", resp.StatusCode)
		}
		return nil
	})
}

func (f *fleet) stopEnvoy() {
	f.mu.Lock()
	p := f.envoy
	f.mu.Unlock()
	p.Stop()
}

// status mirrors the parts of /api/status the tests read.
type status struct {
	RegistryVersion uint64 `json:"registry_version"`
	Ready           bool   `json:"ready"`
	NotReady        string `json:"not_ready"`
	ConfigError     string `json:"config_error"`
	Pools           []struct {
		Name        string `json:"name"`
		FailureMode string `json:"failure_mode"`
		Endpoints   []struct {
			Address          string `json:"address"`
			InFlightRequests int64  `json:"in_flight_requests"`
			Picked           int64  `json:"picked"`
			Served           int64  `json:"served"`
			Scrape           *struct {
				Stale      bool    `json:"stale"`
				From       string  `json:"from"`
				IntervalMS float64 `json:"interval_ms"`
				CostMS     float64 `json:"cost_ms"`
			} `json:"scrape"`
		} `json:"endpoints"`
		Admission *struct {
			Queued int `json:"queued"`
		} `json:"admission"`
	} `json:"pools"`
	Picker struct {
		Requests       int64            `json:"requests"`
		Picked         int64            `json:"picked"`
		Rewritten      int64            `json:"rewritten"`
		FallbackServed int64            `json:"fallback_served"`
		ResponseBodies int64            `json:"response_body_messages"`
		PeerPicks      int64            `json:"peer_picks"`
		PeerReadings   int64            `json:"peer_readings"`
		Rejected       map[string]int64 `json:"rejected"`
	} `json:"picker"`
	XDS struct {
		Version         string            `json:"version"`
		Versions        map[string]string `json:"versions"`
		RegistryVersion uint64            `json:"registry_version"`
		Failures        uint64            `json:"failures"`
		ACKs            uint64            `json:"acks"`
		NACKs           uint64            `json:"nacks"`
	} `json:"xds"`
	ReplicaID string `json:"replica_id"`
	Replicas  []struct {
		ID          string   `json:"id"`
		Address     string   `json:"address"`
		Self        bool     `json:"self"`
		Envoys      []string `json:"envoys"`
		EnvoysKnown bool     `json:"envoys_known"`
		Sharing     bool     `json:"sharing"`
		From        string   `json:"from"`
		LagMS       float64  `json:"lag_ms"`
	} `json:"replicas"`
	Envoys []struct {
		ID      string            `json:"id"`
		Streams int               `json:"streams"`
		Acked   map[string]string `json:"acked"`
		NACKs   uint64            `json:"nacks"`
	} `json:"envoys"`
	Store *struct {
		Restored struct {
			PrefixEndpoints int `json:"prefix_endpoints"`
			PrefixBlocks    int `json:"prefix_blocks"`
			Sessions        int `json:"sessions"`
		} `json:"restored"`
		WarmSaves int64 `json:"warm_saves"`
	} `json:"store"`
}

// counts is picked/served per "pool/address".
type counts map[string][2]int64

func (s *status) counts() counts {
	c := counts{}
	for _, p := range s.Pools {
		for _, e := range p.Endpoints {
			c[p.Name+"/"+e.Address] = [2]int64{e.Picked, e.Served}
		}
	}
	return c
}

// endpoints lists the addresses the picker knows for pool.
func (s *status) endpoints(pool string) []string {
	var out []string
	for _, p := range s.Pools {
		if p.Name == pool {
			for _, e := range p.Endpoints {
				out = append(out, e.Address)
			}
		}
	}
	return out
}

func (f *fleet) status() (*status, error) {
	resp, err := http.Get("http://" + f.admin + "/api/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/api/status: %d", resp.StatusCode)
	}
	var s status
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		return nil, fmt.Errorf("/api/status: %w", err)
	}
	return &s, nil
}

func (f *fleet) mustStatus() *status {
	f.t.Helper()
	s, err := f.status()
	if err != nil {
		f.t.Fatal(err)
	}
	return s
}

var xdsTypes = []string{"Listener", "RouteConfiguration", "Cluster", "ClusterLoadAssignment"}

// acked returns nil once the fleet's Envoy is connected and ACKed the
// served version for every resource type, and the served version was built
// from registry version minRegistry or later.
func (f *fleet) acked(minRegistry uint64) (*status, error) {
	s, err := f.status()
	if err != nil {
		return nil, err
	}
	if s.XDS.Version == "" || s.XDS.RegistryVersion < minRegistry || s.RegistryVersion < minRegistry {
		return nil, fmt.Errorf("serving xDS %q from registry %d (registry at %d), want >= %d", s.XDS.Version, s.XDS.RegistryVersion, s.RegistryVersion, minRegistry)
	}
	for _, n := range s.Envoys {
		if n.ID != f.nodeID {
			continue
		}
		if n.Streams == 0 {
			return nil, errors.New("Envoy not connected")
		}
		for _, typ := range xdsTypes {
			if n.Acked[typ] != s.XDS.Versions[typ] {
				return nil, fmt.Errorf("Envoy ACKed %s %q, serving %q", typ, n.Acked[typ], s.XDS.Versions[typ])
			}
		}
		return s, nil
	}
	return nil, fmt.Errorf("node %q not in /api/status envoys", f.nodeID)
}

// waitConverged waits until Envoy ACKed the current version, its listener
// answers HTTP, and its picker cluster host is healthy.
func (f *fleet) waitConverged() *status {
	f.t.Helper()
	var st *status
	testutil.Eventually(f.t, 20*time.Second, "Envoy converged", func() error {
		s, err := f.acked(1)
		if err != nil {
			return err
		}
		if err := f.pickerHealthy(); err != nil {
			return err
		}
		// Any HTTP answer from the listener (a route 404) shows it serves.
		resp, err := f.client.Get("http://" + f.listen + "/e2e-probe")
		if err != nil {
			return err
		}
		resp.Body.Close()
		st = s
		return nil
	})
	return st
}

// pickerHealthy reports whether Envoy's picker cluster host is healthy.
func (f *fleet) pickerHealthy() error {
	out, err := httpGetString(f.envoyAdm + "/clusters")
	if err != nil {
		return err
	}
	prefix := "switchyard/picker::" + f.extproc + "::health_flags::"
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, prefix) {
			if flags := strings.TrimPrefix(l, prefix); flags != "healthy" {
				return fmt.Errorf("picker health flags %q", flags)
			}
			return nil
		}
	}
	return errors.New("no picker host in Envoy /clusters")
}

func httpGetString(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// infReq is one inference request through Envoy.
type infReq struct {
	chat      bool
	stream    bool
	model     string
	prompt    string
	maxTokens int
	headers   map[string]string
}

// infResp is what came back.
type infResp struct {
	status   int
	servedBy string
	header   http.Header
	// destination is the picker's destination list as the model server
	// received it (vllm-sim echoes it; "" when the picker did not pick).
	destination string
	body        []byte
	// Parsed answer: every "model" value seen (one per JSON body or SSE
	// chunk), token events, usage.completion_tokens and prompt_tokens,
	// and whether the SSE stream ended with [DONE].
	models     []string
	tokens     int
	completion int
	prompt     int
	done       bool
	elapsed    time.Duration
}

func (r infReq) body() []byte {
	m := map[string]any{"model": r.model}
	if r.chat {
		m["messages"] = []map[string]string{{"role": "user", "content": r.prompt}}
	} else {
		m["prompt"] = r.prompt
	}
	if r.maxTokens > 0 {
		m["max_tokens"] = r.maxTokens
		m["min_tokens"] = r.maxTokens
		m["ignore_eos"] = true
	}
	if r.stream {
		m["stream"] = true
		m["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, _ := json.Marshal(m)
	return b
}

// send posts r to Envoy's listener and reads the whole answer.
func (f *fleet) send(r infReq) (*infResp, error) {
	return sendTo(f.client, "http://"+f.listen, r, nil)
}

// sendTo posts r to base; onHeaders (optional) runs once response headers
// arrived, before the body is read.
func sendTo(c *http.Client, base string, r infReq, onHeaders func(*infResp)) (*infResp, error) {
	path := "/v1/completions"
	if r.chat {
		path = "/v1/chat/completions"
	}
	req, err := http.NewRequest(http.MethodPost, base+path, bytes.NewReader(r.body()))
	if err != nil {
		return nil, err
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range r.headers {
		req.Header.Set(k, v)
	}
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := &infResp{status: resp.StatusCode, servedBy: resp.Header.Get("x-served-by"), header: resp.Header,
		destination: resp.Header.Get("x-destination-seen")}
	if onHeaders != nil {
		onHeaders(out)
	}
	out.body, err = io.ReadAll(resp.Body)
	out.elapsed = time.Since(start)
	if err != nil {
		return out, fmt.Errorf("read body (status %d, %d bytes): %w", out.status, len(out.body), err)
	}
	if out.status != http.StatusOK {
		return out, nil
	}
	type chunk struct {
		Model   string `json:"model"`
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
		Usage *struct {
			CompletionTokens int `json:"completion_tokens"`
			PromptTokens     int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	take := func(b []byte) error {
		var c chunk
		if err := json.Unmarshal(b, &c); err != nil {
			return fmt.Errorf("bad JSON %q: %w", truncate(string(b), 200), err)
		}
		out.models = append(out.models, c.Model)
		for _, ch := range c.Choices {
			if ch.Text != "" || ch.Delta.Content != "" {
				out.tokens++
				break
			}
		}
		if c.Usage != nil {
			out.completion, out.prompt = c.Usage.CompletionTokens, c.Usage.PromptTokens
		}
		return nil
	}
	if !r.stream {
		return out, take(out.body)
	}
	for _, line := range strings.Split(string(out.body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			out.done = true
			continue
		}
		if err := take([]byte(data)); err != nil {
			return out, err
		}
	}
	return out, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// checkOK fails unless resp is a 200 whose every model field is model.
func checkOK(t testing.TB, resp *infResp, err error, model string) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	if resp.status != http.StatusOK {
		t.Fatalf("status %d: %s", resp.status, truncate(string(resp.body), 300))
	}
	if len(resp.models) == 0 {
		t.Fatalf("no model field in answer %s", truncate(string(resp.body), 300))
	}
	for _, m := range resp.models {
		if m != model {
			t.Fatalf("answer has model %q, client sent %q", m, model)
		}
	}
}
