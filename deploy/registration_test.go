package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"
	consulapi "github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestComposeRegistrationsLive runs what the stack runs, on loopback: a real
// Consul agent loading the compose service definitions and one real
// vllm-sim per simulator service, started with that service's command. The
// definitions are moved to 127.0.0.1 and free ports (everything else is
// kept), then the test checks that Consul reports every simulator as a
// passing instance of the service and tag switchyard's pool asks for, with
// the meta as written, and that a stopped simulator drops out of the
// passing set.
func TestComposeRegistrationsLive(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Consul and simulators")
	}
	consulBin := testutil.ConsulPath(t)
	simBin := testutil.Binary(t, "vllm-sim")

	p := loadProject(t)
	srcDir := bindSourceFor(t, service(t, p, svcConsul), consulServicesTarget)
	cfg := readHCLConfig(t, bindSourceFor(t, service(t, p, svcSwitchyard), switchyardConfigTarget))
	var query consulQuery
	for _, q := range cfg.consul {
		query = q
	}

	type simRun struct {
		proc *testutil.Process
		addr string
		meta map[string]string
	}
	runs := map[string]*simRun{}
	confDir := t.TempDir()
	for _, sim := range simServices(p) {
		port := testutil.FreePort(t)
		args := []string{"-host=127.0.0.1", "-port=" + strconv.Itoa(port)}
		flags, _ := flagValues(sim.Command)
		for _, a := range sim.Command {
			if name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-"); name == "host" || name == "port" {
				continue
			}
			args = append(args, a)
		}
		proc := testutil.Start(t, sim.Name, simBin, args...)
		addr := "127.0.0.1:" + strconv.Itoa(port)
		meta := relocateDefinition(t, filepath.Join(srcDir, sim.Name+".json"), filepath.Join(confDir, sim.Name+".json"),
			staticIP(t, sim, stackNetwork).String()+":"+flags["port"], addr)
		runs[sim.Name] = &simRun{proc: proc, addr: addr, meta: meta}
	}

	httpAddr := testutil.FreeAddr(t)
	_, httpPort := hostPort(t, "consul http", httpAddr)
	testutil.Start(t, "consul", consulBin, "agent", "-dev",
		"-node=deploy-test", "-bind=127.0.0.1", "-client=127.0.0.1",
		"-http-port="+strconv.Itoa(httpPort),
		"-serf-lan-port="+strconv.Itoa(testutil.FreePort(t)),
		"-serf-wan-port="+strconv.Itoa(testutil.FreePort(t)),
		"-server-port="+strconv.Itoa(testutil.FreePort(t)),
		"-dns-port=-1", "-grpc-port=-1", "-grpc-tls-port=-1",
		"-config-dir="+confDir)
	client, err := consulapi.NewClient(&consulapi.Config{Address: httpAddr})
	if err != nil {
		t.Fatal(err)
	}

	passing := func() (map[string]*consulapi.ServiceEntry, error) {
		entries, _, err := client.Health().Service(query.service, query.tag, true, nil)
		if err != nil {
			return nil, err
		}
		out := map[string]*consulapi.ServiceEntry{}
		for _, e := range entries {
			out[e.Service.ID] = e
		}
		return out, nil
	}
	want := sortedKeys(runs)
	testutil.Eventually(t, 30*time.Second, "every simulator passing in Consul", func() error {
		got, err := passing()
		if err != nil {
			return err
		}
		if ids := sortedKeys(got); strings.Join(ids, ",") != strings.Join(want, ",") {
			return fmt.Errorf("passing %v, want %v", ids, want)
		}
		return nil
	})
	got, _ := passing()
	for id, run := range runs {
		e := got[id]
		if addr := fmt.Sprintf("%s:%d", e.Service.Address, e.Service.Port); addr != run.addr {
			t.Errorf("%s: Consul reports %s, want %s", id, addr, run.addr)
		}
		for k, v := range run.meta {
			if e.Service.Meta[k] != v {
				t.Errorf("%s: Consul reports meta %s=%q, want %q", id, k, e.Service.Meta[k], v)
			}
		}
	}

	// switchyard starts with the compose command and configuration, next
	// to this Consul, and turns healthy by the compose health check.
	t.Run("switchyard", func(t *testing.T) {
		startSwitchyardLikeCompose(t, p, httpAddr)
	})

	// A simulator that stops fails its check and leaves the passing set.
	stopped := want[0]
	runs[stopped].proc.Stop()
	testutil.Eventually(t, 30*time.Second, stopped+" leaves the passing set", func() error {
		got, err := passing()
		if err != nil {
			return err
		}
		if _, ok := got[stopped]; ok {
			return fmt.Errorf("%s still passing", stopped)
		}
		if len(got) != len(want)-1 {
			return fmt.Errorf("passing %v", sortedKeys(got))
		}
		return nil
	})
}

// relocateDefinition copies a Consul service definition, moving it from
// the compose address from (ip:port) to the loopback address to and
// checking every second for speed; it returns the definition's meta.
func relocateDefinition(t *testing.T, src, dst, from, to string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	var def map[string]map[string]any
	if err := json.Unmarshal(b, &def); err != nil {
		t.Fatalf("%s: %v", src, err)
	}
	svc := def["service"]
	host, port := hostPort(t, "relocate", to)
	if fmt.Sprintf("%v:%v", svc["address"], svc["port"]) != from {
		t.Fatalf("%s: registers %v:%v, want %s", src, svc["address"], svc["port"], from)
	}
	svc["address"], svc["port"] = host, port
	checks, _ := svc["checks"].([]any)
	for _, c := range checks {
		check := c.(map[string]any)
		check["http"] = strings.Replace(check["http"].(string), from, to, 1)
		check["interval"] = "1s"
	}
	out, err := json.Marshal(def)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, out, 0o600); err != nil {
		t.Fatal(err)
	}
	meta := map[string]string{}
	m, _ := svc["meta"].(map[string]any)
	for k, v := range m {
		meta[k] = fmt.Sprint(v)
	}
	if len(meta) == 0 {
		t.Fatalf("%s: no meta", src)
	}
	return meta
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// startSwitchyardLikeCompose runs the switchyard binary with the switchyard
// service's command line, moved to loopback: listen addresses get free
// ports, -extproc-advertise follows -extproc-addr, -config names the
// directory compose mounts and -store a temporary file. It then runs the
// service's health check (wget on /readyz, moved to the admin port) until
// it passes.
func startSwitchyardLikeCompose(t *testing.T, p *types.Project, consulAddr string) {
	sy := service(t, p, svcSwitchyard)
	flags := serveFlags(t, sy)
	bin := testutil.Binary(t, "switchyard")
	help, _ := exec.Command(bin, "serve", "-h").CombinedOutput()
	hasStore := regexp.MustCompile(`(?m)^\s+-store\b`).Match(help)
	wget, err := exec.LookPath("wget")
	if err != nil {
		t.Skip("wget not installed; cannot run the compose health check")
	}

	extproc, admin := testutil.FreeAddr(t), testutil.FreeAddr(t)
	// The certificates `make compose-certs` would mount.
	certs := t.TempDir()
	devcerts(t, certs)
	args := []string{"serve"}
	for _, name := range sortedKeys(flags) {
		v := flags[name]
		switch name {
		case "config":
			v = bindSourceFor(t, sy, v)
		case "store":
			if !hasStore {
				t.Logf("switchyard serve has no -store flag yet; starting without it")
				continue
			}
			v = filepath.Join(t.TempDir(), path.Base(v))
		case "extproc-addr", "extproc-advertise":
			v = extproc
		case "admin-addr":
			v = admin
		case "xds-addr":
			v = testutil.FreeAddr(t)
		case "tls-cert", "tls-key", "tls-client-ca":
			v = filepath.Join(certs, "switchyard", path.Base(v))
		}
		args = append(args, "-"+name+"="+v)
	}
	// The child inherits the environment: the compose service's, with
	// Consul moved to the test's agent.
	for k, v := range sy.Environment {
		if v != nil {
			t.Setenv(k, *v)
		}
	}
	t.Setenv("CONSUL_HTTP_ADDR", consulAddr)
	proc := testutil.StartNoCleanup(t, svcSwitchyard, bin, args...)
	t.Cleanup(func() {
		proc.Stop()
		if t.Failed() {
			t.Logf("switchyard %q output:\n%s", args, proc.Output())
		}
	})

	test := sy.HealthCheck.Test
	if len(test) < 2 || test[0] != "CMD" || test[1] != "wget" {
		t.Fatalf("switchyard healthcheck %q: want [CMD wget ...]", test)
	}
	_, adminPort := hostPort(t, "-admin-addr", flags["admin-addr"])
	_, freePort := hostPort(t, "admin", admin)
	composeURL, testURL := "127.0.0.1:"+strconv.Itoa(adminPort), "127.0.0.1:"+strconv.Itoa(freePort)
	probe := make([]string, 0, len(test)-1)
	for _, a := range test[1:] {
		probe = append(probe, strings.Replace(a, composeURL, testURL, 1))
	}
	if !strings.Contains(strings.Join(probe, " "), testURL) {
		t.Fatalf("switchyard healthcheck %q does not probe the admin address %s", test, composeURL)
	}
	testutil.Eventually(t, 20*time.Second, "switchyard health check passes", func() error {
		if proc.Exited() {
			t.Fatalf("switchyard exited:\n%s", proc.Output())
		}
		out, err := exec.Command(wget, probe[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%q: %v: %s", probe, err, out)
		}
		return nil
	})
}
