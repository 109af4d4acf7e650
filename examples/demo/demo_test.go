package main

import (
	"context"
	"fmt"
	"image/color"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/internal/testutil"
)

// freeOffset finds a port offset at which every port of a demo with
// maxReplicas replicas is free. The demo's ports (8001-18004 plus the
// offset) stay below the kernel's ephemeral range, as testutil.FreePort's
// do: a port in that range can be taken by any outgoing connection on the
// machine between this probe and the demo binding it.
func freeOffset(t *testing.T) int {
	t.Helper()
	all := demoPorts(maxReplicas)
	lo, hi := 10000-slices.Min(all), testutil.EphemeralStart()-slices.Max(all)
	if hi <= lo {
		t.Fatalf("no room for the demo's ports below the ephemeral range (%d)", testutil.EphemeralStart())
	}
	start := testutil.FreePort(t) % (hi - lo)
	for i := 0; i < hi-lo; i += 97 {
		off := lo + (start+i)%(hi-lo)
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
	testutil.SkipProcesses(t, "go build ./examples/demo")
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
	// The adapter lives on the third simulator only (demo port 8003).
	lora := fmt.Sprintf("sql-lora requests answered by map[127.0.0.1:%d:6]", basePorts.sims[2]+off)
	for _, want := range []string{"switchyard demo is up", "curl -s http://127.0.0.1:", "smoke request answered", `"model":"chat"`, `"object":"chat.completion"`, lora,
		"(status page: pools, endpoints, Envoys; JSON at /api/status)", "200 KiB prompt answered"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

// `make run REPLICAS=2`: two switchyard replicas from a static peers list,
// one Envoy whose bootstrap lists both xDS servers. The printed requests
// work, Envoy spreads requests over both pickers (each picks some of
// them), each replica lists both, and the banner names both status pages.
func TestDemoSmokeTwoReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, two switchyards and three simulators")
	}
	off := freeOffset(t)
	cmd := exec.Command(demoBinary(t), append(demoArgs(t, off), "-replicas", "2", "-smoke")...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo -replicas 2 -smoke: %v\n%s", err, out)
	}
	lora := fmt.Sprintf("sql-lora requests answered by map[127.0.0.1:%d:6]", basePorts.sims[2]+off)
	want := []string{"smoke request answered", `"object":"chat.completion"`, lora, "200 KiB prompt answered",
		"spread over the 2 replicas", "every replica lists 2 replicas"}
	for i := range 2 {
		want = append(want, fmt.Sprintf("switchyard-%d   http://127.0.0.1:%d/", i+1, basePorts.admin+i+off))
	}
	if missing := testutil.ContainsAll(string(out), want...); len(missing) > 0 {
		t.Fatalf("demo output lacks %q:\n%s", missing, out)
	}
	m := regexp.MustCompile(`(\d+) requests answered; picks per replica: switchyard-1=(\d+) switchyard-2=(\d+);`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("no picks per replica in the output:\n%s", out)
	}
	sent, _ := strconv.Atoi(m[1])
	p1, _ := strconv.Atoi(m[2])
	p2, _ := strconv.Atoi(m[3])
	if p1 == 0 || p2 == 0 || p1+p2 != sent {
		t.Errorf("%d requests, picks switchyard-1 %d, switchyard-2 %d: want each > 0, adding up to the requests", sent, p1, p2)
	}
}

// `make run ENGINE=vllm`: the same demo and the same printed requests on
// three real vLLM servers; the adapter request reaches only the third.
func TestDemoSmokeRealVLLM(t *testing.T) {
	realvllm.Require(t)
	off := freeOffset(t)
	args := append(demoArgs(t, off), "-engine", "vllm",
		"-vllm-src", filepath.Join(testutil.RepoRoot(t), "internal", "realvllm"), "-smoke")
	ctx, cancel := context.WithTimeout(context.Background(), 2*realvllm.StartTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, demoBinary(t), args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo -engine vllm -smoke: %v\n%s", err, out)
	}
	lora := fmt.Sprintf("sql-lora requests answered by map[127.0.0.1:%d:6]", basePorts.sims[2]+off)
	for _, want := range []string{"real vLLM, CPU build", "smoke request answered", `"model":"chat"`, `"object":"chat.completion"`, lora} {
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
	for _, port := range demoPorts(1) {
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

// The status page, rendered by a real browser against the running demo,
// shows the demo's pool, its three endpoints with their load, the models
// and the connected Envoy.
func TestDemoStatusPageInChromium(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the demo and a browser")
	}
	testutil.ChromiumPath(t)
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
	// Send a few requests so the page has load to show.
	base := fmt.Sprintf("http://127.0.0.1:%d", basePorts.listener+off)
	for i := 0; i < 5; i++ {
		if _, _, err := post(context.Background(), base+"/v1/chat/completions",
			`{"model":"chat","messages":[{"role":"user","content":"hello"}],"max_tokens":8}`); err != nil {
			t.Fatal(err)
		}
	}
	page := fmt.Sprintf("http://127.0.0.1:%d/", basePorts.admin+off)
	dom := string(testutil.Headless(t, 1280, 1000, "--dump-dom", page))
	want := []string{"switchyard", "llama", "vllm, fail_closed", "llama-v2, sql-lora"}
	for _, sp := range basePorts.sims {
		want = append(want, fmt.Sprintf("127.0.0.1:%d", sp+off))
	}
	want = append(want, "meta-llama/Llama-3.1-8B-Instruct", "sql-lora", "demo-envoy", "ready")
	if missing := testutil.ContainsAll(dom, want...); len(missing) > 0 {
		t.Fatalf("status page lacks %q; rendered DOM:\n%s", missing, dom)
	}
	if !strings.Contains(dom, `<span id="stale"></span>`) {
		t.Fatalf("page could not fetch /api/status:\n%s", dom)
	}

	shot := filepath.Join(t.TempDir(), "status.png")
	if dir := os.Getenv("SWITCHYARD_SCREENSHOT_DIR"); dir != "" {
		shot = filepath.Join(dir, "status.png")
	}
	testutil.Headless(t, 1280, 1000, "--screenshot="+shot, page)
	img := testutil.DecodePNG(t, shot)
	// A rendered page has text, tables and the header: many distinct
	// colours; a blank or error page has a handful.
	colours := map[color.Color]bool{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y += 3 {
		for x := b.Min.X; x < b.Max.X; x += 3 {
			colours[img.At(x, y)] = true
		}
	}
	if len(colours) < 20 {
		t.Fatalf("screenshot looks blank: %d distinct colours", len(colours))
	}
}
