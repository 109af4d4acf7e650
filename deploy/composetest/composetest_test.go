package composetest

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/switchyard/switchyard/internal/testutil"
)

func TestRelocation(t *testing.T) {
	r := Relocation{From: netip.MustParsePrefix("10.231.0.0/24"), To: netip.MustParsePrefix("10.231.77.0/24")}
	for in, want := range map[string]string{
		"10.231.0.11":                         "10.231.77.11",
		"-extproc-advertise=10.231.0.11:9002": "-extproc-advertise=10.231.77.11:9002",
		"http://10.231.0.21:8000/health":      "http://10.231.77.21:8000/health",
		"10.231.0.128/25":                     "10.231.77.128/25",
		"10.231.1.11 and 10.23.0.1":           "10.231.1.11 and 10.23.0.1", // outside From
		"110.231.0.11":                        "110.231.0.11",
		"no address":                          "no address",
	} {
		if got := r.String(in); got != want {
			t.Errorf("String(%q) = %q, want %q", in, got, want)
		}
	}
	if !r.Mentions("x 10.231.0.5") || r.Mentions("10.231.5.5") {
		t.Error("Mentions is wrong")
	}
}

func TestVersionAtLeast(t *testing.T) {
	for _, tc := range []struct {
		have, want string
		ok         bool
	}{
		{"2.40.3", "2.24.0", true}, {"2.24.0", "2.24.0", true}, {"2.23.9", "2.24.0", false},
		{"3.0.0", "2.24.0", true}, {"2.24", "2.24.0", false}, {"2.40.3-desktop.1", "2.24.0", true}, {"", "2.24.0", false},
	} {
		if got := versionAtLeast(tc.have, tc.want); got != tc.ok {
			t.Errorf("versionAtLeast(%q, %q) = %v", tc.have, tc.want, got)
		}
	}
}

func TestLoad(t *testing.T) {
	var n atomic.Int64
	l := StartLoad(3, func(ctx context.Context) error {
		time.Sleep(time.Millisecond)
		if n.Add(1)%10 == 0 {
			return errors.New("boom")
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.WaitDone(ctx, 50); err != nil {
		t.Fatal(err)
	}
	r := l.Stop()
	if r.Requests < 50 || len(r.Failures) < 3 || len(r.Failures) > r.Requests/10+3 {
		t.Fatalf("%d requests, %d failures; want >= 50 and about a tenth failed", r.Requests, len(r.Failures))
	}
	for _, f := range r.Failures {
		if f.Err != "boom" || f.Seq < 1 || f.Seq > r.Requests || f.At.Before(f.Start) {
			t.Errorf("failure %+v", f)
		}
	}
	if done := l.Done(); done != r.Requests {
		t.Errorf("Done() = %d after Stop, Result says %d", done, r.Requests)
	}
	if s := r.String(); !strings.HasPrefix(s, fmt.Sprintf("%d of %d failed (first: #", len(r.Failures), r.Requests)) {
		t.Errorf("String() = %q", s)
	}
}

// TestLoadDrain: Drain sends nothing more and counts the requests in
// flight, the slow ones included, where Stop abandons them.
func TestLoadDrain(t *testing.T) {
	release := make(chan struct{})
	var started atomic.Int64
	l := StartLoad(2, func(ctx context.Context) error {
		if started.Add(1) <= 2 {
			return nil
		}
		select { // hangs until released, as a request on a vanished host
		case <-release:
			return errors.New("timed out")
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	for started.Load() < 4 { // both workers hang now
		time.Sleep(time.Millisecond)
	}
	done := make(chan Result)
	go func() { done <- l.Drain() }()
	time.Sleep(10 * time.Millisecond) // Drain waits for them
	close(release)
	r := <-done
	if r.Requests != 4 || len(r.Failures) != 2 || started.Load() != 4 {
		t.Fatalf("drained %d requests (%d started), %d failed; want the 2 hanging ones counted as failed and none sent after", r.Requests, started.Load(), len(r.Failures))
	}
}

// TestOverrideOfTheStack moves the repository's compose stack to another
// subnet and loopback ports, then loads it the way Compose does (its own
// files plus the override): every static address, advertised address,
// subnet and registration moved, every published port on 127.0.0.1, and
// the rest untouched.
func TestOverrideOfTheStack(t *testing.T) {
	root := testutil.RepoRoot(t)
	compose := filepath.Join(root, "docker-compose.yaml")
	load := func(files ...string) *types.Project {
		opts, err := cli.NewProjectOptions(files, cli.WithWorkingDirectory(root), cli.WithEnv(nil),
			cli.WithDiscardEnvFile, cli.WithResolvedPaths(true))
		if err != nil {
			t.Fatal(err)
		}
		p, err := cli.ProjectFromOptions(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	base := load(compose)
	r := Relocation{From: netip.MustParsePrefix("10.231.0.0/24"), To: netip.MustParsePrefix("10.231.77.0/24")}
	tls := filepath.Join(root, "examples", "compose", "tls")
	mounts := map[string]string{}
	for _, d := range []string{"envoy", "switchyard-1", "switchyard-2"} {
		mounts[filepath.Join(tls, d)] = "/elsewhere/" + d
	}
	port := 20000
	moved, err := Override(base, Move{Reloc: r, Dir: t.TempDir(), Mounts: mounts,
		HostPort: func(string, uint32) int { port++; return port }})
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "override.yaml")
	if err := os.WriteFile(f, []byte(moved.Override), 0o644); err != nil {
		t.Fatal(err)
	}
	p := load(compose, f)
	if got := p.Networks["switchyard"].Ipam.Config[0]; got.Subnet != "10.231.77.0/24" || got.IPRange != "10.231.77.128/25" || got.Gateway != "10.231.77.1" {
		t.Errorf("network moved to %+v", got)
	}
	for name, s := range p.Services {
		before := base.Services[name]
		if want := r.String(before.Networks["switchyard"].Ipv4Address); s.Networks["switchyard"].Ipv4Address != want {
			t.Errorf("%s: address %s, want %s", name, s.Networks["switchyard"].Ipv4Address, want)
		}
		if got, want := strings.Join(s.Command, " "), r.String(strings.Join(before.Command, " ")); got != want {
			t.Errorf("%s: command %q, want %q", name, got, want)
		}
		if len(s.Ports) != len(before.Ports) {
			t.Errorf("%s: ports %+v, want as many as %+v", name, s.Ports, before.Ports)
		}
		for _, pc := range s.Ports {
			if pc.HostIP != "127.0.0.1" || pc.Published != strconv.Itoa(moved.Ports[name][pc.Target]) {
				t.Errorf("%s: port %+v, want 127.0.0.1:%d", name, pc, moved.Ports[name][pc.Target])
			}
		}
		if len(s.Volumes) != len(before.Volumes) {
			t.Errorf("%s: volumes %+v, want as many as %+v", name, s.Volumes, before.Volumes)
		}
		if s.Image != before.Image || (s.HealthCheck == nil) != (before.HealthCheck == nil) || len(s.DependsOn) != len(before.DependsOn) {
			t.Errorf("%s: changed beyond addresses, ports and mounts", name)
		}
	}
	for _, v := range p.Services["envoy"].Volumes {
		if v.Target == "/etc/envoy/switchyard-tls" && (v.Source != "/elsewhere/envoy" || !v.ReadOnly) {
			t.Errorf("envoy's certificates come from %s (ro %v), want the replacement", v.Source, v.ReadOnly)
		}
	}
	for _, v := range p.Services["consul"].Volumes {
		if v.Target != "/consul/services" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(v.Source, "vllm-sim-1.json"))
		if err != nil || !strings.Contains(string(b), `"http://10.231.77.21:8000/health"`) || strings.Contains(string(b), "10.231.0.") {
			t.Errorf("consul's definitions at %s not moved: %v\n%s", v.Source, err, b)
		}
	}
}

// TestCopyTreeModes: copies are readable by the containers' users whatever
// the umask. Not parallel: the umask is the process's.
func TestCopyTreeModes(t *testing.T) {
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "a"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "a", "f.json"), []byte("10.231.0.5"), 0o600); err != nil {
		t.Fatal(err)
	}
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dst := filepath.Join(t.TempDir(), "copy")
	r := Relocation{From: netip.MustParsePrefix("10.231.0.0/24"), To: netip.MustParsePrefix("10.9.9.0/24")}
	if err := CopyTree(src, dst, r.String); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{dst: 0o755, filepath.Join(dst, "a"): 0o755, filepath.Join(dst, "a", "f.json"): 0o644} {
		if info, err := os.Stat(p); err != nil || info.Mode().Perm() != want {
			t.Errorf("%s: %v %v, want %v", p, info.Mode().Perm(), err, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "a", "f.json")); string(b) != "10.9.9.5" {
		t.Errorf("copy says %q", b)
	}
}
