package deploy

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/testutil"
)

var update = flag.Bool("update", false, "rewrite examples/compose/envoy-bootstrap.yaml from envoy/bootstrap.yaml")

// Where the stack mounts its configuration inside the containers.
const (
	switchyardConfigTarget = "/etc/switchyard"
	consulServicesTarget   = "/consul/services"
	envoyBootstrapTarget   = "/etc/envoy/envoy.yaml"
	envoyBootstrapFile     = "examples/compose/envoy-bootstrap.yaml"
	envoyNodeID            = "envoy-1"
	envoyAdminPort         = 9901
	envoyTLSTarget         = envoy.DefaultTLSDir
	switchyardTLSTarget    = "/etc/switchyard-tls"
	composeTLSDir          = "examples/compose/tls"
)

// serveFlags returns the flags of the switchyard service's "serve" command.
func serveFlags(t *testing.T, sy types.ServiceConfig) map[string]string {
	t.Helper()
	flags, rest := flagValues(sy.Command)
	if len(rest) != 1 || rest[0] != "serve" {
		t.Fatalf("switchyard command %q: want the serve subcommand followed by -name=value flags only", sy.Command)
	}
	for _, a := range sy.Command[1:] {
		if !strings.HasPrefix(a, "-") || !strings.Contains(a, "=") {
			t.Fatalf("switchyard command: write %q as -name=value, so that no value can be mistaken for a flag", a)
		}
	}
	return flags
}

func TestComposeSwitchyardCommand(t *testing.T) {
	p := loadProject(t)
	replicas := replicaServices(t, p)
	cfg := readHCLConfig(t, bindSourceFor(t, replicas[0], switchyardConfigTarget))
	if cfg.replicasConsulService != replicaConsulService {
		t.Errorf("replicas { consul_service = %q }, want %q: the replicas find each other through Consul", cfg.replicasConsulService, replicaConsulService)
	}
	ids := map[string]string{}
	used := map[string]bool{}
	for _, sy := range replicas {
		t.Run(sy.Name, func(t *testing.T) {
			flags := serveFlags(t, sy)
			for f := range flags {
				used[f] = true
			}
			checkReplicaCommand(t, p, sy, flags)
			if id := flags["replica-id"]; id != sy.Name {
				t.Errorf("-replica-id = %q, want the service name %q (its Consul service ID)", id, sy.Name)
			}
			if other, dup := ids[flags["replica-id"]]; dup {
				t.Errorf("-replica-id %q also used by %s", flags["replica-id"], other)
			}
			ids[flags["replica-id"]] = sy.Name
		})
	}

	// Every flag the stack passes exists in the binary it builds.
	t.Run("flags-known", func(t *testing.T) {
		bin := testutil.Binary(t, "switchyard")
		out, _ := exec.Command(bin, "serve", "-h").CombinedOutput()
		known := map[string]bool{}
		for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z][a-z0-9-]*)`).FindAllStringSubmatch(string(out), -1) {
			known[m[1]] = true
		}
		if len(known) == 0 {
			t.Fatalf("switchyard serve -h lists no flags:\n%s", out)
		}
		var missing []string
		for f := range used {
			if !known[f] {
				missing = append(missing, f)
			}
		}
		sort.Strings(missing)
		if len(missing) > 0 {
			t.Errorf("switchyard serve does not know flags %v used in %s", missing, composeFile)
		}
	})
}

// checkReplicaCommand checks one replica's serve flags: it listens on
// every interface and advertises its own static IP for the picker, xDS
// and admin (Envoy and Consul run in other containers), reads the shared
// configuration and reaches Consul.
func checkReplicaCommand(t *testing.T, p *types.Project, sy types.ServiceConfig, flags map[string]string) {
	t.Helper()
	if flags["config"] != switchyardConfigTarget {
		t.Errorf("-config = %q, want the mounted directory %s", flags["config"], switchyardConfigTarget)
	}
	if src, first := bindSourceFor(t, sy, switchyardConfigTarget), bindSourceFor(t, replicaServices(t, p)[0], switchyardConfigTarget); src != first {
		t.Errorf("mounts %s as its configuration, another replica %s: replicas serve one configuration", src, first)
	}
	ip := staticIP(t, sy, stackNetwork)
	for _, f := range []string{"extproc", "xds", "admin"} {
		addr := flags[f+"-addr"]
		host, port := hostPort(t, "-"+f+"-addr", addr)
		if host != "0.0.0.0" {
			t.Errorf("-%s-addr = %q: inside a container it must listen on 0.0.0.0 to be reachable from Envoy and Consul", f, addr)
		}
		want := net.JoinHostPort(ip.String(), strconv.Itoa(port))
		if got := flags[f+"-advertise"]; got != want {
			t.Errorf("-%s-advertise = %q, want %q (the replica's ipv4_address and -%s-addr port)", f, got, want, f)
		}
	}
	if f := flags["log-format"]; f != "json" {
		t.Errorf("-log-format = %q, want json for log collectors", f)
	}

	// The health check probes readiness on the admin port.
	_, adminPort := hostPort(t, "-admin-addr", flags["admin-addr"])
	probe := fmt.Sprintf("http://127.0.0.1:%d/readyz", adminPort)
	if !slices.Contains(sy.HealthCheck.Test, probe) && !strings.Contains(strings.Join(sy.HealthCheck.Test, " "), probe) {
		t.Errorf("healthcheck %q does not probe %s", sy.HealthCheck.Test, probe)
	}

	// Consul is reached by its service name on the stack network.
	addr := sy.Environment["CONSUL_HTTP_ADDR"]
	if addr == nil {
		t.Fatalf("CONSUL_HTTP_ADDR is not set")
	}
	host, _ := hostPort(t, "CONSUL_HTTP_ADDR", strings.TrimPrefix(*addr, "http://"))
	if host != svcConsul {
		t.Errorf("CONSUL_HTTP_ADDR = %q, want the %q service", *addr, svcConsul)
	}
}

// TestComposeSwitchyardConfigValidates runs switchyard's own validator on
// the configuration the stack mounts.
func TestComposeSwitchyardConfigValidates(t *testing.T) {
	p := loadProject(t)
	dir := bindSourceFor(t, replicaServices(t, p)[0], switchyardConfigTarget)
	bin := testutil.Binary(t, "switchyard")
	out, err := exec.Command(bin, "validate", "-config", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("switchyard validate -config %s: %v\n%s", dir, err, out)
	}
	if !bytes.HasPrefix(out, []byte("ok:")) {
		t.Errorf("validate output %q, want an ok: summary", out)
	}
}

// consulService is the part of a Consul service definition file the
// deployment relies on.
type consulService struct {
	Service *struct {
		ID      string            `json:"id"`
		Name    string            `json:"name"`
		Tags    []string          `json:"tags"`
		Address string            `json:"address"`
		Port    int               `json:"port"`
		Meta    map[string]string `json:"meta"`
		Checks  []struct {
			HTTP     string `json:"http"`
			Interval string `json:"interval"`
			Timeout  string `json:"timeout"`
		} `json:"checks"`
	} `json:"service"`
}

func TestComposeConsulRegistrations(t *testing.T) {
	p := loadProject(t)
	consul := service(t, p, svcConsul)
	dir := bindSourceFor(t, consul, consulServicesTarget)
	if !slices.Contains(consul.Command, "-config-dir="+consulServicesTarget) {
		t.Errorf("consul command %q does not load %s (-config-dir=%s)", consul.Command, consulServicesTarget, consulServicesTarget)
	}
	cfg := readHCLConfig(t, bindSourceFor(t, replicaServices(t, p)[0], switchyardConfigTarget))
	if len(cfg.consul) == 0 {
		t.Fatalf("no pool in the switchyard configuration discovers endpoints from Consul")
	}

	served := map[string]bool{}
	sims := simServices(p)
	for _, sim := range sims {
		file := filepath.Join(dir, sim.Name+".json")
		t.Run(sim.Name, func(t *testing.T) {
			models := checkRegistration(t, sim, file, cfg)
			for _, m := range models {
				served[m] = true
			}
		})
	}
	checkOnlyDefinitionsOf(t, dir, sims)
	for _, m := range cfg.models {
		if !served[m] {
			t.Errorf("model %q is configured but no registered host lists it in meta.models", m)
		}
	}

	// GPU hosts (profile "gpu") are registered by their own Consul client
	// agent, which runs only with the profile: without it nothing is
	// registered for them (issue 26: their critical checks were most of
	// Consul's log).
	gp := loadProject(t, "gpu")
	agent := service(t, gp, svcConsulGPU)
	gpuDir := bindSourceFor(t, agent, consulServicesTarget)
	if gpuDir == dir {
		t.Errorf("%s loads the simulators' definitions too", svcConsulGPU)
	}
	gpus := gpuServices(gp)
	for _, gpu := range gpus {
		t.Run(gpu.Name, func(t *testing.T) { checkRegistration(t, gpu, filepath.Join(gpuDir, gpu.Name+".json"), cfg) })
	}
	checkOnlyDefinitionsOf(t, gpuDir, gpus)

	// Consul itself accepts the files (unknown keys, bad durations, ...)
	// with the agent configuration of each container: the image's
	// CONSUL_LOCAL_CONFIG and the flags the command line sets. Inside its
	// container an agent has one interface and binds to it by itself; on
	// the host `consul validate` would have to choose among the host's
	// (a docker0 bridge makes two private addresses: issue 23, item 7), so
	// the test gives it loopback.
	for _, c := range []struct {
		svc types.ServiceConfig
		dir string
	}{{consul, dir}, {agent, gpuDir}} {
		t.Run("consul-validate/"+c.svc.Name, func(t *testing.T) {
			bin := testutil.ConsulPath(t)
			confDir := t.TempDir()
			base := map[string]any{"data_dir": t.TempDir(), "bind_addr": "127.0.0.1"}
			if b, err := json.Marshal(base); err != nil {
				t.Fatal(err)
			} else {
				testutil.WriteFile(t, confDir, "base.json", string(b))
			}
			local := c.svc.Environment["CONSUL_LOCAL_CONFIG"]
			if local == nil {
				t.Fatalf("%s sets no CONSUL_LOCAL_CONFIG", c.svc.Name)
			}
			testutil.WriteFile(t, confDir, "local.json", *local)
			out, err := exec.Command(bin, "validate", confDir, c.dir).CombinedOutput()
			if err != nil {
				t.Fatalf("consul validate %s: %v\n%s", c.dir, err, out)
			}
		})
	}
}

// checkOnlyDefinitionsOf fails for a definition in dir that registers no
// service of hosts: it would be a dead endpoint.
func checkOnlyDefinitionsOf(t *testing.T, dir string, hosts []types.ServiceConfig) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		id := strings.TrimSuffix(filepath.Base(f), ".json")
		if !slices.ContainsFunc(hosts, func(s types.ServiceConfig) bool { return s.Name == id }) {
			t.Errorf("%s registers a host that is not one of the services it should (%d of them); it would be a dead endpoint", f, len(hosts))
		}
	}
}

// checkRegistration checks one simulator's service definition against its
// compose service and the switchyard configuration, and returns the models
// it advertises.
func checkRegistration(t *testing.T, sim types.ServiceConfig, file string, cfg hclConfig) []string {
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatalf("every simulator needs a service definition: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	var def consulService
	if err := dec.Decode(&def); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	s := def.Service
	if s == nil {
		t.Fatalf(`%s: no top-level "service" object`, file)
	}
	if s.ID != sim.Name {
		t.Errorf("%s: id %q, want the compose service name %q", file, s.ID, sim.Name)
	}

	// The registration is one a switchyard pool discovers.
	matched := false
	for _, q := range cfg.consul {
		matched = matched || s.Name == q.service && (q.tag == "" || slices.Contains(s.Tags, q.tag))
	}
	if !matched {
		t.Errorf("%s: service %q tags %v match no pool's consul block %v", file, s.Name, s.Tags, cfg.consul)
	}

	// Address: the simulator's static IP and listen port, exactly (Envoy's
	// override_host compares ip:port strings).
	flags, _ := flagValues(sim.Command)
	if flags["host"] != "0.0.0.0" {
		t.Errorf("%s: -host = %q, want 0.0.0.0", sim.Name, flags["host"])
	}
	port, err := strconv.Atoi(flags["port"])
	if err != nil {
		t.Fatalf("%s: -port %q: %v", sim.Name, flags["port"], err)
	}
	ip := staticIP(t, sim, stackNetwork).String()
	if s.Address != ip || s.Port != port {
		t.Errorf("%s: registers %s:%d, want %s:%d (the service's ipv4_address and -port)", file, s.Address, s.Port, ip, port)
	}
	probe := fmt.Sprintf("http://%s:%d/health", ip, port)
	if len(s.Checks) != 1 || s.Checks[0].HTTP != probe || s.Checks[0].Interval == "" || s.Checks[0].Timeout == "" {
		t.Errorf("%s: want one HTTP check on %s with interval and timeout, got %+v", file, probe, s.Checks)
	}
	if hc := strings.Join(sim.HealthCheck.Test, " "); !strings.Contains(hc, fmt.Sprintf("http://127.0.0.1:%d/health", port)) {
		t.Errorf("%s: compose healthcheck %q does not probe /health on port %d", sim.Name, hc, port)
	}

	// Meta convention: models (comma list incl. LoRA adapters), engine,
	// metrics_path.
	if e := s.Meta["engine"]; e != "vllm" {
		t.Errorf("%s: meta.engine = %q, want vllm", file, e)
	}
	if mp := s.Meta["metrics_path"]; !strings.HasPrefix(mp, "/") {
		t.Errorf("%s: meta.metrics_path = %q, want an absolute path", file, mp)
	}
	var models []string
	for _, m := range strings.Split(s.Meta["models"], ",") {
		if m = strings.TrimSpace(m); m != "" {
			models = append(models, m)
		}
	}
	model := flags["model"]
	if _, rest := flagValues(sim.Command); model == "" && len(rest) > 0 {
		model = rest[0] // vLLM's `vllm serve MODEL`
	}
	want := []string{model}
	if names := flags["served-model-name"]; names != "" {
		want = strings.Split(names, ",")
	}
	for _, lora := range strings.Split(flags["lora-modules"], ",") {
		if name, _, _ := strings.Cut(lora, "="); name != "" {
			want = append(want, name)
		}
	}
	if !slices.Equal(sorted(models), sorted(want)) {
		t.Errorf("%s: meta.models = %q, want what %s serves: %q", file, models, sim.Name, want)
	}
	return models
}

func sorted(s []string) []string {
	c := slices.Clone(s)
	sort.Strings(c)
	return c
}

// TestEnvoyBootstrap checks the bootstrap the envoy service mounts: it must
// be envoy/bootstrap.yaml (the shipped, tested one) with ADS pointed at
// every switchyard replica, so a change to the shipped bootstrap reaches
// the compose stack (run with -update to regenerate).
func TestEnvoyBootstrap(t *testing.T) {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	env := service(t, p, svcEnvoy)
	src := bindSourceFor(t, env, envoyBootstrapTarget)
	if rel, _ := filepath.Rel(root, src); filepath.ToSlash(rel) != envoyBootstrapFile {
		t.Errorf("envoy mounts %s at %s, want %s", rel, envoyBootstrapTarget, envoyBootstrapFile)
	}
	if !slices.Equal(env.Command[:3], []string{"envoy", "-c", envoyBootstrapTarget}) {
		t.Errorf("envoy command %q does not start with envoy -c %s", env.Command, envoyBootstrapTarget)
	}

	// One xDS server per replica: its service name (Docker's DNS) and
	// -xds-addr port.
	var servers []string
	for _, sy := range replicaServices(t, p) {
		_, xdsPort := hostPort(t, sy.Name+" -xds-addr", serveFlags(t, sy)["xds-addr"])
		servers = append(servers, net.JoinHostPort(sy.Name, strconv.Itoa(xdsPort)))
	}
	params := envoy.Params{
		NodeID:     envoyNodeID,
		XDSServers: servers,
		AdminHost:  "127.0.0.1",
		AdminPort:  envoyAdminPort,
		TLSDir:     envoyTLSTarget,
	}
	want, err := envoy.Bootstrap(params)
	if err != nil {
		t.Fatalf("render bootstrap: %v", err)
	}
	want = "# Generated from envoy/bootstrap.yaml for docker-compose.yaml by\n" +
		"#   go -C deploy test -run TestEnvoyBootstrap -update .\n" +
		"# ADS: the switchyard replicas (" + strings.Join(servers, ", ") + "). Do not edit by hand.\n\n" + want
	path := filepath.Join(root, envoyBootstrapFile)
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
		t.Errorf("%s is out of date with envoy/bootstrap.yaml or the replicas' -xds-addr; regenerate with\n  go -C deploy test -run TestEnvoyBootstrap -update .", envoyBootstrapFile)
	}
	// Read back from the file: the ADS cluster lists every replica.
	if listed := xdsEndpoints(string(got)); !slices.Equal(listed, servers) {
		t.Errorf("%s lists xDS servers %v, want every replica %v", envoyBootstrapFile, listed, servers)
	}

	// The health check asks Envoy's admin /ready on the bootstrap's port
	// (TestEnvoyHealthcheckProbe runs it against a real Envoy).
	hc := strings.Join(env.HealthCheck.Test, " ")
	if !strings.Contains(hc, fmt.Sprintf("/dev/tcp/127.0.0.1/%d", envoyAdminPort)) || !strings.Contains(hc, "GET /ready ") {
		t.Errorf("envoy healthcheck %q does not query admin /ready on 127.0.0.1:%d", hc, envoyAdminPort)
	}

	t.Run("envoy-validate", func(t *testing.T) {
		bin := testutil.EnvoyPath(t)
		// The certificate directory as the container would see it, made
		// by devcerts in a temporary directory.
		certs := t.TempDir()
		dir := filepath.Join(certs, "envoy")
		devcerts(t, certs, "-envoy-dir", dir)
		p := params
		p.TLSDir = dir
		cfg, err := envoy.Bootstrap(p)
		if err != nil {
			t.Fatal(err)
		}
		path := testutil.WriteFile(t, t.TempDir(), "envoy.yaml", cfg)
		out, err := exec.Command(bin, "--mode", "validate", "-c", path, "--log-level", "warn").CombinedOutput()
		if err != nil {
			t.Fatalf("envoy --mode validate -c %s: %v\n%s", path, err, out)
		}
	})
}

// xdsEndpoints returns the host:port of every endpoint of the bootstrap's
// ADS cluster, in order (the @xds_host and @xds_port lines).
func xdsEndpoints(bootstrap string) []string {
	var out []string
	host := ""
	re := regexp.MustCompile(`^\s*[a-z_]+:\s*"?([^"\s]+)"?\s*# @(xds_host|xds_port)\s*$`)
	for _, l := range strings.Split(bootstrap, "\n") {
		m := re.FindStringSubmatch(l)
		switch {
		case m == nil:
		case m[2] == "xds_host":
			host = m[1]
		case host != "":
			out = append(out, net.JoinHostPort(host, m[1]))
			host = ""
		}
	}
	return out
}

// TestEnvoyHealthcheckProbe runs the envoy service's health check command
// (the official image has bash but no HTTP client) against a real Envoy
// whose admin interface listens on a free port: it must fail while Envoy
// waits for its first configuration and pass once Envoy is ready.
func TestEnvoyHealthcheckProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy")
	}
	bin := testutil.EnvoyPath(t)
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("bash not installed")
	}
	test := service(t, loadProject(t), svcEnvoy).HealthCheck.Test
	if len(test) != 4 || test[0] != "CMD" || test[1] != "bash" || test[2] != "-c" {
		t.Fatalf("envoy healthcheck %q: want [CMD bash -c SCRIPT]", test)
	}
	probe := func(adminPort int) error {
		script := strings.ReplaceAll(test[3], fmt.Sprintf("/dev/tcp/127.0.0.1/%d", envoyAdminPort), fmt.Sprintf("/dev/tcp/127.0.0.1/%d", adminPort))
		if script == test[3] {
			t.Fatalf("healthcheck script %q does not name the admin port %d", test[3], envoyAdminPort)
		}
		out, err := exec.Command(bash, "-c", script).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	ready := func(adminPort int) (int, error) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/ready", adminPort))
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	start := func(name string, p envoy.Params) int {
		cfg, err := envoy.Bootstrap(p)
		if err != nil {
			t.Fatal(err)
		}
		file := filepath.Join(t.TempDir(), "envoy.yaml")
		if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		testutil.Start(t, name, bin, "-c", file, "--use-dynamic-base-id", "--log-level", "warn")
		testutil.Eventually(t, 20*time.Second, name+" admin answering", func() error {
			_, err := ready(p.AdminPort)
			return err
		})
		return p.AdminPort
	}

	// ADS points at a port nobody listens on: Envoy stays initializing
	// until its initial fetch timeout (15 s).
	waiting := start("envoy-waiting", envoy.Params{XDSPort: testutil.FreePort(t), AdminPort: testutil.FreePort(t)})
	before, _ := ready(waiting)
	err = probe(waiting)
	after, _ := ready(waiting)
	if before == http.StatusOK {
		t.Fatalf("Envoy without a control plane reports ready")
	}
	if err == nil && after != http.StatusOK {
		t.Errorf("probe passed while Envoy's /ready answered %d", after)
	}

	// Without dynamic resources Envoy is ready as soon as it starts.
	static := filepath.Join(t.TempDir(), "static.yaml")
	adminPort := testutil.FreePort(t)
	if err := os.WriteFile(static, []byte(fmt.Sprintf("admin:\n  address:\n    socket_address: {address: 127.0.0.1, port_value: %d}\n", adminPort)), 0o600); err != nil {
		t.Fatal(err)
	}
	testutil.Start(t, "envoy-static", bin, "-c", static, "--use-dynamic-base-id", "--log-level", "warn")
	testutil.Eventually(t, 20*time.Second, "probe passes on a ready Envoy", func() error {
		return probe(adminPort)
	})
}
