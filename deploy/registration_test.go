package deploy

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"
	consulapi "github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/certgen"
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
	cfg := readHCLConfig(t, bindSourceFor(t, replicaServices(t, p)[0], switchyardConfigTarget))
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

	// The replicas start with their compose commands and configuration,
	// next to this Consul, turn healthy by the compose health check,
	// register themselves and find each other.
	t.Run("replicas", func(t *testing.T) {
		checkReplicasLive(t, p, client, httpAddr)
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

// liveReplica is a replica started by startReplicaLikeCompose, on loopback.
type liveReplica struct {
	name                string
	extproc, xds, admin string // the addresses it listens on and advertises
	cert, key           string // its certificate and key (from devcerts)
}

// checkReplicasLive starts every replica like compose and checks what the
// stack relies on: each registers in Consul under its -replica-id with
// its advertised addresses and a passing /readyz check, each lists both
// replicas, and a replica's own certificate, used as a client
// certificate, passes the other's TLS check on its picker port while a
// certificate from the same CA without an allowed SAN does not.
func checkReplicasLive(t *testing.T, p *types.Project, client *consulapi.Client, consulAddr string) {
	// The certificates `make compose-certs` would mount.
	certs := t.TempDir()
	devcerts(t, certs)
	var reps []liveReplica
	for _, sy := range replicaServices(t, p) {
		reps = append(reps, startReplicaLikeCompose(t, p, sy, consulAddr, certs))
	}

	testutil.Eventually(t, 30*time.Second, "every replica passing in Consul", func() error {
		entries, _, err := client.Health().Service(replicaConsulService, "", true, nil)
		if err != nil {
			return err
		}
		got := map[string]*consulapi.AgentService{}
		for _, e := range entries {
			got[e.Service.ID] = e.Service
		}
		for _, r := range reps {
			svc := got[r.name]
			if svc == nil {
				return fmt.Errorf("%s not passing (passing: %v)", r.name, sortedKeys(got))
			}
			if addr := net.JoinHostPort(svc.Address, strconv.Itoa(svc.Port)); addr != r.extproc || svc.Meta["admin"] != r.admin || svc.Meta["xds"] != r.xds {
				return fmt.Errorf("%s registered as %s meta %v, want %s admin %s xds %s", r.name, addr, svc.Meta, r.extproc, r.admin, r.xds)
			}
		}
		if len(got) != len(reps) {
			return fmt.Errorf("passing %v", sortedKeys(got))
		}
		return nil
	})
	testutil.Eventually(t, 20*time.Second, "every replica lists them all", func() error {
		for _, r := range reps {
			var st struct {
				ReplicaID string `json:"replica_id"`
				Replicas  []struct {
					ID   string `json:"id"`
					Self bool   `json:"self"`
				} `json:"replicas"`
			}
			if err := getJSON("http://"+r.admin+"/api/status", &st); err != nil {
				return err
			}
			var ids []string
			for _, x := range st.Replicas {
				ids = append(ids, x.ID)
				if x.Self != (x.ID == r.name) {
					return fmt.Errorf("%s marks %s self=%v", r.name, x.ID, x.Self)
				}
			}
			if st.ReplicaID != r.name || len(ids) != len(reps) {
				return fmt.Errorf("%s (replica_id %q) lists %v", r.name, st.ReplicaID, ids)
			}
		}
		return nil
	})

	// Replica to replica: each presents its own certificate to another's
	// picker port.
	ca, err := os.ReadFile(filepath.Join(certs, "ca", "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	for i, from := range reps {
		to := reps[(i+1)%len(reps)]
		cert, err := tls.LoadX509KeyPair(from.cert, from.key)
		if err != nil {
			t.Fatal(err)
		}
		if err := h2Handshake(to.extproc, cert, ca); err != nil {
			t.Errorf("%s's certificate refused by %s's picker: %v", from.name, to.name, err)
		}
	}
	caKey, err := os.ReadFile(filepath.Join(certs, "ca", "ca-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	issuer, err := certgen.LoadCA(ca, caKey)
	if err != nil {
		t.Fatal(err)
	}
	rogue, err := issuer.Issue(certgen.LeafOptions{CommonName: "rogue", SANs: []string{"rogue.internal"}, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := tls.X509KeyPair(rogue.CertPEM, rogue.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	if err := h2Handshake(reps[0].extproc, rc, ca); err == nil {
		t.Errorf("%s's picker admitted a certificate with no allowed SAN", reps[0].name)
	}
}

// h2Handshake connects to a gRPC server over TLS with cert, and returns
// nil once the server has answered the HTTP/2 preface with its SETTINGS
// frame: with TLS 1.3 a rejected client certificate surfaces only there.
func h2Handshake(addr string, cert tls.Certificate, caPEM []byte) error {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return errors.New("no CA certificate")
	}
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{
		Certificates: []tls.Certificate{cert}, RootCAs: roots, ServerName: replicaSAN, NextProtos: []string{"h2"}})
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return err
	}
	// Client preface and an empty SETTINGS frame.
	if _, err := conn.Write(append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), 0, 0, 0, 4, 0, 0, 0, 0, 0)); err != nil {
		return err
	}
	head := make([]byte, 9)
	if _, err := io.ReadFull(conn, head); err != nil {
		return err
	}
	if head[3] != 4 {
		return fmt.Errorf("first frame has type %d, want SETTINGS", head[3])
	}
	return nil
}

func getJSON(url string, v any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// startReplicaLikeCompose runs the switchyard binary with a replica
// service's command line, moved to loopback: listen addresses get free
// ports, each -*-advertise follows its -*-addr, -config names the
// directory compose mounts, -store a temporary file and the TLS flags
// the replica's directory of certs (made by devcerts). It then runs the
// service's health check (switchyard probe on /readyz, moved to the admin
// port) until it passes.
func startReplicaLikeCompose(t *testing.T, p *types.Project, sy types.ServiceConfig, consulAddr, certs string) liveReplica {
	flags := serveFlags(t, sy)
	bin := testutil.Binary(t, "switchyard")

	r := liveReplica{name: sy.Name, extproc: testutil.FreeAddr(t), xds: testutil.FreeAddr(t), admin: testutil.FreeAddr(t)}
	tlsDir := filepath.Join(certs, path.Base(bindSourceFor(t, sy, switchyardTLSTarget)))
	args := []string{"serve"}
	for _, name := range sortedKeys(flags) {
		v := flags[name]
		switch name {
		case "config":
			v = bindSourceFor(t, sy, v)
		case "store":
			v = filepath.Join(t.TempDir(), path.Base(v))
		case "extproc-addr", "extproc-advertise":
			v = r.extproc
		case "admin-addr", "admin-advertise":
			v = r.admin
		case "xds-addr", "xds-advertise":
			v = r.xds
		case "tls-cert", "tls-key", "tls-client-ca":
			v = filepath.Join(tlsDir, path.Base(v))
		}
		args = append(args, "-"+name+"="+v)
	}
	r.cert, r.key = filepath.Join(tlsDir, "cert.pem"), filepath.Join(tlsDir, "key.pem")
	// The child inherits the environment: the compose service's, with
	// Consul moved to the test's agent.
	for k, v := range sy.Environment {
		if v != nil {
			t.Setenv(k, *v)
		}
	}
	t.Setenv("CONSUL_HTTP_ADDR", consulAddr)
	proc := testutil.StartNoCleanup(t, sy.Name, bin, args...)
	t.Cleanup(func() {
		proc.Stop()
		if t.Failed() {
			t.Logf("%s %q output:\n%s", sy.Name, args, proc.Output())
		}
	})

	// The health check runs the image's own binary (no shell, no HTTP
	// client in a distroless image): the same binary here, on the admin
	// port this replica got.
	test := sy.HealthCheck.Test
	if len(test) < 3 || test[0] != "CMD" || path.Base(test[1]) != "switchyard" || test[2] != "probe" {
		t.Fatalf("%s healthcheck %q: want [CMD /usr/local/bin/switchyard probe URL]", sy.Name, test)
	}
	_, adminPort := hostPort(t, "-admin-addr", flags["admin-addr"])
	_, freePort := hostPort(t, "admin", r.admin)
	composeURL, testURL := "127.0.0.1:"+strconv.Itoa(adminPort), "127.0.0.1:"+strconv.Itoa(freePort)
	probe := make([]string, 0, len(test)-2)
	for _, a := range test[2:] {
		probe = append(probe, strings.Replace(a, composeURL, testURL, 1))
	}
	if !strings.Contains(strings.Join(probe, " "), testURL) {
		t.Fatalf("%s healthcheck %q does not probe the admin address %s", sy.Name, test, composeURL)
	}
	testutil.Eventually(t, 20*time.Second, sy.Name+" health check passes", func() error {
		if proc.Exited() {
			t.Fatalf("%s exited:\n%s", sy.Name, proc.Output())
		}
		out, err := exec.Command(bin, probe...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%q: %v: %s", probe, err, out)
		}
		return nil
	})
	return r
}
