package testutil

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// Consul is a real `consul agent -dev` on free loopback ports, started for
// one test. A dev agent keeps everything in memory: Restart brings it back
// on the same ports with an empty catalog.
type Consul struct {
	// Addr is the HTTP API address, "127.0.0.1:port" (what
	// CONSUL_HTTP_ADDR takes).
	Addr string

	t    testing.TB
	bin  string
	args []string

	mu   sync.Mutex
	proc *Process
	old  []*Process // earlier runs, for output on failure
}

// consulStartWithin bounds how long a dev agent may take to elect itself
// leader; on a loaded 2-core machine running the whole suite this has
// taken over 20 s.
const consulStartWithin = 45 * time.Second

// StartConsul starts a dev agent (DNS and gRPC disabled), waits until it
// elected itself leader, and stops it when the test ends. An agent that
// does not come up is replaced once, on fresh ports, before the test
// fails. It skips the test when Consul is not installed (see ConsulPath).
func StartConsul(t testing.TB) *Consul {
	t.Helper()
	return StartConsulArgs(t)
}

// StartConsulArgs is StartConsul with extra agent flags (e.g. -config-dir
// with service definitions, which the agent registers again on every
// restart, their checks critical until they first pass, as a real host's
// agent does).
func StartConsulArgs(t testing.TB, extra ...string) *Consul {
	t.Helper()
	c := &Consul{t: t, bin: ConsulPath(t)}
	t.Cleanup(func() {
		c.mu.Lock()
		procs := append(append([]*Process(nil), c.old...), c.proc)
		c.mu.Unlock()
		for _, p := range procs {
			if p == nil {
				continue
			}
			p.Stop()
			if t.Failed() {
				t.Logf("--- output of %s ---\n%s", p.Name, p.Output())
			}
		}
	})
	var err error
	for attempt := 1; attempt <= 2; attempt++ {
		httpPort := FreePort(t)
		c.Addr = "127.0.0.1:" + strconv.Itoa(httpPort)
		c.args = []string{
			"agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1", "-node", "switchyard-test",
			"-http-port", strconv.Itoa(httpPort), "-dns-port", "-1", "-grpc-port", "-1", "-grpc-tls-port", "-1",
			"-serf-lan-port", strconv.Itoa(FreePort(t)), "-serf-wan-port", strconv.Itoa(FreePort(t)),
			"-server-port", strconv.Itoa(FreePort(t)), "-log-level", "info",
		}
		c.args = append(c.args, extra...)
		if err = c.start(); err == nil {
			return c
		}
		c.mu.Lock()
		out := c.proc.Output()
		c.mu.Unlock()
		t.Logf("consul attempt %d did not come up: %v\n--- its output ---\n%s", attempt, err, out)
	}
	t.Fatalf("consul did not come up: %v", err)
	return nil
}

// Client returns an API client for the agent.
func (c *Consul) Client() *api.Client {
	c.t.Helper()
	cl, err := api.NewClient(&api.Config{Address: c.Addr})
	if err != nil {
		c.t.Fatalf("consul client: %v", err)
	}
	return cl
}

// Stop stops the agent (SIGTERM, then SIGKILL after 5 s).
func (c *Consul) Stop() {
	c.mu.Lock()
	p := c.proc
	c.mu.Unlock()
	if p != nil {
		p.Stop()
	}
}

// Restart starts the agent again on the same ports (stopping it first if
// it runs) and waits until it has a leader. The catalog starts empty.
func (c *Consul) Restart() {
	c.t.Helper()
	if err := c.start(); err != nil {
		c.t.Fatalf("consul restart: %v", err)
	}
}

// start (re)starts the agent with c.args and waits for its leader.
func (c *Consul) start() error {
	c.Stop()
	p := StartNoCleanup(c.t, "consul", c.bin, c.args...)
	c.mu.Lock()
	if c.proc != nil {
		c.old = append(c.old, c.proc)
	}
	c.proc = p
	c.mu.Unlock()
	cl := c.Client()
	return Poll(context.Background(), consulStartWithin, func() error {
		if p.Exited() {
			return errors.New("consul exited:\n" + p.Output())
		}
		leader, err := cl.Status().Leader()
		if err != nil {
			return err
		}
		if leader == "" {
			return errors.New("no leader yet")
		}
		return nil
	})
}

// Pid returns the agent's process id.
func (c *Consul) Pid() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.proc.Cmd.Process.Pid
}

// StartNoCleanupEnv is StartNoCleanup with extra environment variables
// ("KEY=value", added to the test process's environment), for processes
// configured through the environment, such as switchyard's Consul address
// (CONSUL_HTTP_ADDR).
func StartNoCleanupEnv(t testing.TB, name, bin string, env []string, args ...string) *Process {
	t.Helper()
	SkipProcesses(t, name)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	buf := &SyncBuffer{}
	cmd.Stdout = buf
	cmd.Stderr = buf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	p := &Process{Name: name, Cmd: cmd, out: buf, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p
}
