package deploy

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/zclconf/go-cty/cty"

	"github.com/switchyard/switchyard/internal/testutil"
)

// composeFile is the deployment's compose file, relative to the repository root.
const composeFile = "docker-compose.yaml"

// Service names the stack must define. The switchyard replicas are the
// services built from switchyardDockerfile (replicaServices).
const (
	svcConsul = "consul"
	svcEnvoy  = "envoy"
	// svcConsulGPU is the GPU hosts' Consul client agent (profile "gpu").
	svcConsulGPU = "consul-gpu"
	// svcCLI is the one-off service for switchyard commands (profile
	// "tools").
	svcCLI = "cli"
)

// The replicas: how many the stack runs, and the names they share.
const (
	wantReplicas = 2
	// replicaSAN is the DNS SAN every replica certificate carries: Envoy
	// accepts replicas by it (it is also the SNI Envoy sends), and the
	// replicas admit each other's client certificates by it.
	replicaSAN = "switchyard"
	// envoySAN is the Envoy certificate's SAN the replicas admit.
	envoySAN = "envoy.switchyard.internal"
	// replicaConsulService is the Consul service the replicas register as.
	replicaConsulService = "switchyard"
)

// Dockerfiles, relative to the repository root.
const (
	switchyardDockerfile = "cmd/switchyard/Dockerfile"
	simDockerfile        = "cmd/vllm-sim/Dockerfile"
	sidecarDockerfile    = "cmd/pd-sidecar/Dockerfile"
	gpuImage             = "vllm/vllm-openai"
)

// loadProject parses docker-compose.yaml the way `docker compose` does:
// schema validation, interpolation (with an empty environment, so the file
// must not depend on the caller's variables), merging of YAML anchors and
// consistency checks of every reference to a service, network or volume.
func loadProject(t *testing.T, profiles ...string) *types.Project {
	t.Helper()
	root := testutil.RepoRoot(t)
	opts, err := cli.NewProjectOptions(
		[]string{filepath.Join(root, composeFile)},
		cli.WithWorkingDirectory(root),
		cli.WithEnv(nil),
		cli.WithDiscardEnvFile,
		cli.WithResolvedPaths(true),
		cli.WithProfiles(profiles),
	)
	if err != nil {
		t.Fatalf("compose options: %v", err)
	}
	p, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		t.Fatalf("load %s: %v", composeFile, err)
	}
	return p
}

// service returns the named service or fails the test.
func service(t *testing.T, p *types.Project, name string) types.ServiceConfig {
	t.Helper()
	s, ok := p.Services[name]
	if !ok {
		t.Fatalf("%s: no service %q (have %v)", composeFile, name, serviceNames(p))
	}
	return s
}

func serviceNames(p *types.Project) []string {
	var names []string
	for n := range p.Services {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// gpuServices are the real-vLLM services (official image) of a project
// loaded with the "gpu" profile.
func gpuServices(p *types.Project) []types.ServiceConfig {
	var out []types.ServiceConfig
	for _, name := range serviceNames(p) {
		if s := p.Services[name]; strings.HasPrefix(s.Image, gpuImage+":") {
			out = append(out, s)
		}
	}
	return out
}

// simServices returns the services built from the vllm-sim Dockerfile,
// sorted by name.
func simServices(p *types.Project) []types.ServiceConfig {
	return builtFrom(p, simDockerfile)
}

// replicaServices returns the switchyard replicas (the services built
// from switchyard's Dockerfile), sorted by name; it fails the test unless
// there are wantReplicas of them.
func replicaServices(t *testing.T, p *types.Project) []types.ServiceConfig {
	t.Helper()
	reps := builtFrom(p, switchyardDockerfile)
	if len(reps) != wantReplicas {
		var names []string
		for _, r := range reps {
			names = append(names, r.Name)
		}
		t.Fatalf("%s: want %d switchyard replicas (services built from %s), got %v", composeFile, wantReplicas, switchyardDockerfile, names)
	}
	return reps
}

func builtFrom(p *types.Project, dockerfile string) []types.ServiceConfig {
	var out []types.ServiceConfig
	for _, name := range serviceNames(p) {
		s := p.Services[name]
		if s.Build != nil && filepath.ToSlash(s.Build.Dockerfile) == dockerfile {
			out = append(out, s)
		}
	}
	return out
}

// flagValues parses a Go-flag-style command line ("-name=value",
// "--name=value" or "-name value") into name -> value. Arguments that are
// not flags (subcommands) are returned in rest. A boolean flag written
// without "=" would swallow a following non-flag argument, which is why
// serveFlags insists on -name=value.
func flagValues(args []string) (flags map[string]string, rest []string) {
	flags = map[string]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			rest = append(rest, a)
			continue
		}
		name := strings.TrimLeft(a, "-")
		if k, v, ok := strings.Cut(name, "="); ok {
			flags[k] = v
			continue
		}
		if i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			flags[name] = args[i+1]
			i++
			continue
		}
		flags[name] = ""
	}
	return flags, rest
}

// hostPort splits "host:port" and parses the port.
func hostPort(t *testing.T, what, addr string) (string, int) {
	t.Helper()
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 1 || port > 65535 {
		t.Fatalf("%s: bad port in %q", what, addr)
	}
	return host, port
}

// staticIP returns the service's ipv4_address on the stack's network.
func staticIP(t *testing.T, s types.ServiceConfig, network string) netip.Addr {
	t.Helper()
	n, ok := s.Networks[network]
	if !ok || n == nil || n.Ipv4Address == "" {
		t.Fatalf("service %q has no ipv4_address on network %q", s.Name, network)
	}
	ip, err := netip.ParseAddr(n.Ipv4Address)
	if err != nil {
		t.Fatalf("service %q: ipv4_address: %v", s.Name, err)
	}
	return ip
}

// hclConfig is what the deployment tests need from switchyard's HCL
// configuration, read with the plain HCL parser so that these checks do not
// depend on which blocks switchyard's own decoder supports yet (that is
// TestComposeSwitchyardConfigValidates' job).
type hclConfig struct {
	listeners map[string]string // name -> address
	models    []string
	// consul discovery blocks of pools: pool name -> service, tag.
	consul map[string]consulQuery
	// replicasConsulService is the replicas block's consul_service ("":
	// none).
	replicasConsulService string
}

type consulQuery struct{ service, tag string }

// readHCLConfig reads every *.hcl file of dir.
func readHCLConfig(t *testing.T, dir string) hclConfig {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.hcl"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no *.hcl files in %s (err %v)", dir, err)
	}
	sort.Strings(files)
	cfg := hclConfig{listeners: map[string]string{}, consul: map[string]consulQuery{}}
	parser := hclparse.NewParser()
	root := &hcl.BodySchema{Blocks: []hcl.BlockHeaderSchema{
		{Type: "listener", LabelNames: []string{"name"}},
		{Type: "pool", LabelNames: []string{"name"}},
		{Type: "model", LabelNames: []string{"name"}},
		{Type: "replicas"},
	}}
	for _, path := range files {
		f, diags := parser.ParseHCLFile(path)
		if diags.HasErrors() {
			t.Fatalf("parse %s: %v", path, diags)
		}
		content, _, diags := f.Body.PartialContent(root)
		if diags.HasErrors() {
			t.Fatalf("%s: %v", path, diags)
		}
		for _, b := range content.Blocks {
			switch b.Type {
			case "listener":
				cfg.listeners[b.Labels[0]] = stringAttr(t, b.Body, "address")
			case "model":
				cfg.models = append(cfg.models, b.Labels[0])
			case "replicas":
				cfg.replicasConsulService = stringAttr(t, b.Body, "consul_service")
			case "pool":
				pc, _, diags := b.Body.PartialContent(&hcl.BodySchema{Blocks: []hcl.BlockHeaderSchema{{Type: "consul"}}})
				if diags.HasErrors() {
					t.Fatalf("%s: pool %q: %v", path, b.Labels[0], diags)
				}
				for _, cb := range pc.Blocks {
					cfg.consul[b.Labels[0]] = consulQuery{
						service: stringAttr(t, cb.Body, "service"),
						tag:     stringAttr(t, cb.Body, "tag"),
					}
				}
			}
		}
	}
	return cfg
}

// stringAttr returns a literal string attribute of body ("" when absent).
func stringAttr(t *testing.T, body hcl.Body, name string) string {
	t.Helper()
	attrs, diags := body.JustAttributes()
	if diags.HasErrors() {
		t.Fatalf("%v", diags)
	}
	a, ok := attrs[name]
	if !ok {
		return ""
	}
	v, diags := a.Expr.Value(nil)
	if diags.HasErrors() || !v.IsKnown() || v.IsNull() || !v.Type().Equals(cty.String) {
		t.Fatalf("%s: attribute %q is not a literal: %v", a.Range, name, diags)
	}
	return v.AsString()
}

// dockerignore is a parsed .dockerignore: an ordered list of patterns where
// the last match decides, and "!" re-includes.
type dockerignore []ignoreRule

type ignoreRule struct {
	re     *regexp.Regexp
	negate bool
	text   string
}

func readDockerignore(t *testing.T, path string) dockerignore {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read .dockerignore: %v", err)
	}
	var rules dockerignore
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		r := ignoreRule{text: line}
		if strings.HasPrefix(line, "!") {
			r.negate = true
			line = strings.TrimSpace(line[1:])
		}
		line = strings.TrimPrefix(filepath.ToSlash(filepath.Clean(line)), "/")
		r.re = regexp.MustCompile("^" + globToRegexp(line) + "$")
		rules = append(rules, r)
	}
	return rules
}

// globToRegexp converts a .dockerignore pattern: "**" spans directories,
// "*" and "?" stay within one path element.
func globToRegexp(glob string) string {
	var b strings.Builder
	for i := 0; i < len(glob); i++ {
		switch c := glob[i]; {
		case strings.HasPrefix(glob[i:], "**/"):
			b.WriteString("(.*/)?")
			i += 2
		case strings.HasPrefix(glob[i:], "**"):
			b.WriteString(".*")
			i++
		case c == '*':
			b.WriteString("[^/]*")
		case c == '?':
			b.WriteString("[^/]")
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	return b.String()
}

// excluded reports whether rel (slash-separated, relative to the context)
// is left out of the build context, and by which pattern. A pattern that
// matches a parent directory excludes everything below it.
func (d dockerignore) excluded(rel string) (bool, string) {
	out, by := false, ""
	for _, r := range d {
		if r.matches(rel) {
			out, by = !r.negate, r.text
		}
	}
	return out, by
}

func (r ignoreRule) matches(rel string) bool {
	for p := rel; p != "." && p != "/" && p != ""; p = filepath.ToSlash(filepath.Dir(p)) {
		if r.re.MatchString(p) {
			return true
		}
	}
	return false
}
