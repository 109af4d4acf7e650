package main

import (
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// freeOffset finds a port offset at which every demo port is free.
func freeOffset(t *testing.T) int {
	t.Helper()
	all := append(append([]int{}, basePorts.sims...), basePorts.listener, basePorts.extproc, basePorts.xds, basePorts.admin, basePorts.envoyAdmin)
	for off := 20000 + testutil.FreePort(t)%20000; off < 47000; off += 97 {
		ok := true
		for _, p := range all {
			if portFree(p+off) != nil {
				ok = false
				break
			}
		}
		if ok {
			return off
		}
	}
	t.Fatal("no free port offset for the demo")
	return 0
}

func demoBinary(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "demo")
	cmd := exec.Command("go", "build", "-o", out, "./examples/demo")
	cmd.Dir = testutil.RepoRoot(t)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build demo: %v\n%s", err, b)
	}
	return out
}

func demoArgs(t *testing.T, off int) []string {
	root := testutil.RepoRoot(t)
	return []string{
		"-switchyard", testutil.Binary(t, "switchyard"),
		"-sim", testutil.Binary(t, "vllm-sim"),
		"-envoy", testutil.EnvoyPath(t),
		"-config", filepath.Join(root, "examples", "demo"),
		"-dir", t.TempDir(),
		"-port-offset", fmt.Sprint(off),
		"-time-scale", "20",
	}
}

// The printed curl gets a completion: the demo's smoke mode sends exactly
// that request through Envoy and the picker.
func TestDemoSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and three simulators")
	}
	off := freeOffset(t)
	cmd := exec.Command(demoBinary(t), append(demoArgs(t, off), "-smoke")...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo -smoke: %v\n%s", err, out)
	}
	for _, want := range []string{"switchyard demo is up", "curl -s http://127.0.0.1:", "smoke request answered", `"model":"chat"`, `"object":"chat.completion"`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

// Ctrl-C stops every process the demo started: all its ports are free again.
func TestDemoCtrlCStopsEverything(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and three simulators")
	}
	off := freeOffset(t)
	p := testutil.Start(t, "demo", demoBinary(t), demoArgs(t, off)...)
	testutil.Eventually(t, 60*time.Second, "demo up", func() error {
		if p.Exited() {
			t.Fatalf("demo exited early:\n%s", p.Output())
		}
		if !strings.Contains(p.Output(), "Press Ctrl-C") {
			return fmt.Errorf("not up yet")
		}
		return nil
	})
	if err := p.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	case <-time.After(30 * time.Second):
		t.Fatalf("demo did not stop after SIGINT:\n%s", p.Output())
	}
	for _, port := range append(append([]int{}, basePorts.sims...), basePorts.listener, basePorts.extproc, basePorts.xds, basePorts.admin, basePorts.envoyAdmin) {
		testutil.Eventually(t, 5*time.Second, fmt.Sprintf("port %d released", port+off), func() error {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port+off), 100*time.Millisecond)
			if err == nil {
				c.Close()
				return fmt.Errorf("still accepting connections")
			}
			return nil
		})
	}
}
