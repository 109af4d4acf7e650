package deploy

import (
	"bufio"
	"context"
	"encoding/json"
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

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/testutil"
)

// The multi-host example: one compose file per role, each run on its own
// VM with host networking (examples/multihost/).
const (
	multihostDir        = "examples/multihost"
	roleControl         = "control"
	roleGateway         = "gateway"
	roleModel           = "model"
	multihostBootstrap  = "examples/multihost/gateway/envoy-bootstrap.yaml"
	svcSwitchyard       = "switchyard"
	svcVLLM             = "vllm"
	multihostXDSPort    = 18000
	multihostVLLMPort   = 8000
	multihostEnvoyNames = "switchyard-1,switchyard-2"
)

var multihostRoles = []string{roleControl, roleGateway, roleModel}

// roleEnvExample reads a role's .env.example: the variables its compose
// file needs, with the example's values.
func roleEnvExample(t *testing.T, role string) map[string]string {
	t.Helper()
	path := filepath.Join(testutil.RepoRoot(t), multihostDir, role, ".env.example")
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: %q is not NAME=value", path, line)
		}
		env[k] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return env
}

// loadRole parses a role's compose file as `docker compose` does, with env
// as the only variables (no .env file).
func loadRole(t *testing.T, role string, env map[string]string) (*types.Project, error) {
	t.Helper()
	dir := filepath.Join(testutil.RepoRoot(t), multihostDir, role)
	var list []string
	for k, v := range env {
		list = append(list, k+"="+v)
	}
	opts, err := cli.NewProjectOptions([]string{filepath.Join(dir, "compose.yaml")},
		cli.WithWorkingDirectory(dir), cli.WithEnv(list), cli.WithDiscardEnvFile, cli.WithResolvedPaths(true))
	if err != nil {
		return nil, err
	}
	return cli.ProjectFromOptions(context.Background(), opts)
}

// exampleRole loads a role with its .env.example (and a gossip key, which
// the example leaves for `consul keygen`).
func exampleRole(t *testing.T, role string) *types.Project {
	t.Helper()
	env := roleEnvExample(t, role)
	if _, ok := env["CONSUL_GOSSIP_KEY"]; ok {
		env["CONSUL_GOSSIP_KEY"] = "pUqJrVyVRj5jsiYEkM/tFQYfWyJIv4s3XkvDwy7Cu5s="
	}
	p, err := loadRole(t, role, env)
	if err != nil {
		t.Fatalf("%s with its .env.example: %v", role, err)
	}
	return p
}

// TestMultihostExample checks the multi-host example's files without an
// engine: each role's compose file loads with its .env.example and refuses
// to load without its variables; every service runs on the host's network;
// the addresses and ports the roles use to reach each other agree; the
// configuration each mounts is accepted by the program that reads it.
// TestMultihost runs them.
func TestMultihostExample(t *testing.T) {
	for _, role := range multihostRoles {
		t.Run("load/"+role, func(t *testing.T) {
			p := exampleRole(t, role)
			for _, name := range serviceNames(p) {
				if nm := p.Services[name].NetworkMode; nm != "host" {
					t.Errorf("%s: service %s has network_mode %q, want host (one VM, one address)", role, name, nm)
				}
			}
			// Without .env, compose names the first missing variable.
			if _, err := loadRole(t, role, nil); err == nil || !strings.Contains(err.Error(), "in .env") {
				t.Errorf("%s loads without its variables (%v); a missing address must be an error", role, err)
			}
		})
	}

	control, gateway, model := exampleRole(t, roleControl), exampleRole(t, roleGateway), exampleRole(t, roleModel)
	cenv, genv, menv := roleEnvExample(t, roleControl), roleEnvExample(t, roleGateway), roleEnvExample(t, roleModel)

	t.Run("control", func(t *testing.T) {
		sy := service(t, control, svcSwitchyard)
		flags := serveFlags(t, sy)
		host := cenv["HOST_IP"]
		for _, f := range []string{"xds-addr", "extproc-addr", "admin-addr"} {
			h, _ := hostPort(t, f, flags[f])
			if h != host {
				t.Errorf("switchyard -%s=%s: want the host's address %s (the other roles reach it there)", f, flags[f], host)
			}
		}
		if _, p := hostPort(t, "xds-addr", flags["xds-addr"]); p != multihostXDSPort {
			t.Errorf("-xds-addr port %d, the gateways' bootstrap says %d", p, multihostXDSPort)
		}
		if flags["replica-id"] != cenv["SWITCHYARD_ID"] {
			t.Errorf("-replica-id=%s, want SWITCHYARD_ID", flags["replica-id"])
		}
		if got := sy.Environment["CONSUL_HTTP_ADDR"]; got == nil || *got != "127.0.0.1:8500" {
			t.Errorf("switchyard reaches Consul at %v, want its host's agent 127.0.0.1:8500", got)
		}
		if flags["envoy-tls-dir"] != envoyTLSTarget {
			t.Errorf("-envoy-tls-dir=%s, the gateways mount their certificates at %s", flags["envoy-tls-dir"], envoyTLSTarget)
		}
		checkDependsHealthy(t, sy, svcConsul)
		cmd := service(t, control, svcConsul).Command
		for _, want := range []string{"-server", "-bootstrap-expect=3", "-bind=" + host, "-advertise=" + host, "-client=127.0.0.1"} {
			if !slices.Contains(cmd, want) {
				t.Errorf("consul command %q lacks %s", cmd, want)
			}
		}
		checkRetryJoin(t, "control consul", cmd, cenv)

		out, err := exec.Command(testutil.Binary(t, "switchyard"), "validate", "-config", bindSourceFor(t, sy, switchyardConfigTarget)).CombinedOutput()
		if err != nil || !strings.HasPrefix(string(out), "ok:") {
			t.Errorf("switchyard validate: %v\n%s", err, out)
		}
	})

	t.Run("model", func(t *testing.T) {
		agent := service(t, model, svcConsul)
		checkRetryJoin(t, "model consul", agent.Command, menv)
		if slices.Contains(agent.Command, "-server") {
			t.Error("the model hosts' agent is a server; it must be a client")
		}
		// Stopped before vLLM: it leaves the cluster first.
		if d, ok := agent.DependsOn[svcVLLM]; !ok || d.Condition != types.ServiceConditionStarted {
			t.Errorf("consul depends_on %v: want vllm (started), so down stops the agent first", agent.DependsOn)
		}
		vllm := service(t, model, svcVLLM)
		if !slices.Contains(vllm.Command, "--port="+strconv.Itoa(multihostVLLMPort)) {
			t.Errorf("vllm command %q does not listen on %d", vllm.Command, multihostVLLMPort)
		}

		dir := bindSourceFor(t, agent, consulServicesTarget)
		b, err := os.ReadFile(filepath.Join(dir, "vllm.json"))
		if err != nil {
			t.Fatal(err)
		}
		var def consulService
		if err := json.Unmarshal(b, &def); err != nil || def.Service == nil {
			t.Fatalf("vllm.json: %v", err)
		}
		s := def.Service
		// No address: the node's (HOST_IP), so one file serves every host.
		if s.Address != "" || s.Port != multihostVLLMPort {
			t.Errorf("vllm.json registers %q:%d, want no address (the node's) and port %d", s.Address, s.Port, multihostVLLMPort)
		}
		if len(s.Checks) != 1 || s.Checks[0].HTTP != "http://127.0.0.1:"+strconv.Itoa(multihostVLLMPort)+"/health" {
			t.Errorf("vllm.json checks %+v: want one HTTP check of vLLM's /health on the host's loopback", s.Checks)
		}
		cfg := readHCLConfig(t, bindSourceFor(t, service(t, control, svcSwitchyard), switchyardConfigTarget))
		matched := false
		for _, q := range cfg.consul {
			if q.service == s.Name && (q.tag == "" || slices.Contains(s.Tags, q.tag)) {
				matched = true
			}
		}
		if !matched {
			t.Errorf("vllm.json (service %q, tags %v) matches no pool's consul block %v", s.Name, s.Tags, cfg.consul)
		}
		if cfg.replicasConsulService != replicaConsulService {
			t.Errorf("replicas { consul_service = %q }, want %q", cfg.replicasConsulService, replicaConsulService)
		}

		bin := testutil.ConsulPath(t)
		confDir := t.TempDir()
		testutil.WriteFile(t, confDir, "base.json", `{"data_dir": "`+t.TempDir()+`", "bind_addr": "127.0.0.1"}`)
		testutil.WriteFile(t, confDir, "local.json", *agent.Environment["CONSUL_LOCAL_CONFIG"])
		if out, err := exec.Command(bin, "validate", confDir, dir).CombinedOutput(); err != nil {
			t.Errorf("consul validate %s: %v\n%s", dir, err, out)
		}
	})

	t.Run("gateway", func(t *testing.T) {
		env := service(t, gateway, svcEnvoy)
		if src := bindSourceFor(t, env, envoyBootstrapTarget); src != filepath.Join(testutil.RepoRoot(t), multihostBootstrap) {
			t.Errorf("envoy mounts %s at %s, want %s", src, envoyBootstrapTarget, multihostBootstrap)
		}
		bindSourceFor(t, env, envoyTLSTarget)
		// The bootstrap's xDS server names resolve to the replicas' hosts.
		hosts := map[string]string{}
		for name, ips := range env.ExtraHosts {
			hosts[name] = strings.Join(ips, ",")
		}
		for i, name := range strings.Split(multihostEnvoyNames, ",") {
			if want := genv["SWITCHYARD_"+strconv.Itoa(i+1)+"_ADDR"]; hosts[name] != want {
				t.Errorf("extra_hosts maps %s to %q, want SWITCHYARD_%d_ADDR (%s)", name, hosts[name], i+1, want)
			}
		}
	})
}

// checkRetryJoin: a Consul agent joins the three servers of its .env.
func checkRetryJoin(t *testing.T, what string, cmd []string, env map[string]string) {
	t.Helper()
	for _, k := range []string{"CONSUL_SERVER_1", "CONSUL_SERVER_2", "CONSUL_SERVER_3"} {
		if !slices.Contains(cmd, "-retry-join="+env[k]) {
			t.Errorf("%s command %q does not join %s (%s)", what, cmd, k, env[k])
		}
	}
	if !slices.Contains(cmd, "-encrypt="+env["CONSUL_GOSSIP_KEY"]) && env["CONSUL_GOSSIP_KEY"] != "" {
		t.Errorf("%s command %q does not encrypt gossip with CONSUL_GOSSIP_KEY", what, cmd)
	}
}

// TestMultihostEnvoyBootstrap keeps the gateways' bootstrap generated from
// envoy/bootstrap.yaml (with mutual TLS), listing both replicas by the
// names the gateway compose file maps to their hosts:
//
//	go -C deploy test -run TestMultihostEnvoyBootstrap -update .
func TestMultihostEnvoyBootstrap(t *testing.T) {
	var servers []string
	for _, name := range strings.Split(multihostEnvoyNames, ",") {
		servers = append(servers, net.JoinHostPort(name, strconv.Itoa(multihostXDSPort)))
	}
	want, err := envoy.Bootstrap(envoy.Params{NodeID: envoyNodeID, XDSServers: servers, AdminHost: "127.0.0.1", AdminPort: envoyAdminPort, TLSDir: envoyTLSTarget})
	if err != nil {
		t.Fatal(err)
	}
	want = "# Generated from envoy/bootstrap.yaml for examples/multihost/gateway by\n" +
		"#   go -C deploy test -run TestMultihostEnvoyBootstrap -update .\n" +
		"# ADS: the switchyard replicas (" + strings.Join(servers, ", ") + "); node.id is\n" +
		"# set per gateway with --service-node. Do not edit by hand.\n\n" + want
	path := filepath.Join(testutil.RepoRoot(t), multihostBootstrap)
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
		t.Errorf("%s is out of date; regenerate with go -C deploy test -run TestMultihostEnvoyBootstrap -update .", multihostBootstrap)
	}
	if listed := xdsEndpoints(string(got)); !slices.Equal(listed, servers) {
		t.Errorf("%s lists xDS servers %v, want %v", multihostBootstrap, listed, servers)
	}
}

// TestMultihostDocs: docs/deployment.md lists every port the roles use
// to reach each other (from the example's files), and the command of its
// fault table.
func TestMultihostDocs(t *testing.T) {
	root := testutil.RepoRoot(t)
	b, err := os.ReadFile(filepath.Join(root, "docs", "deployment.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "## Several hosts")
	if start < 0 {
		t.Fatal(`docs/deployment.md has no "## Several hosts" section`)
	}
	section := doc[start:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	control := exampleRole(t, roleControl)
	flags := serveFlags(t, service(t, control, svcSwitchyard))
	ports := map[string]string{"Consul RPC": "8300/tcp", "Consul gossip": "8301/tcp and udp"}
	for _, f := range []string{"xds-addr", "extproc-addr", "admin-addr"} {
		_, p := hostPort(t, f, flags[f])
		ports["switchyard -"+f] = strconv.Itoa(p) + "/tcp"
	}
	cfg := readHCLConfig(t, bindSourceFor(t, service(t, control, svcSwitchyard), switchyardConfigTarget))
	_, lp := hostPort(t, "listener", cfg.listeners["public"])
	ports["Envoy's listener"] = strconv.Itoa(lp) + "/tcp"
	ports["vLLM"] = strconv.Itoa(multihostVLLMPort) + "/tcp"
	for what, port := range ports {
		if !strings.Contains(section, "| "+port+" |") {
			t.Errorf("the ports table of docs/deployment.md (Several hosts) has no row for %s (%s)", what, port)
		}
	}
	for _, want := range []string{"make test-multihost", "| fault | requests | failed |", "node_unreachable"} {
		if !strings.Contains(section, want) {
			t.Errorf("docs/deployment.md (Several hosts) does not mention %q", want)
		}
	}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil || !strings.Contains(string(mk), "\ntest-multihost:") {
		t.Errorf("the Makefile has no test-multihost target, which the fault table names: %v", err)
	}
}
