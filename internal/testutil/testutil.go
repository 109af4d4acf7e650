// Package testutil owns the helpers integration tests share: free loopback
// ports, building this module's binaries once per test process, starting
// real processes (simulators, switchyard, Envoy, Consul) with cleanup, and
// polling with a deadline instead of sleeping.
//
// Under -short (make unit) every helper that would run another program
// (Binary, EnvoyPath, ConsulPath, Start*, StartConsul) skips the test
// instead, so a unit run starts no process even where Envoy and Consul are
// installed; tests that run a program themselves call SkipProcesses.
package testutil

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
//
// Ports come from below the kernel's ephemeral range, chosen at random and
// never twice in one test binary. A port from "127.0.0.1:0" would be an
// ephemeral one, and between this call and the process that binds it,
// any outgoing connection on the machine (tests make thousands) can take
// it as its local port: Envoy then fails with "Address already in use".
func FreePort(t testing.TB) int {
	t.Helper()
	lo, hi := portRange()
	ports.mu.Lock()
	defer ports.mu.Unlock()
	if ports.given == nil {
		ports.given = map[int]bool{}
		ports.rnd = rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(os.Getpid())))
	}
	for range 1000 {
		p := lo + ports.rnd.IntN(hi-lo)
		if ports.given[p] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		_ = l.Close()
		ports.given[p] = true
		return p
	}
	t.Fatalf("free port: none free in [%d, %d)", lo, hi)
	return 0
}

// ports remembers what FreePort handed out in this test binary.
var ports struct {
	mu    sync.Mutex
	given map[int]bool
	rnd   *rand.Rand
}

// portRange is [10000, start of the ephemeral range), or [10000, 32768)
// when the kernel does not say.
func portRange() (lo, hi int) {
	lo, hi = 10000, 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return lo, hi
	}
	var eph int
	if _, err := fmt.Sscan(string(b), &eph); err == nil && eph > lo+1000 {
		hi = eph
	}
	return lo, hi
}

// EphemeralStart returns the first port of the kernel's ephemeral range
// (32768 when it cannot be read): ports a test binds itself stay below it.
func EphemeralStart() int {
	_, hi := portRange()
	return hi
}

// FreeAddr returns "127.0.0.1:<free port>".
func FreeAddr(t testing.TB) string {
	return fmt.Sprintf("127.0.0.1:%d", FreePort(t))
}

// RepoRoot returns the module root (the directory holding go.mod).
func RepoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate testutil source")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

var (
	buildMu  sync.Mutex
	buildDir string
	built    = map[string]string{}
)

// SkipProcesses skips the test under -short, for tests that run another
// program (what names it, for the skip message).
func SkipProcesses(t testing.TB, what string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("runs %s: not in -short runs", what)
	}
}

// Binary builds ./cmd/<name> once per test process and returns its path.
func Binary(t testing.TB, name string) string {
	t.Helper()
	SkipProcesses(t, "go build ./cmd/"+name)
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[name]; ok {
		return p
	}
	if buildDir == "" {
		d, err := os.MkdirTemp("", "switchyard-bin-")
		if err != nil {
			t.Fatalf("temp dir: %v", err)
		}
		buildDir = d
	}
	out := filepath.Join(buildDir, name)
	cmd := exec.Command("go", "build", "-o", out, "./cmd/"+name)
	cmd.Dir = RepoRoot(t)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/%s: %v\n%s", name, err, b)
	}
	built[name] = out
	return out
}

// EnvoyPath returns the Envoy binary to use, or skips the test when none is
// installed: $SWITCHYARD_ENVOY, then envoy on PATH, then the project venv.
func EnvoyPath(t testing.TB) string {
	t.Helper()
	return toolPath(t, "SWITCHYARD_ENVOY", "envoy", filepath.Join(RepoRoot(t), ".venv", "bin", "envoy"), "make envoy")
}

// ConsulPath returns the Consul binary to use, or skips the test when none
// is installed: $SWITCHYARD_CONSUL, then consul on PATH.
func ConsulPath(t testing.TB) string {
	t.Helper()
	home, _ := os.UserHomeDir()
	return toolPath(t, "SWITCHYARD_CONSUL", "consul", filepath.Join(home, ".cache", "switchyard", "consul-1.22.0", "consul"), "make consul")
}

func toolPath(t testing.TB, env, name, fallback, install string) string {
	t.Helper()
	SkipProcesses(t, name)
	if p := os.Getenv(env); p != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	if _, err := os.Stat(fallback); err == nil {
		return fallback
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("%s not installed (run %q); CI must not skip it", name, install)
	}
	t.Skipf("%s not installed; run %q", name, install)
	return ""
}

// Process is a child process started for a test. Its combined output is
// kept and printed if the test fails.
type Process struct {
	Name string
	Cmd  *exec.Cmd
	out  *SyncBuffer
	done chan struct{}
	err  error
}

// Start runs bin with args, stops it when the test ends (SIGTERM, then
// SIGKILL after 5 s) and logs its output on failure.
func Start(t testing.TB, name, bin string, args ...string) *Process {
	t.Helper()
	p := StartNoCleanup(t, name, bin, args...)
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("--- output of %s ---\n%s", name, p.Output())
		}
	})
	return p
}

// StartNoCleanup is Start without the automatic cleanup, for tests that
// restart or kill the process themselves; they must Stop or Kill it.
func StartNoCleanup(t testing.TB, name, bin string, args ...string) *Process {
	t.Helper()
	return StartNoCleanupEnv(t, name, bin, nil, args...)
}

// Output returns everything the process printed so far.
func (p *Process) Output() string { return p.out.String() }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed when the process exits.
func (p *Process) Done() <-chan struct{} { return p.done }

// Stop sends SIGTERM to the process group and waits up to 5 s, then kills.
func (p *Process) Stop() {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		p.Kill()
	}
}

// Kill sends SIGKILL to the process group and waits for it to exit.
func (p *Process) Kill() {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// Signal sends sig to the process (not its group).
func (p *Process) Signal(sig syscall.Signal) error { return p.Cmd.Process.Signal(sig) }

// SyncBuffer is an io.Writer safe for concurrent use that keeps the last
// few MiB written: process output, or logs written from other goroutines.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Keep memory bounded for chatty processes: the last 4 MiB is enough.
	if s.b.Len() > 4<<20 {
		tail := append([]byte(nil), s.b.Bytes()[s.b.Len()-(2<<20):]...)
		s.b.Reset()
		s.b.Write(tail)
	}
	return s.b.Write(p)
}

// String returns what was kept.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Eventually polls cond every 10 ms until it returns nil or the deadline
// passes, then fails the test with cond's last error.
func Eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	if err := Poll(context.Background(), within, cond); err != nil {
		t.Fatalf("%s: not true within %v: %v", what, within, err)
	}
}

// Poll is Eventually without a testing.TB: it returns cond's last error if
// the deadline passes or ctx ends first.
func Poll(ctx context.Context, within time.Duration, cond func() error) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if last = cond(); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return last
		case <-tick.C:
		}
	}
}

// WaitHTTP waits until GET url answers 200.
func WaitHTTP(t testing.TB, url string, within time.Duration) {
	t.Helper()
	client := &http.Client{Timeout: time.Second}
	Eventually(t, within, "GET "+url, func() error {
		resp, err := client.Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})
}

// WaitTCP waits until addr accepts TCP connections.
func WaitTCP(t testing.TB, addr string, within time.Duration) {
	t.Helper()
	Eventually(t, within, "dial "+addr, func() error {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			return err
		}
		return c.Close()
	})
}

// WriteFile writes content to dir/name and returns the path.
func WriteFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// ContainsAll reports which of want are missing from s.
func ContainsAll(s string, want ...string) []string {
	var missing []string
	for _, w := range want {
		if !strings.Contains(s, w) {
			missing = append(missing, w)
		}
	}
	return missing
}
