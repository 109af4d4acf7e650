package deploy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/deploy/composetest"
	"github.com/switchyard/switchyard/internal/testutil"
)

// The multi-host test's network: every host has a /24 of its own inside
// mhWAN, and a router container on all of them forwards between them.
var mhWAN = netip.MustParsePrefix("10.231.0.0/16")

const (
	// mhHostOctet and mhRouterOctet are the last octet of a host's
	// address and of the router's on that host's network.
	mhHostOctet   = 10
	mhRouterOctet = 254
	// mhWorkers requests are in flight at any time during a fault.
	mhWorkers = 4
	// mhRequestTimeout bounds one request: a request on a host that
	// vanished hangs until then, and is counted as failed (the picker's
	// ext_proc message timeout, 10 s, must fit in it).
	mhRequestTimeout = 20 * time.Second
	// mhStaleMargin is added to the picker's own bound on how long after
	// a host went silent it may still send it requests (the max_age_ms of
	// its scrapes, read before the fault): margin for this loaded machine.
	mhStaleMargin = 250 * time.Millisecond
	// mhConverge is the target for convergence after a heal.
	mhConverge = 5 * time.Second
	// The models of the test's two pools: the example's fail_closed
	// pool "llama", and a fail_open pool the test adds over the same
	// servers (vllm-sim serves the LoRA adapter on every model host).
	mhModelClosed = "meta-llama/Llama-3.1-8B-Instruct"
	mhModelOpen   = "sql-lora"
	mhPoolClosed  = "llama"
	mhPoolOpen    = "llama-open"
	// mhNetImage runs the router and each host's network namespace: it
	// needs a shell and iproute2's ip (routes; policy rules with ipproto
	// and dport for the partitions). The Consul image the stack runs
	// anyway has them as make test installs it (the stand-in is Debian);
	// the official image's busybox ip has no ipproto/dport rules.
	mhNetImage = "hashicorp/consul:1.22"
)

// mhFailOpenPool is the fail_open pool the test adds to the example's
// configuration.
const mhFailOpenPool = `# Added by TestMultihost: a fail_open pool over the same servers.
pool "llama-open" {
  engine       = "vllm"
  failure_mode = "fail_open"
  consul {
    service      = "vllm"
    tag          = "llama-8b"
    passing_only = true
  }
}

model "sql-lora" {
  pool = "llama-open"
}
`

// mhHost is one VM: a compose project of its role's file whose services
// share the network namespace of a "vm" container that holds the host's
// address on a network of its own.
type mhHost struct {
	name, role string
	subnet     netip.Prefix
	ip, router netip.Addr
	// services are the services it runs (all when empty).
	services []string
	env      map[string]string
	p        *composetest.Project
}

// multihost is the running deployment.
type multihost struct {
	e        *composetest.Engine
	router   *composetest.Project
	hosts    map[string]*mhHost
	order    []string
	controls []string // control hosts
	replicas []string // control hosts that run switchyard
	gateways []string
	models   []string
	// replicaID maps a control host to its switchyard replica ID.
	replicaID map[string]string
	client    *http.Client
	table     []faultRow
	base      mhView
}

// TestMultihost runs the multi-host example (examples/multihost) as the
// user's VMs would: eight hosts, each a compose project of its role's
// file on a Docker network of its own, joined by a router container
// (routed, no shared bridge): three control hosts (Consul servers; two run
// a switchyard replica), two gateways (Envoy) and three model hosts
// (vllm-sim and a Consul client agent that registers it). Under a steady
// load through both gateways it loses a model host and a switchyard host,
// partitions a gateway from the control hosts and a model host from
// Consul only, and loses the Consul leader; it counts the failed requests,
// heals each fault and measures convergence. It prints the fault table of
// docs/deployment.md:
//
//	make test-multihost
func TestMultihost(t *testing.T) {
	e := composetest.Require(t)
	start := time.Now()
	m := startMultihost(t, e)
	t.Logf("eight hosts up and converged in %v", time.Since(start).Round(time.Second))

	t.Run("requests", m.checkRequests)
	t.Run("lose-model-host", m.faultLoseModelHost)
	t.Run("partition-model-from-consul", m.faultPartitionModelFromConsul)
	t.Run("partition-gateway-from-control", m.faultPartitionGateway)
	t.Run("consul-leader-loss", m.faultLeaderLoss)
	t.Run("lose-switchyard-host", m.faultLoseSwitchyardHost)

	var b strings.Builder
	b.WriteString("| fault | requests | failed | notes |\n|---|---|---|---|\n")
	for _, r := range m.table {
		fmt.Fprintf(&b, "| %s | %d | %d | %s |\n", r.fault, r.requests, r.failed, r.notes)
	}
	t.Logf("fault table (%d workers, chat completions through both gateways, both pools; load %s; %v in all):\n%s",
		mhWorkers, loadavg(), time.Since(start).Round(time.Second), b.String())
}

// startMultihost builds the images, starts the router and the eight hosts
// and waits until the deployment has converged.
func startMultihost(t *testing.T, e *composetest.Engine) *multihost {
	root := testutil.RepoRoot(t)
	m := &multihost{e: e, hosts: map[string]*mhHost{}, replicaID: map[string]string{},
		client: &http.Client{Timeout: mhRequestTimeout, Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: mhWorkers}}}
	add := func(name, role string, services ...string) {
		m.hosts[name] = &mhHost{name: name, role: role, services: services}
		m.order = append(m.order, name)
		switch role {
		case roleControl:
			m.controls = append(m.controls, name)
		case roleGateway:
			m.gateways = append(m.gateways, name)
		case roleModel:
			m.models = append(m.models, name)
		}
	}
	add("control-1", roleControl)
	add("control-2", roleControl)
	add("control-3", roleControl, svcConsul) // a Consul server only
	add("gateway-1", roleGateway)
	add("gateway-2", roleGateway)
	add("model-1", roleModel)
	add("model-2", roleModel)
	add("model-3", roleModel)
	m.replicas = []string{"control-1", "control-2"}
	for i, h := range m.replicas {
		m.replicaID[h] = fmt.Sprintf("switchyard-%d", i+1)
	}

	var used []netip.Prefix
	for _, name := range m.order {
		h := m.hosts[name]
		h.subnet = e.FreeSubnet(t, mhWAN, used...)
		used = append(used, h.subnet)
		base := h.subnet.Addr().As4()
		base[3] = mhHostOctet
		h.ip = netip.AddrFrom4(base)
		base[3] = mhRouterOctet
		h.router = netip.AddrFrom4(base)
		t.Logf("%s: %s on %s", name, h.ip, h.subnet)
	}

	// The images, built once and run by every host (the build cache is
	// the single-host stack's: same Dockerfiles, context and arguments);
	// removed after every project is down.
	var tag [4]byte
	if _, err := rand.Read(tag[:]); err != nil {
		t.Fatal(err)
	}
	images := map[string]string{
		switchyardDockerfile: "sytmh-" + hex.EncodeToString(tag[:]) + "/switchyard:test",
		simDockerfile:        "sytmh-" + hex.EncodeToString(tag[:]) + "/vllm-sim:test",
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, img := range images {
			if out, err := e.Docker(ctx, "image", "rm", "--force", img); err != nil && !strings.Contains(out, "No such image") {
				t.Errorf("removing %s: %v: %s", img, err, out)
			}
		}
	})
	built := time.Now()
	if err := buildImages(e, root, t.TempDir(), images); err != nil {
		t.Fatal(err)
	}
	t.Logf("images built in %v", time.Since(built).Round(time.Second))

	// The router: on every host's network, forwarding between them.
	rdir := t.TempDir()
	rfile := filepath.Join(rdir, "compose.yaml")
	m.router = e.NewProject(t, composetest.Options{Files: []string{rfile}, NamePrefix: "sytmhr"})
	if err := os.WriteFile(rfile, []byte(m.routerCompose()), 0o644); err != nil {
		t.Fatal(err)
	}
	m.router.Up(t, 2*time.Minute)

	// Certificates for the replicas' addresses, and the configuration
	// with the fail_open pool added.
	tls := filepath.Join(t.TempDir(), "tls")
	var reps []string
	for _, h := range m.replicas {
		reps = append(reps, m.replicaID[h]+"="+m.hosts[h].ip.String())
	}
	cmd := exec.Command("sh", "-c", `umask 077; exec "$@"`, "sh", testutil.Binary(t, "devcerts"), "-out", tls, "-replicas", strings.Join(reps, ","))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("devcerts: %v\n%s", err, out)
	}
	config := filepath.Join(t.TempDir(), "switchyard")
	if err := composetest.CopyTree(filepath.Join(root, multihostDir, roleControl, "switchyard"), config, nil); err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, config, "failopen.hcl", mhFailOpenPool)

	var key [32]byte
	if _, err := rand.Read(key[:]); err != nil {
		t.Fatal(err)
	}
	gossip := base64.StdEncoding.EncodeToString(key[:])
	buildCA := "/dev/null"
	if ca := hostCABundle(); ca != "" {
		buildCA = ca
	}
	for _, name := range m.order {
		h := m.hosts[name]
		servers := map[string]string{}
		for i, c := range m.controls {
			servers[fmt.Sprintf("CONSUL_SERVER_%d", i+1)] = m.hosts[c].ip.String()
		}
		switch h.role {
		case roleControl:
			id := m.replicaID[name]
			tlsDir := filepath.Join(tls, id)
			if id == "" { // runs no replica; the file still names one
				id, tlsDir = "unused", filepath.Join(tls, m.replicaID[m.replicas[0]])
			}
			h.env = map[string]string{"HOST_IP": h.ip.String(), "CONSUL_GOSSIP_KEY": gossip, "SWITCHYARD_ID": id,
				"TLS_DIR": tlsDir, "SWITCHYARD_IMAGE": images[switchyardDockerfile], "SWITCHYARD_BUILD_CA": buildCA}
			maps.Copy(h.env, servers)
		case roleModel:
			h.env = map[string]string{"HOST_IP": h.ip.String(), "CONSUL_GOSSIP_KEY": gossip, "HF_TOKEN": ""}
			maps.Copy(h.env, servers)
		case roleGateway:
			h.env = map[string]string{"ENVOY_NODE_ID": name, "TLS_DIR": filepath.Join(tls, "envoy")}
			for i, r := range m.replicas {
				h.env[fmt.Sprintf("SWITCHYARD_%d_ADDR", i+1)] = m.hosts[r].ip.String()
			}
		}
		// Every variable the example's .env sets is the test's own: no
		// example address may leak into the run.
		for k := range roleEnvExample(t, h.role) {
			if _, ok := h.env[k]; !ok {
				t.Fatalf("%s: the test does not set %s, which %s/.env.example sets", name, k, h.role)
			}
		}
		h.p = e.NewProject(t, composetest.Options{
			Files:      []string{filepath.Join(root, multihostDir, h.role, "compose.yaml")},
			Override:   m.hostOverride(h, images[simDockerfile], config),
			Env:        h.env,
			NamePrefix: "sytmh" + strings.ReplaceAll(name, "-", ""),
		})
	}

	// All hosts at once: the Consul servers elect a leader only when two
	// of them run, and every other host waits on them.
	up := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(m.order))
	for _, name := range m.order {
		h := m.hosts[name]
		wg.Add(1)
		go func() {
			defer wg.Done()
			args := append([]string{"up", "-d", "--wait", "--wait-timeout", "360"}, h.services...)
			if out, err := h.p.Compose(ctx, args...); err != nil {
				errs <- fmt.Errorf("%s: %v\n%s", h.name, err, out)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("hosts healthy %v after up", time.Since(up).Round(time.Second))

	// Converged: both replicas list each other and every model host in
	// both pools, and each Envoy holds their configuration.
	testutil.Eventually(t, 3*time.Minute, "the deployment converged", func() error {
		v, err := m.view()
		if err != nil {
			return err
		}
		return v.complete(m)
	})
	v, err := m.view()
	if err != nil {
		t.Fatal(err)
	}
	m.base = v
	return m
}

// buildImages builds the repository's Dockerfiles (Dockerfile -> tag) as
// the stack's compose file does, with the same arguments so that the
// build cache serves them: through Compose (its built-in BuildKit client;
// the docker CLI's own BuildKit needs the buildx plugin), in a build-only
// project of its own.
func buildImages(e *composetest.Engine, root, dir string, images map[string]string) error {
	var b strings.Builder
	b.WriteString("services:\n")
	for _, dockerfile := range slices.Sorted(maps.Keys(images)) {
		fmt.Fprintf(&b, "  %s:\n    image: %q\n    build:\n      context: %q\n      dockerfile: %q\n      secrets: [build-ca]\n",
			strings.TrimSuffix(filepath.Base(filepath.Dir(dockerfile)), "/"), images[dockerfile], root, dockerfile)
		if dockerfile == switchyardDockerfile {
			b.WriteString("      args:\n        VERSION: compose\n")
		}
	}
	ca := hostCABundle()
	if ca == "" {
		ca = "/dev/null"
	}
	fmt.Fprintf(&b, "secrets:\n  build-ca:\n    file: %q\n", ca)
	file := filepath.Join(dir, "build.yaml")
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		return err
	}
	var name [4]byte
	if _, err := rand.Read(name[:]); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	out, err := e.Docker(ctx, "compose", "-p", "sytmhbuild"+hex.EncodeToString(name[:]), "-f", file, "build")
	if err != nil {
		return fmt.Errorf("building the images: %v\n%s", err, tail(out, 3000))
	}
	return nil
}

// tail returns the end of s, at most n bytes.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// routerCompose is the router project: one container on every host's
// network at .254, forwarding between them. Partitions are policy-routing
// rules in it (ip rule ... blackhole): packets are dropped silently, as a
// firewall or a cut link drops them.
func (m *multihost) routerCompose() string {
	var b strings.Builder
	b.WriteString("services:\n  router:\n")
	fmt.Fprintf(&b, "    image: %s\n", mhNetImage)
	fmt.Fprintf(&b, "    entrypoint: [\"sh\", \"-c\", %s]\n", yamlQuote(idleScript))
	b.WriteString("    cap_add: [NET_ADMIN]\n    sysctls:\n      net.ipv4.ip_forward: \"1\"\n    networks:\n")
	for _, name := range m.order {
		fmt.Fprintf(&b, "      %s: {ipv4_address: %q}\n", name, m.hosts[name].router)
	}
	b.WriteString("networks:\n")
	for _, name := range m.order {
		fmt.Fprintf(&b, "  %s:\n    ipam:\n      config:\n        - subnet: %q\n", name, m.hosts[name].subnet)
	}
	return b.String()
}

// idleScript keeps a container running until it is stopped.
const idleScript = "trap 'exit 0' TERM INT; while :; do sleep 1 & wait $!; done"

// hostOverride moves a role's services off the host's network into the
// "vm" container's namespace: the host's address on its own network, and
// a route to every other host's network through the router (what a VM's
// network gives it). The model host's vLLM becomes vllm-sim, and the
// replicas get the test's configuration.
func (m *multihost) hostOverride(h *mhHost, simImage, config string) string {
	var script strings.Builder
	script.WriteString("set -e; ")
	for _, name := range m.order {
		if o := m.hosts[name]; o != h {
			fmt.Fprintf(&script, "ip route add %s via %s; ", o.subnet, h.router)
		}
	}
	script.WriteString(idleScript)

	var b strings.Builder
	b.WriteString("services:\n  vm:\n")
	fmt.Fprintf(&b, "    image: %s\n    hostname: %s\n", mhNetImage, h.name)
	fmt.Fprintf(&b, "    entrypoint: [\"sh\", \"-c\", %s]\n", yamlQuote(script.String()))
	b.WriteString("    cap_add: [NET_ADMIN]\n")
	fmt.Fprintf(&b, "    networks:\n      wan: {ipv4_address: %q}\n", h.ip)
	if h.role == roleGateway {
		// Containers sharing a namespace share its /etc/hosts: the
		// envoy service's extra_hosts move to the vm.
		b.WriteString("    extra_hosts:\n")
		for i, r := range m.replicas {
			fmt.Fprintf(&b, "      - %q\n", fmt.Sprintf("switchyard-%d:%s", i+1, m.hosts[r].ip))
		}
	}
	svc := func(name string) { fmt.Fprintf(&b, "  %s:\n    network_mode: \"service:vm\"\n", name) }
	switch h.role {
	case roleControl:
		svc(svcConsul)
		svc(svcSwitchyard)
		b.WriteString("    build: !reset null\n    pull_policy: never\n")
		fmt.Fprintf(&b, "    volumes:\n      - %q\n", config+":"+switchyardConfigTarget+":ro")
	case roleModel:
		svc(svcConsul)
		svc(svcVLLM)
		fmt.Fprintf(&b, "    image: %s\n    pull_policy: never\n", simImage)
		b.WriteString("    command: !override [\"-host=0.0.0.0\", \"-port=8000\", \"-model=" + mhModelClosed +
			"\", \"-lora-modules=" + mhModelOpen + "\", \"-max-loras=2\", \"-time-scale=1\"]\n")
		b.WriteString("    environment: !reset {}\n    volumes: !reset []\n    deploy: !reset null\n    shm_size: !reset null\n")
		b.WriteString("    read_only: true\n    cap_drop: [ALL]\n")
		b.WriteString("    healthcheck:\n      test: [\"CMD\", \"/usr/local/bin/vllm-sim\", \"-probe=http://127.0.0.1:8000/health\"]\n" +
			"      interval: 2s\n      start_period: 10s\n")
	case roleGateway:
		svc(svcEnvoy)
		b.WriteString("    extra_hosts: !reset []\n")
	}
	fmt.Fprintf(&b, "networks:\n  wan:\n    name: %s_%s\n    external: true\n", m.router.Name, h.name)
	return b.String()
}

// yamlQuote writes s as a double-quoted YAML string that Compose's
// interpolation leaves as it is.
func yamlQuote(s string) string {
	return strconv.Quote(strings.ReplaceAll(s, "$", "$$"))
}

// --- what the test reads ---------------------------------------------------

// mhView is the deployment as the replicas and Envoys report it.
type mhView struct {
	replicas map[string]mhReplica // by host
	// envoys maps an Envoy's node ID to the versions it acknowledged,
	// as the replica holding its ADS stream reports them.
	envoys map[string]map[string]string
	// envoyHolder maps an Envoy to the replica holding its stream.
	envoyHolder map[string]string
}

// mhReplica is one replica's report, reduced to what convergence compares.
type mhReplica struct {
	versions map[string]string
	replicas []string            // replica IDs it lists
	pools    map[string][]string // pool -> "address[ flags]" sorted
	// unreachable lists "pool/address" of NodeUnreachable endpoints.
	unreachable []string
}

// mhStatus is the part of /api/status the multi-host test reads.
type mhStatus struct {
	ReplicaID string `json:"replica_id"`
	XDS       struct {
		Versions map[string]string `json:"versions"`
	} `json:"xds"`
	Envoys []struct {
		ID      string            `json:"id"`
		Streams int               `json:"streams"`
		Acked   map[string]string `json:"acked"`
	} `json:"envoys"`
	Replicas []struct {
		ID string `json:"id"`
	} `json:"replicas"`
	Pools []struct {
		Name      string `json:"name"`
		Endpoints []struct {
			Address         string `json:"address"`
			Draining        bool   `json:"draining"`
			Held            bool   `json:"held"`
			Healthy         bool   `json:"healthy"`
			NodeUnreachable bool   `json:"node_unreachable"`
			Scrape          *struct {
				MaxAgeMS float64 `json:"max_age_ms"`
			} `json:"scrape"`
		} `json:"endpoints"`
	} `json:"pools"`
}

func (m *multihost) adminURL(host string) string {
	return "http://" + m.hosts[host].ip.String() + ":9090"
}

func (m *multihost) status(host string) (mhStatus, error) {
	var st mhStatus
	err := getJSONWith(m.client, m.adminURL(host)+"/api/status", &st)
	return st, err
}

func getJSONWith(c *http.Client, url string, v any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("GET %s: %s %s", url, resp.Status, truncate(string(b), 200))
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// view reads every running replica (those that do not answer are left
// out).
func (m *multihost) view(skip ...string) (mhView, error) {
	v := mhView{replicas: map[string]mhReplica{}, envoys: map[string]map[string]string{}, envoyHolder: map[string]string{}}
	for _, h := range m.replicas {
		if slices.Contains(skip, h) {
			continue
		}
		st, err := m.status(h)
		if err != nil {
			return v, fmt.Errorf("%s: %w", h, err)
		}
		r := mhReplica{versions: st.XDS.Versions, pools: map[string][]string{}}
		for _, x := range st.Replicas {
			r.replicas = append(r.replicas, x.ID)
		}
		sort.Strings(r.replicas)
		for _, p := range st.Pools {
			var eps []string
			for _, e := range p.Endpoints {
				s := e.Address
				if e.Draining {
					s += " draining"
				}
				if e.Held {
					s += " held"
				}
				if !e.Healthy {
					s += " unhealthy"
				}
				if e.NodeUnreachable {
					r.unreachable = append(r.unreachable, p.Name+"/"+e.Address)
				}
				eps = append(eps, s)
			}
			sort.Strings(eps)
			r.pools[p.Name] = eps
		}
		v.replicas[h] = r
		for _, e := range st.Envoys {
			if e.Streams == 0 {
				continue
			}
			// A replica may still hold the stream an Envoy dropped during
			// a partition (until its keepalive gives up on it, 40 s): it
			// reports the same versions, or the Envoy is not converged.
			if prev, dup := v.envoys[e.ID]; dup && !maps.Equal(prev, e.Acked) {
				return v, fmt.Errorf("Envoy %s has ADS streams on %s (acked %v) and %s (acked %v)", e.ID, v.envoyHolder[e.ID], prev, h, e.Acked)
			}
			v.envoys[e.ID], v.envoyHolder[e.ID] = e.Acked, h
		}
	}
	return v, nil
}

// complete: the baseline state: both replicas list both, every model host
// is a healthy member of both pools on both, they serve the same
// versions, and each Envoy has acknowledged them.
func (v mhView) complete(m *multihost) error {
	want := slices.Sorted(maps.Values(m.replicaID))
	var versions map[string]string
	for _, h := range m.replicas {
		r, ok := v.replicas[h]
		if !ok {
			return fmt.Errorf("%s did not answer", h)
		}
		if !slices.Equal(r.replicas, want) {
			return fmt.Errorf("%s lists replicas %v, want %v", h, r.replicas, want)
		}
		for _, pool := range []string{mhPoolClosed, mhPoolOpen} {
			var eps []string
			for _, mh := range m.models {
				eps = append(eps, m.hosts[mh].ip.String()+":8000")
			}
			sort.Strings(eps)
			if !slices.Equal(r.pools[pool], eps) {
				return fmt.Errorf("%s: pool %s is %v, want %v healthy", h, pool, r.pools[pool], eps)
			}
		}
		if versions == nil {
			versions = r.versions
		} else if !maps.Equal(versions, r.versions) {
			return fmt.Errorf("the replicas serve different versions: %v and %v", versions, r.versions)
		}
	}
	for _, g := range m.gateways {
		if !maps.Equal(v.envoys[g], versions) {
			return fmt.Errorf("Envoy %s acknowledged %v, the replicas serve %v", g, v.envoys[g], versions)
		}
	}
	return nil
}

// sameAs reports how v differs from base: the replicas' versions, replica
// lists and pools, and each Envoy's acknowledged versions.
func (v mhView) sameAs(base mhView) error {
	for h, b := range base.replicas {
		r, ok := v.replicas[h]
		if !ok {
			return fmt.Errorf("%s did not answer", h)
		}
		if !maps.Equal(r.versions, b.versions) {
			return fmt.Errorf("%s serves %v, before the fault %v", h, r.versions, b.versions)
		}
		if !slices.Equal(r.replicas, b.replicas) {
			return fmt.Errorf("%s lists replicas %v, before the fault %v", h, r.replicas, b.replicas)
		}
		if !maps.EqualFunc(r.pools, b.pools, slices.Equal) {
			return fmt.Errorf("%s has pools %v, before the fault %v", h, r.pools, b.pools)
		}
	}
	for id, acked := range base.envoys {
		if !maps.Equal(v.envoys[id], acked) {
			return fmt.Errorf("Envoy %s acknowledged %v (on %q), before the fault %v", id, v.envoys[id], v.envoyHolder[id], acked)
		}
	}
	return nil
}

// envoyAdmin GETs a path of a gateway's Envoy admin (loopback only, so
// from inside its container, as the compose health check does).
func (m *multihost) envoyAdmin(gateway, path string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	script := `exec 3<>/dev/tcp/127.0.0.1/9901 && printf 'GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' "$1" >&3 && cat <&3`
	out, err := m.hosts[gateway].p.Exec(ctx, svcEnvoy, "bash", "-c", script, "admin", path)
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, out)
	}
	if !strings.HasPrefix(out, "HTTP/1.1 200") {
		return "", fmt.Errorf("Envoy admin %s: %s", path, truncate(out, 300))
	}
	return out, nil
}

// pickersHealthy: the gateway's Envoy has every replica's picker in its
// picker cluster, healthy.
func (m *multihost) pickersHealthy(gateway string) error {
	out, err := m.envoyAdmin(gateway, "/clusters")
	if err != nil {
		return err
	}
	for _, r := range m.replicas {
		key := "switchyard/picker::" + m.hosts[r].ip.String() + ":9002::health_flags::"
		i := strings.Index(out, key)
		if i < 0 {
			return fmt.Errorf("%s: %s's picker is not in the picker cluster", gateway, r)
		}
		flags, _, _ := strings.Cut(out[i+len(key):], "\n")
		if flags = strings.TrimSpace(flags); flags != "healthy" {
			return fmt.Errorf("%s: %s's picker is %s", gateway, r, flags)
		}
	}
	return nil
}

// consul GETs a path of the Consul HTTP API from the agent of host (it
// listens on loopback only).
func (m *multihost) consul(host, path string, v any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := m.hosts[host].p.Exec(ctx, svcConsul, "curl", "-fsS", "--max-time", "5", "http://127.0.0.1:8500"+path)
	if err != nil {
		return fmt.Errorf("%s: consul %s: %v: %s", host, path, err, truncate(out, 300))
	}
	return json.Unmarshal([]byte(out), v)
}

// nodeHealth returns the status of a node's serfHealth check and of its
// vllm service check, as the servers see them.
func (m *multihost) nodeHealth(from, node string) (serf, service string, err error) {
	var checks []struct {
		CheckID, ServiceID, Status string
	}
	if err := m.consul(from, "/v1/health/node/"+node, &checks); err != nil {
		return "", "", err
	}
	for _, c := range checks {
		switch {
		case c.CheckID == "serfHealth":
			serf = c.Status
		case c.ServiceID != "":
			service = c.Status
		}
	}
	return serf, service, nil
}

// freshFor returns the longest a replica's picker counts an endpoint's
// last successful scrape as fresh (its max_age_ms, in any pool): for that
// long after its server went silent the picker may still choose it. The
// picker sets it from its scrape interval, which the engine budget
// lengthens when scrapes are slow (as on this loaded machine).
func (m *multihost) freshFor(addr string) (time.Duration, error) {
	var most time.Duration
	for _, h := range m.replicas {
		st, err := m.status(h)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", h, err)
		}
		for _, p := range st.Pools {
			for _, e := range p.Endpoints {
				if e.Address == addr && e.Scrape != nil {
					most = max(most, time.Duration(e.Scrape.MaxAgeMS*float64(time.Millisecond)))
				}
			}
		}
	}
	if most == 0 {
		return 0, fmt.Errorf("no replica reports a scrape of %s", addr)
	}
	return most, nil
}

// latePicks lists, for a failure's diagnosis, the decision records of
// every replica that named addr (picked, fallback or served) at or after
// since: when and in which pool, the filters' counts, the candidates and
// the outcome.
func (m *multihost) latePicks(addr string, since time.Time) string {
	var b strings.Builder
	for _, h := range m.replicas {
		var dec struct {
			Records []struct {
				Time     time.Time `json:"time"`
				Pool     string    `json:"pool"`
				PoolSize int       `json:"pool_size"`
				Filters  []struct {
					Name string `json:"name"`
					Left int    `json:"left"`
				} `json:"filters"`
				Candidates []struct {
					Endpoint string `json:"endpoint"`
				} `json:"candidates"`
				Picked    string   `json:"picked"`
				Fallbacks []string `json:"fallbacks"`
				Outcome   struct {
					Status int    `json:"status"`
					Served string `json:"served"`
				} `json:"outcome"`
			} `json:"records"`
		}
		if err := getJSONWith(m.client, m.adminURL(h)+"/api/decisions?limit=1000&endpoint="+url.QueryEscape(addr), &dec); err != nil {
			fmt.Fprintf(&b, "%s: %v\n", h, err)
			continue
		}
		for _, r := range dec.Records {
			if r.Time.Before(since) {
				continue
			}
			var cands []string
			for _, c := range r.Candidates {
				cands = append(cands, c.Endpoint)
			}
			fmt.Fprintf(&b, "%s: %+.3fs pool %s (%d): filters %+v candidates %v picked %s fallbacks %v status %d served %q\n",
				h, r.Time.Sub(since).Seconds(), r.Pool, r.PoolSize, r.Filters, cands, r.Picked, r.Fallbacks, r.Outcome.Status, r.Outcome.Served)
		}
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}

// simRequests reads a model host's finished-request counter.
func (m *multihost) simRequests(host string) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.hosts[host].ip.String()+":8000/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	total := 0.0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "vllm:request_success_total{") {
			f := strings.Fields(line)
			x, _ := strconv.ParseFloat(f[len(f)-1], 64)
			total += x
		}
	}
	return total, nil
}

// mhSeq numbers the test's requests.
var mhSeq atomic.Int64

// chat sends one chat completion through a gateway.
func (m *multihost) chat(ctx context.Context, gateway, model, content string) error {
	// Every prompt starts differently: no prefix is cached anywhere, so
	// the picker spreads the requests over the model hosts by load.
	body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 8, "messages": []map[string]string{
		{"role": "system", "content": fmt.Sprintf("Request %d. You are the switchyard multi-host test's assistant. Answer briefly.", mhSeq.Add(1))},
		{"role": "user", "content": content},
	}})
	ctx, cancel := context.WithTimeout(ctx, mhRequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+m.hosts[gateway].ip.String()+":8080/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := m.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, truncate(string(out), 160))
	}
	var r struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if err := json.Unmarshal(out, &r); err != nil || len(r.Choices) == 0 {
		return fmt.Errorf("200 without choices: %s", truncate(string(out), 160))
	}
	return nil
}

// --- load and faults -------------------------------------------------------

// mhFailure is one failed request, classified.
type mhFailure struct {
	gateway, pool string
	start         time.Duration // sent, relative to the fault
	err           string
}

// mhLoad is the steady load of a fault: mhWorkers requests in flight,
// spread over both gateways and both pools.
type mhLoad struct {
	l *composetest.Load
}

func (m *multihost) startLoad() *mhLoad {
	ld := &mhLoad{}
	var n atomic.Int64
	ld.l = composetest.StartLoad(mhWorkers, func(ctx context.Context) error {
		i := n.Add(1)
		gw := m.gateways[i%int64(len(m.gateways))]
		model, pool := mhModelClosed, mhPoolClosed
		if (i/2)%2 == 1 {
			model, pool = mhModelOpen, mhPoolOpen
		}
		if err := m.chat(ctx, gw, model, fmt.Sprintf("question %d", i%16)); err != nil {
			return fmt.Errorf("%s %s: %w", gw, pool, err)
		}
		return nil
	})
	return ld
}

// wait waits until n more requests have finished.
func (ld *mhLoad) wait(t *testing.T, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := ld.l.WaitDone(ctx, ld.l.Done()+n); err != nil {
		t.Fatalf("load: %v", err)
	}
}

// finish drains the load (requests in flight are counted) and classifies
// its failures relative to the fault's time.
func (ld *mhLoad) finish(fault time.Time) (int, []mhFailure) {
	r := ld.l.Drain()
	var out []mhFailure
	for _, f := range r.Failures {
		gw, rest, _ := strings.Cut(f.Err, " ")
		pool, msg, _ := strings.Cut(rest, ": ")
		out = append(out, mhFailure{gateway: gw, pool: pool, start: f.Start.Sub(fault), err: msg})
	}
	return r.Requests, out
}

// describeFailures groups failures by gateway, pool and error, with when
// they were sent relative to the fault.
func describeFailures(fs []mhFailure) string {
	if len(fs) == 0 {
		return ""
	}
	type group struct {
		n          int
		first, end time.Duration
	}
	groups := map[string]*group{}
	var keys []string
	for _, f := range fs {
		msg := f.err
		if i := strings.Index(msg, `"message":"`); i >= 0 {
			msg, _, _ = strings.Cut(msg[:strings.Index(msg, ":")]+" "+msg[i+len(`"message":"`):], `"`)
		}
		if strings.Contains(msg, "context deadline exceeded") {
			msg = "no answer within " + mhRequestTimeout.String()
		}
		k := fmt.Sprintf("%s/%s %s", f.gateway, f.pool, msg)
		g, ok := groups[k]
		if !ok {
			g = &group{first: f.start, end: f.start}
			groups[k] = g
			keys = append(keys, k)
		}
		g.n++
		g.first, g.end = min(g.first, f.start), max(g.end, f.start)
	}
	var parts []string
	for _, k := range keys {
		g := groups[k]
		parts = append(parts, fmt.Sprintf("%d× %s (sent %+.1fs..%+.1fs)", g.n, k, g.first.Seconds(), g.end.Seconds()))
	}
	return "; failed: " + strings.Join(parts, ", ")
}

// inFlightAt counts the failures sent before at (in flight then).
func inFlightAt(fs []mhFailure, at time.Duration) int {
	n := 0
	for _, f := range fs {
		if f.start <= at {
			n++
		}
	}
	return n
}

// kill takes a host down as a VM that loses power: the router drops
// everything to and from it first, so no FIN or reset of its dying
// processes reaches anyone, then every container is killed at once and the
// router forwards to its (now absent) address again: new connections fail
// as to any vanished host (no ARP answer), established ones hang.
//
// It returns when the host went silent.
func (m *multihost) kill(t *testing.T, host string) time.Time {
	t.Helper()
	h := m.hosts[host]
	ids := strings.Fields(h.p.Must(t, time.Minute, "ps", "-q"))
	rules := []string{fmt.Sprintf("to %s blackhole", h.subnet), fmt.Sprintf("from %s blackhole", h.subnet)}
	silent := m.route(t, "add", rules)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := m.e.Docker(ctx, append([]string{"kill"}, ids...)...); err != nil {
		t.Fatalf("killing %s: %v: %s", host, err, out)
	}
	m.route(t, "del", rules)
	return silent
}

// restart brings a killed host back, as a VM that boots: its containers
// start again with their volumes.
func (m *multihost) restart(t *testing.T, host string) {
	t.Helper()
	h := m.hosts[host]
	h.p.Must(t, 5*time.Minute, append([]string{"up", "-d", "--wait", "--wait-timeout", "240"}, h.services...)...)
}

// route runs ip rule commands in the router ("add" or "del" each rule)
// and returns when they are in force: the instant a fault starts or
// heals, as the test counts it (requests sent before it were in flight).
func (m *multihost) route(t *testing.T, op string, rules []string) time.Time {
	t.Helper()
	var script strings.Builder
	script.WriteString("set -e; ")
	for _, r := range rules {
		fmt.Fprintf(&script, "ip rule %s %s; ", op, r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := m.router.Exec(ctx, "router", "sh", "-c", script.String()); err != nil {
		t.Fatalf("router: ip rule %s: %v: %s", op, err, out)
	}
	return time.Now()
}

// converge waits until the deployment is as it was before the fault (see
// sameAs, plus every Envoy with every replica's picker healthy) and
// returns how long that took from since. It logs what was still pending
// each time that changed.
func (m *multihost) converge(t *testing.T, since time.Time, what string) time.Duration {
	t.Helper()
	var took time.Duration
	var trace []string
	last := ""
	testutil.Eventually(t, 2*time.Minute, what+": converged", func() error {
		polled := time.Now()
		err := func() error {
			v, err := m.view()
			if err != nil {
				return err
			}
			if err := v.sameAs(m.base); err != nil {
				return err
			}
			// Both Envoys at once: each is a docker exec, slow on a
			// loaded machine, and the poll's length bounds the figure.
			errs := make([]error, len(m.gateways))
			var wg sync.WaitGroup
			for i, g := range m.gateways {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = m.pickersHealthy(g)
				}()
			}
			wg.Wait()
			return errors.Join(errs...)
		}()
		if msg := fmt.Sprint(err); msg != last {
			trace = append(trace, fmt.Sprintf("+%v (poll of %v) %s", time.Since(since).Round(10*time.Millisecond),
				time.Since(polled).Round(10*time.Millisecond), truncate(msg, 200)))
			last = msg
		}
		if err == nil {
			took = time.Since(since)
		}
		return err
	})
	t.Logf("%s: convergence from the heal:\n  %s", what, strings.Join(trace, "\n  "))
	if took > mhConverge {
		t.Errorf("%s: converged %v after the heal, target %v", what, took.Round(10*time.Millisecond), mhConverge)
	}
	return took
}

// pickerGone waits until no gateway's Envoy has host's picker healthy and
// returns how long after since.
func (m *multihost) pickerGone(t *testing.T, host string, since time.Time) time.Duration {
	t.Helper()
	key := "switchyard/picker::" + m.hosts[host].ip.String() + ":9002::health_flags::healthy"
	var took time.Duration
	testutil.Eventually(t, time.Minute, host+"'s picker ejected by every Envoy", func() error {
		for _, g := range m.gateways {
			out, err := m.envoyAdmin(g, "/clusters")
			if err != nil {
				return err
			}
			for _, l := range strings.Split(out, "\n") {
				if strings.TrimSpace(l) == key {
					return fmt.Errorf("%s still has it healthy", g)
				}
			}
		}
		took = time.Since(since)
		return nil
	})
	return took
}

func (m *multihost) row(fault string, requests int, failed []mhFailure, notes string) {
	m.table = append(m.table, faultRow{fault: fault, requests: requests, failed: len(failed), notes: notes + describeFailures(failed)})
}

// checkRequests: both pools answer through both gateways, and every model
// host serves.
func (m *multihost) checkRequests(t *testing.T) {
	before := map[string]float64{}
	for _, h := range m.models {
		n, err := m.simRequests(h)
		if err != nil {
			t.Fatal(err)
		}
		before[h] = n
	}
	for i := range 24 {
		gw := m.gateways[i%2]
		for _, model := range []string{mhModelClosed, mhModelOpen} {
			if err := m.chat(context.Background(), gw, model, fmt.Sprintf("hello %d", i)); err != nil {
				t.Fatalf("%s via %s: %v", model, gw, err)
			}
		}
	}
	for _, h := range m.models {
		n, err := m.simRequests(h)
		if err != nil {
			t.Fatal(err)
		}
		if n == before[h] {
			t.Errorf("%s served none of 48 requests", h)
		}
	}
}

// faultLoseModelHost: a model host loses power under load. Only the
// requests it was serving may fail; switchyard stops picking it and Envoy
// stops routing to it. When it boots again it registers and rejoins.
func (m *multihost) faultLoseModelHost(t *testing.T) {
	victim := m.models[1]
	addr := m.hosts[victim].ip.String() + ":8000"
	ld := m.startLoad()
	ld.wait(t, 30)
	fresh, err := m.freshFor(addr)
	if err != nil {
		t.Fatal(err)
	}
	staleAfter := fresh + mhStaleMargin
	killed := m.kill(t, victim)
	var gone time.Duration
	testutil.Eventually(t, time.Minute, victim+" out of every pool's routed endpoints", func() error {
		v, err := m.view()
		if err != nil {
			return err
		}
		for h, r := range v.replicas {
			for pool, eps := range r.pools {
				if slices.Contains(eps, addr) {
					return fmt.Errorf("%s still routes pool %s to %s", h, pool, addr)
				}
			}
		}
		gone = time.Since(killed)
		return nil
	})
	ld.wait(t, 100)
	requests, failed := ld.finish(killed)
	// What may fail: requests in flight on the host, and those the picker
	// sent it before it could know: until its metrics went stale (no
	// successful scrape for max_age_ms: picker/sched's health filter;
	// 250 ms on a quiet machine, up to 3 s when scrapes are slow), the
	// host looked as alive as the others. They hang on a host that went
	// silent (no reset reaches anyone) until the client gives up.
	var committed, bad []mhFailure
	for _, f := range failed {
		if f.start <= staleAfter && strings.Contains(f.err, "context deadline exceeded") {
			committed = append(committed, f)
		} else {
			bad = append(bad, f)
		}
	}
	if len(committed) > mhWorkers {
		t.Errorf("%d requests failed on %s, more than the %d in flight: %+v", len(committed), victim, mhWorkers, committed)
	}
	if len(bad) > 0 {
		t.Errorf("%d requests failed that were not on %s when it died nor sent there before its metrics went stale: %+v", len(bad), victim, bad)
		t.Logf("what the replicas picked %s for after %v:\n%s", addr, staleAfter, m.latePicks(addr, killed.Add(staleAfter)))
	}
	serf, _, _ := m.nodeHealth(m.controls[0], victim)

	booted := time.Now()
	m.restart(t, victim)
	up := time.Now()
	took := m.converge(t, up, "model host back")
	m.row("lose a model host ("+victim+": silent, then every container killed)", requests, failed,
		fmt.Sprintf("%d failed requests were in flight on it or sent there before its metrics went stale (the picker's max age %v); it left every replica's routed endpoints %v after it went silent (its Consul serfHealth then %s); booted again (healthy) in %v; converged %v after that",
			len(committed), fresh.Round(10*time.Millisecond), gone.Round(100*time.Millisecond), serf, up.Sub(booted).Round(100*time.Millisecond), took.Round(10*time.Millisecond)))
}

// mhConsulPorts are Consul's server RPC, LAN and WAN gossip ports.
const mhConsulPorts = "8300-8302"

// consulOnlyRules cut a host's Consul traffic (TCP and UDP to the Consul
// ports, both ways) and nothing else.
func (m *multihost) consulOnlyRules(host string) []string {
	s := m.hosts[host].subnet
	var rules []string
	for _, proto := range []string{"6", "17"} {
		rules = append(rules,
			fmt.Sprintf("from %s to %s ipproto %s dport %s blackhole", s, mhWAN, proto, mhConsulPorts),
			fmt.Sprintf("from %s to %s ipproto %s dport %s blackhole", mhWAN, s, proto, mhConsulPorts))
	}
	return rules
}

// faultPartitionModelFromConsul: a model host's Consul traffic is cut,
// nothing else. Consul marks its node failed (serfHealth critical), so its
// registration is critical, while the server answers Envoy and
// switchyard's scrapes. switchyard keeps it: the evidence against it is
// only that Consul cannot reach its agent, and switchyard's own scrapes
// reach the server (registry.Endpoint.NodeUnreachable). No request fails,
// no xDS version changes; after the heal Consul passes it again.
func (m *multihost) faultPartitionModelFromConsul(t *testing.T) {
	victim := m.models[2]
	addr := m.hosts[victim].ip.String() + ":8000"
	rules := m.consulOnlyRules(victim)
	ld := m.startLoad()
	ld.wait(t, 30)
	cut := m.route(t, "add", rules)
	healed := false
	defer func() {
		if !healed {
			m.route(t, "del", rules)
		}
	}()
	var critical time.Duration
	testutil.Eventually(t, time.Minute, "Consul marks "+victim+" failed", func() error {
		serf, _, err := m.nodeHealth(m.controls[0], victim)
		if err != nil {
			return err
		}
		if serf != "critical" {
			return fmt.Errorf("serfHealth %s", serf)
		}
		critical = time.Since(cut)
		return nil
	})
	// Its registration is critical in Consul; switchyard keeps routing to
	// it, marked, for as long as the partition lasts.
	served, err := m.simRequests(victim)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, "every replica marks "+victim+" node-unreachable", func() error {
		v, err := m.view()
		if err != nil {
			return err
		}
		for _, h := range m.replicas {
			for _, pool := range []string{mhPoolClosed, mhPoolOpen} {
				if !slices.Contains(v.replicas[h].unreachable, pool+"/"+addr) {
					return fmt.Errorf("%s: %s not marked node-unreachable in %s (%v)", h, addr, pool, v.replicas[h].unreachable)
				}
			}
		}
		return nil
	})
	ld.wait(t, 80)
	v, err := m.view()
	if err != nil {
		t.Fatal(err)
	}
	if err := v.sameAs(m.base); err != nil {
		t.Errorf("routing changed while only Consul lost %s: %v", victim, err)
	}
	after, err := m.simRequests(victim)
	if err != nil {
		t.Fatal(err)
	}
	if after <= served {
		t.Errorf("%s served no request while partitioned from Consul (%v then %v)", victim, served, after)
	}

	heal := m.route(t, "del", rules)
	healed = true
	routed := m.converge(t, heal, "model host back in Consul")
	ld.wait(t, 20)
	requests, failed := ld.finish(cut)
	if len(failed) > 0 {
		t.Errorf("%d requests failed while a model host was cut from Consul only: %+v", len(failed), failed)
	}
	var passing time.Duration
	testutil.Eventually(t, 2*time.Minute, "Consul passes "+victim+" again", func() error {
		serf, svc, err := m.nodeHealth(m.controls[0], victim)
		if err != nil {
			return err
		}
		if serf != "passing" || svc != "passing" {
			return fmt.Errorf("serfHealth %s, vllm %s", serf, svc)
		}
		passing = time.Since(heal)
		return nil
	})
	testutil.Eventually(t, 30*time.Second, "no endpoint marked node-unreachable", func() error {
		v, err := m.view()
		if err != nil {
			return err
		}
		for h, r := range v.replicas {
			if len(r.unreachable) > 0 {
				return fmt.Errorf("%s: %v", h, r.unreachable)
			}
		}
		return nil
	})
	m.row("partition a model host from Consul only ("+victim+": ports "+mhConsulPorts+" cut both ways)", requests, failed,
		fmt.Sprintf("Consul marked its node critical %v after the cut; every replica kept it in both pools (marked node_unreachable), xDS versions unchanged, it kept serving (%v requests meanwhile); after the heal routing was as before at %v, Consul passed it again %v after the heal",
			critical.Round(100*time.Millisecond), after-served, routed.Round(10*time.Millisecond), passing.Round(100*time.Millisecond)))
}

// partitionRules cut every packet between two hosts, both ways.
func (m *multihost) partitionRules(a string, bs ...string) []string {
	var rules []string
	for _, b := range bs {
		rules = append(rules,
			fmt.Sprintf("from %s to %s blackhole", m.hosts[a].subnet, m.hosts[b].subnet),
			fmt.Sprintf("from %s to %s blackhole", m.hosts[b].subnet, m.hosts[a].subnet))
	}
	return rules
}

// faultPartitionGateway: a gateway host is cut from every control host
// (no ADS, no picker). Its Envoy keeps its last configuration: the
// fail_open pool goes on through Envoy's own balancing, the fail_closed
// pool answers the documented 503; the other gateway is not affected.
// After the heal the Envoy is back on ADS and its pickers.
func (m *multihost) faultPartitionGateway(t *testing.T) {
	victim := m.gateways[0]
	rules := m.partitionRules(victim, m.controls...)
	ld := m.startLoad()
	ld.wait(t, 30)
	cut := m.route(t, "add", rules)
	healed := false
	defer func() {
		if !healed {
			m.route(t, "del", rules)
		}
	}()
	var ejected time.Duration
	testutil.Eventually(t, time.Minute, victim+"'s Envoy without a healthy picker", func() error {
		out, err := m.envoyAdmin(victim, "/clusters")
		if err != nil {
			return err
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "switchyard/picker::") && strings.HasSuffix(strings.TrimSpace(l), "::health_flags::healthy") {
				return fmt.Errorf("still healthy: %s", l)
			}
		}
		ejected = time.Since(cut)
		return nil
	})
	// Through the cut gateway, now: the fail_open pool is served without
	// the picker, the fail_closed pool answers the documented 503.
	if err := m.chat(context.Background(), victim, mhModelOpen, "still open?"); err != nil {
		t.Errorf("a fail_open request through %s while it is cut from every picker: %v", victim, err)
	}
	if err := m.chat(context.Background(), victim, mhModelClosed, "closed?"); err == nil || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "endpoint picker unavailable") {
		t.Errorf("a fail_closed request through %s while it is cut from every picker: %v, want the 503 endpoint picker unavailable", victim, err)
	}
	ld.wait(t, 120)
	// Envoy kept its configuration: the pools' clusters and endpoints.
	clusters, err := m.envoyAdmin(victim, "/clusters")
	if err != nil {
		t.Fatal(err)
	}
	for _, mh := range m.models {
		if !strings.Contains(clusters, "::"+m.hosts[mh].ip.String()+":8000::") {
			t.Errorf("%s's Envoy lost %s's endpoint while cut from switchyard", victim, mh)
		}
	}
	heal := m.route(t, "del", rules)
	healed = true
	took := m.converge(t, heal, victim+" back")
	// Fail-closed requests through it succeed again.
	var back time.Duration
	testutil.Eventually(t, time.Minute, victim+" serves the fail_closed pool again", func() error {
		if err := m.chat(context.Background(), victim, mhModelClosed, "back?"); err != nil {
			return err
		}
		back = time.Since(heal)
		return nil
	})
	ld.wait(t, 20)
	requests, failed := ld.finish(cut)

	// What may fail: requests through the cut gateway whose picker
	// stream the cut broke (in flight then), and its fail_closed requests
	// for as long as it cannot reach a picker (the documented 503). Its
	// fail_open requests sent after the ejection must succeed (Envoy's
	// own balancing). Those sent between the cut and the ejection (about
	// 3.5 s, so that a stalled picker is not ejected) wait on a picker
	// that answers nothing; the retry on another picker (fix/23-replicas)
	// finds none reachable either, so one whose retries run out before
	// the ejection gets the picker-unavailable 503 (its body was sent to
	// the picker): tolerated, counted in the table. Nothing through the
	// other gateway may fail.
	var inflight, unreachable, closed, bad []mhFailure
	for _, f := range failed {
		unavailable := strings.Contains(f.err, "endpoint picker unavailable")
		switch {
		case f.gateway != victim:
			bad = append(bad, f)
		case f.start <= 0:
			inflight = append(inflight, f)
		case f.pool == mhPoolClosed && unavailable:
			closed = append(closed, f)
		case f.pool == mhPoolOpen && unavailable && f.start <= ejected:
			unreachable = append(unreachable, f)
		default:
			bad = append(bad, f)
		}
	}
	if len(bad) > 0 {
		t.Errorf("%d requests failed that the partition must not fail (through the other gateway, the fail_open pool after the ejection, or not the documented 503): %+v", len(bad), bad)
	}
	if len(inflight) > mhWorkers {
		t.Errorf("%d requests in flight at the cut failed, more than the %d in flight: %+v", len(inflight), mhWorkers, inflight)
	}
	if len(closed) == 0 {
		t.Errorf("no fail_closed request through %s got the 503 while it was cut from every picker", victim)
	}
	m.row("partition a gateway host from the control hosts ("+victim+")", requests, failed,
		fmt.Sprintf("its Envoy ejected both pickers %v after the cut and kept its configuration; its fail_open requests sent after the ejection all succeeded, %d sent before it failed (every picker unreachable); its fail_closed ones got the documented 503 (%d); the other gateway failed none; %d failed requests were in flight at the cut; after the heal: converged %v, fail_closed requests through it served again %v after the heal",
			ejected.Round(100*time.Millisecond), len(unreachable), len(closed), len(inflight), took.Round(10*time.Millisecond), back.Round(10*time.Millisecond)))
}

// leader returns the control host whose Consul server is the leader.
func (m *multihost) leader(from string) (string, error) {
	var addr string
	if err := m.consul(from, "/v1/status/leader", &addr); err != nil {
		return "", err
	}
	for _, c := range m.controls {
		if strings.HasPrefix(addr, m.hosts[c].ip.String()+":") {
			return c, nil
		}
	}
	return "", fmt.Errorf("no leader (%q)", addr)
}

// faultLeaderLoss: the Consul leader dies. Leadership is moved first to
// the control host that runs no replica, so the fault is the leader's
// loss alone (a replica's host losing its agent is the switchyard host
// fault). No request fails; the remaining servers elect a leader; the
// restarted server rejoins.
func (m *multihost) faultLeaderLoss(t *testing.T) {
	target := m.controls[2]
	var node struct {
		Config struct{ NodeID string }
	}
	if err := m.consul(target, "/v1/agent/self", &node); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 2*time.Minute, target+" leads", func() error {
		l, err := m.leader(target)
		if err != nil {
			return err
		}
		if l == target {
			return nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := m.hosts[target].p.Exec(ctx, svcConsul, "consul", "operator", "raft", "transfer-leader", "-id="+node.Config.NodeID)
		return fmt.Errorf("leader %s; transfer-leader: %v %s", l, err, strings.TrimSpace(out))
	})

	ld := m.startLoad()
	ld.wait(t, 30)
	killed := time.Now()
	m.hosts[target].p.Kill(t, svcConsul, "KILL")
	var elected time.Duration
	var newLeader string
	testutil.Eventually(t, time.Minute, "a new Consul leader", func() error {
		l, err := m.leader(m.controls[0])
		if err != nil {
			return err
		}
		if l == target {
			return errors.New("the dead leader still leads")
		}
		newLeader, elected = l, time.Since(killed)
		return nil
	})
	ld.wait(t, 60)
	v, err := m.view()
	if err != nil {
		t.Fatal(err)
	}
	if err := v.sameAs(m.base); err != nil {
		t.Errorf("routing changed while Consul elected a leader: %v", err)
	}
	restarted := time.Now()
	m.restart(t, target)
	healthy := time.Now()
	took := m.converge(t, healthy, "leader back")
	ld.wait(t, 20)
	requests, failed := ld.finish(killed)
	if len(failed) > 0 {
		t.Errorf("%d requests failed while Consul lost its leader: %+v", len(failed), failed)
	}
	var rejoined time.Duration
	testutil.Eventually(t, 2*time.Minute, "three Consul servers again", func() error {
		var peers []string
		if err := m.consul(m.controls[0], "/v1/status/peers", &peers); err != nil {
			return err
		}
		var members []struct {
			Name   string
			Status int
		}
		if err := m.consul(m.controls[0], "/v1/agent/members", &members); err != nil {
			return err
		}
		for _, mb := range members {
			if mb.Name == target && mb.Status != 1 {
				return fmt.Errorf("%s is member status %d", target, mb.Status)
			}
		}
		if len(peers) != 3 {
			return fmt.Errorf("raft peers %v", peers)
		}
		rejoined = time.Since(restarted)
		return nil
	})
	m.row("Consul leader loss ("+target+"'s server killed)", requests, failed,
		fmt.Sprintf("%s elected %v after the kill; routing unchanged throughout; the restarted server healthy after %v, converged %v after that, a raft peer again %v after its start",
			newLeader, elected.Round(100*time.Millisecond), healthy.Sub(restarted).Round(100*time.Millisecond), took.Round(10*time.Millisecond), rejoined.Round(100*time.Millisecond)))
}

// faultLoseSwitchyardHost: a control host with a replica loses power (its
// Consul server and its replica). Envoy's ADS streams move to the other
// replica; only requests whose picker stream was on it may fail. When it
// boots, its replica restores its state, rejoins and the picker cluster is
// as before. Requests sent after the host died, before the Envoys ejected
// its picker, are retried on the other picker: none of them may fail.
func (m *multihost) faultLoseSwitchyardHost(t *testing.T) {
	victim := m.replicas[0]
	survivor := m.replicas[1]
	ld := m.startLoad()
	ld.wait(t, 30)
	killed := m.kill(t, victim)
	ejected := m.pickerGone(t, victim, killed)
	var moved, dropped time.Duration
	testutil.Eventually(t, time.Minute, "every Envoy on "+survivor+" and its picker cluster without "+victim, func() error {
		v, err := m.view(victim)
		if err != nil {
			return err
		}
		if r := v.replicas[survivor].replicas; dropped == 0 && slices.Equal(r, []string{m.replicaID[survivor]}) {
			dropped = time.Since(killed)
		}
		if moved == 0 && !slices.ContainsFunc(m.gateways, func(g string) bool { return v.envoyHolder[g] != survivor }) {
			moved = time.Since(killed)
		}
		if dropped == 0 || moved == 0 {
			return fmt.Errorf("%s lists replicas %v; Envoys on %v", survivor, v.replicas[survivor].replicas, v.envoyHolder)
		}
		return nil
	})
	ld.wait(t, 100)
	requests, failed := ld.finish(killed)
	if n := inFlightAt(failed, 0); n > mhWorkers {
		t.Errorf("%d requests in flight failed, more than the %d in flight: %+v", n, mhWorkers, failed)
	}
	if n := len(failed) - inFlightAt(failed, 0); n > 0 {
		t.Errorf("%d requests sent after %s went silent failed: %+v", n, victim, failed)
	}
	booted := time.Now()
	m.restart(t, victim)
	up := time.Now()
	took := m.converge(t, up, "switchyard host back")
	m.row("lose a switchyard host ("+victim+": its Consul server and "+m.replicaID[victim]+")", requests, failed,
		fmt.Sprintf("every Envoy ejected its picker %v after the kill; %s dropped %s from its replicas (Consul) after %v, both Envoys' ADS on it after %v; the %d failed requests were in flight through its picker; booted again (healthy) in %v, converged %v after that",
			ejected.Round(100*time.Millisecond), m.replicaID[survivor], m.replicaID[victim], dropped.Round(100*time.Millisecond), moved.Round(100*time.Millisecond), len(failed),
			up.Sub(booted).Round(100*time.Millisecond), took.Round(10*time.Millisecond)))
}
