package deploy

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclparse"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/testutil"
)

// The disaggregated-pool example.
const (
	pdComposeFile   = "examples/pd/docker-compose.yaml"
	pdBootstrapFile = "examples/pd/envoy-bootstrap.yaml"
	pdNetwork       = "pd"
)

func loadPDProject(t *testing.T) *types.Project {
	t.Helper()
	root := testutil.RepoRoot(t)
	file := filepath.Join(root, pdComposeFile)
	opts, err := cli.NewProjectOptions([]string{file},
		cli.WithWorkingDirectory(filepath.Dir(file)),
		cli.WithEnv(nil),
		cli.WithDiscardEnvFile,
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		t.Fatalf("compose options: %v", err)
	}
	p, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		t.Fatalf("load %s: %v", pdComposeFile, err)
	}
	return p
}

// TestPDComposeExample checks examples/pd: every service is built from the
// project's Dockerfiles or pinned, restarts, is health-checked and has
// bounded logs; the configuration validates; every pool endpoint is a
// service of the stack in the role the configuration gives it; each decode
// endpoint is a sidecar sharing its decoder's network namespace, the
// decoder listening on loopback only; the sidecars trust only the pool's
// prefill servers.
func TestPDComposeExample(t *testing.T) {
	p := loadPDProject(t)
	root := testutil.RepoRoot(t)

	for _, name := range serviceNames(p) {
		s := p.Services[name]
		if s.Restart != types.RestartPolicyUnlessStopped {
			t.Errorf("%s: restart %q, want unless-stopped", name, s.Restart)
		}
		if hc := s.HealthCheck; hc == nil || len(hc.Test) < 2 || hc.Interval == nil || hc.Timeout == nil || hc.Retries == nil {
			t.Errorf("%s: no complete health check", name)
		}
		if s.Logging == nil || s.Logging.Options["max-size"] == "" {
			t.Errorf("%s: logging has no max-size", name)
		}
		if s.Build == nil && (!strings.Contains(s.Image, ":") || strings.HasSuffix(s.Image, ":latest")) {
			t.Errorf("%s: image %q is not pinned", name, s.Image)
		}
	}
	checkBuild(t, root, service(t, p, "switchyard"), switchyardDockerfile)

	// The configuration the stack mounts validates, and names the stack.
	sy := service(t, p, "switchyard")
	dir := bindSourceFor(t, sy, switchyardConfigTarget)
	out, err := exec.Command(testutil.Binary(t, "switchyard"), "validate", "-config", dir).CombinedOutput()
	if err != nil || !bytes.HasPrefix(out, []byte("ok:")) {
		t.Fatalf("switchyard validate -config %s: %v\n%s", dir, err, out)
	}
	pools := readPDPools(t, dir)
	if len(pools) != 1 {
		t.Fatalf("want one disaggregated pool in %s, got %d", dir, len(pools))
	}
	pool := pools[0]

	// Services by the address they serve on the stack's network.
	byIP := map[string]types.ServiceConfig{}
	for _, name := range serviceNames(p) {
		s := p.Services[name]
		if n, ok := s.Networks[pdNetwork]; ok && n != nil && n.Ipv4Address != "" {
			byIP[n.Ipv4Address] = s
		}
	}
	var prefillers, decoders int
	for _, ep := range pool.endpoints {
		host, port := hostPort(t, "endpoint", ep.Address)
		s, ok := byIP[host]
		if !ok {
			t.Errorf("endpoint %s: no service has IP %s", ep.Address, host)
			continue
		}
		checkBuild(t, root, s, simDockerfile)
		flags, _ := flagValues(s.Command)
		switch ep.Role {
		case "prefill":
			prefillers++
			if flags["host"] != "0.0.0.0" || flags["port"] != strconv.Itoa(port) {
				t.Errorf("prefill server %s (%s) listens on %s:%s", ep.Address, s.Name, flags["host"], flags["port"])
			}
			if flags["kv-connector"] != "NixlConnector" || flags["kv-side-channel-host"] != host {
				t.Errorf("prefill server %s: -kv-connector %q -kv-side-channel-host %q, want NixlConnector and its own IP", ep.Address, flags["kv-connector"], flags["kv-side-channel-host"])
			}
		case "decode":
			decoders++
			checkDecoder(t, p, s, ep.Address, port, pool.name)
		default:
			t.Errorf("endpoint %s has role %s; the example keeps the roles apart", ep.Address, ep.Role)
		}
	}
	if prefillers < 1 || decoders < 2 {
		t.Errorf("%d prefill and %d decode endpoints; want at least 1 and 2", prefillers, decoders)
	}
	if _, err := os.Stat(filepath.Join(root, "examples/pd/README.md")); err != nil {
		t.Errorf("examples/pd has no README: %v", err)
	}
}

// checkDecoder checks a decode endpoint: the decode server s listens on its
// loopback only, and a sidecar in its network namespace serves the
// endpoint's port, forwards to it and trusts the pool's prefill servers.
func checkDecoder(t *testing.T, p *types.Project, s types.ServiceConfig, addr string, port int, pool string) {
	t.Helper()
	flags, _ := flagValues(s.Command)
	if flags["host"] != "127.0.0.1" || flags["kv-connector"] != "NixlConnector" {
		t.Errorf("decode server %s: -host %q -kv-connector %q; want 127.0.0.1 (only its sidecar reaches it) and NixlConnector", s.Name, flags["host"], flags["kv-connector"])
	}
	var sidecar *types.ServiceConfig
	for _, name := range serviceNames(p) {
		c := p.Services[name]
		if c.NetworkMode == "service:"+s.Name {
			sidecar = &c
		}
	}
	if sidecar == nil {
		t.Errorf("decode endpoint %s: no service shares %s's network namespace", addr, s.Name)
		return
	}
	checkBuild(t, testutil.RepoRoot(t), *sidecar, sidecarDockerfile)
	sf, _ := flagValues(sidecar.Command)
	if _, lp := hostPort(t, sidecar.Name+" -listen", sf["listen"]); lp != port {
		t.Errorf("%s listens on %s, want the endpoint's port %d", sidecar.Name, sf["listen"], port)
	}
	if want := "http://" + net.JoinHostPort("127.0.0.1", flags["port"]); sf["decoder"] != want {
		t.Errorf("%s -decoder %q, want %q", sidecar.Name, sf["decoder"], want)
	}
	if _, ok := sf["allow-any-prefiller"]; ok {
		t.Errorf("%s trusts any prefill server a request names", sidecar.Name)
	}
	if sf["pool"] != pool || sf["config"] != switchyardConfigTarget {
		t.Errorf("%s -config %q -pool %q, want %s and %q", sidecar.Name, sf["config"], sf["pool"], switchyardConfigTarget, pool)
	}
	bindSourceFor(t, *sidecar, switchyardConfigTarget)
	if d, ok := sidecar.DependsOn[s.Name]; !ok || d.Condition == "" {
		t.Errorf("%s does not depend on %s", sidecar.Name, s.Name)
	}
}

// TestPDEnvoyBootstrap checks the example's Envoy bootstrap: the shipped
// one, plain, with ADS at the switchyard service (-update regenerates it).
func TestPDEnvoyBootstrap(t *testing.T) {
	p := loadPDProject(t)
	root := testutil.RepoRoot(t)
	env := service(t, p, svcEnvoy)
	src := bindSourceFor(t, env, envoyBootstrapTarget)
	if rel, _ := filepath.Rel(root, src); filepath.ToSlash(rel) != pdBootstrapFile {
		t.Errorf("envoy mounts %s, want %s", rel, pdBootstrapFile)
	}
	_, xdsPort := hostPort(t, "switchyard -xds-addr", serveFlags(t, service(t, p, "switchyard"))["xds-addr"])
	servers := []string{net.JoinHostPort("switchyard", strconv.Itoa(xdsPort))}
	want, err := envoy.Bootstrap(envoy.Params{NodeID: envoyNodeID, XDSServers: servers, AdminHost: "127.0.0.1", AdminPort: envoyAdminPort})
	if err != nil {
		t.Fatal(err)
	}
	want = "# Generated from envoy/bootstrap.yaml for examples/pd/docker-compose.yaml by\n" +
		"#   go -C deploy test -run TestPDEnvoyBootstrap -update .\n" +
		"# ADS: " + strings.Join(servers, ", ") + ". Do not edit by hand.\n\n" + want
	path := filepath.Join(root, pdBootstrapFile)
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (generate it with -update)", err)
	}
	if string(got) != want {
		t.Errorf("%s is out of date; regenerate with go -C deploy test -run TestPDEnvoyBootstrap -update .", pdBootstrapFile)
	}
	if listed := xdsEndpoints(string(got)); !slices.Equal(listed, servers) {
		t.Errorf("%s lists xDS servers %v, want %v", pdBootstrapFile, listed, servers)
	}
}

// pdPool is a disaggregated pool of the example's configuration.
type pdPool struct {
	name      string
	endpoints []struct{ Address, Role string }
}

// readPDPools reads the pools with a disaggregation block from every
// *.hcl file of dir, with the plain HCL parser (switchyard validate has
// judged the files already).
func readPDPools(t *testing.T, dir string) []pdPool {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "*.hcl"))
	parser := hclparse.NewParser()
	var out []pdPool
	for _, path := range files {
		f, diags := parser.ParseHCLFile(path)
		if diags.HasErrors() {
			t.Fatalf("parse %s: %v", path, diags)
		}
		content, _, _ := f.Body.PartialContent(&hcl.BodySchema{Blocks: []hcl.BlockHeaderSchema{{Type: "pool", LabelNames: []string{"name"}}}})
		for _, b := range content.Blocks {
			pc, _, _ := b.Body.PartialContent(&hcl.BodySchema{Blocks: []hcl.BlockHeaderSchema{
				{Type: "endpoint", LabelNames: []string{"address"}}, {Type: "disaggregation"}}})
			pool := pdPool{name: b.Labels[0]}
			disaggregated := false
			for _, eb := range pc.Blocks {
				if eb.Type == "disaggregation" {
					disaggregated = true
					continue
				}
				pool.endpoints = append(pool.endpoints, struct{ Address, Role string }{eb.Labels[0], stringAttr(t, eb.Body, "role")})
			}
			if disaggregated {
				out = append(out, pool)
			}
		}
	}
	return out
}
