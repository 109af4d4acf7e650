package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
)

// e2ePKI is a CA, switchyard's certificate files and an Envoy certificate
// directory, all made with crypto/x509 for one test.
type e2ePKI struct {
	t      *testing.T
	ca     *certgen.CA
	syDir  string
	envoy  envoy.Layout
	allow  string // the SAN switchyard admits
	server *certgen.Leaf
}

func newE2EPKI(t *testing.T) *e2ePKI {
	t.Helper()
	ca, err := certgen.NewCA("e2e CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	p := &e2ePKI{t: t, ca: ca, syDir: t.TempDir(), allow: "envoy.e2e"}
	p.rotateServer()
	writeFile(t, filepath.Join(p.syDir, "ca.pem"), ca.CertPEM)
	p.envoy = p.envoyDir(ca, certgen.LeafOptions{CommonName: "envoy", SANs: []string{p.allow}, Client: true})
	return p
}

// rotateServer issues switchyard a new certificate and writes it (key
// first: switchyard keeps the old pair until both match).
func (p *e2ePKI) rotateServer() {
	p.t.Helper()
	l, err := p.ca.Issue(certgen.LeafOptions{CommonName: "switchyard", SANs: []string{"switchyard", "127.0.0.1"}, Server: true})
	if err != nil {
		p.t.Fatal(err)
	}
	writeFile(p.t, filepath.Join(p.syDir, "key.pem"), l.KeyPEM)
	writeFile(p.t, filepath.Join(p.syDir, "cert.pem"), l.CertPEM)
	p.server = l
}

// envoyDir writes a new Envoy certificate directory with a certificate of
// o signed by ca, trusting p's CA for switchyard (SAN "switchyard").
func (p *e2ePKI) envoyDir(ca *certgen.CA, o certgen.LeafOptions) envoy.Layout {
	p.t.Helper()
	l, err := ca.Issue(o)
	if err != nil {
		p.t.Fatal(err)
	}
	dir := envoy.TLSLayout(filepath.Join(p.t.TempDir(), "envoy-tls"))
	if err := dir.Write(l.CertPEM, l.KeyPEM, p.ca.CertPEM, []string{"switchyard"}); err != nil {
		p.t.Fatal(err)
	}
	return dir
}

func (p *e2ePKI) args() []string {
	return []string{"-tls-cert", filepath.Join(p.syDir, "cert.pem"), "-tls-key", filepath.Join(p.syDir, "key.pem"),
		"-tls-client-ca", filepath.Join(p.syDir, "ca.pem"), "-tls-allowed-san", p.allow, "-envoy-tls-dir", p.envoy.Dir}
}

func getJSON(url string, v any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %d", url, resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := envoy.WriteAtomic(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// tlsRejected reads switchyard's rejection counter for "server/reason".
func (f *fleet) tlsRejected(key string) (uint64, error) {
	var doc struct {
		TLS *struct {
			Rejected map[string]uint64 `json:"rejected"`
			Reloads  uint64            `json:"reloads"`
		} `json:"tls"`
	}
	if err := getJSON("http://"+f.admin+"/api/status", &doc); err != nil {
		return 0, err
	}
	if doc.TLS == nil {
		return 0, errors.New("no tls section in /api/status")
	}
	return doc.TLS.Rejected[key], nil
}

// startRogueEnvoy starts a second Envoy against the fleet's ADS server
// with bootstrap (rendered for its own node id and admin port) and returns
// its admin URL.
func (f *fleet) startRogueEnvoy(t *testing.T, name string, bootstrap func(envoy.Params) string) string {
	t.Helper()
	adminPort := testutil.FreePort(t)
	host, port, _ := net.SplitHostPort(f.xds)
	xdsPort, _ := strconv.Atoi(port)
	bs := bootstrap(envoy.Params{NodeID: "rogue-" + name, XDSHost: host, XDSPort: xdsPort, AdminPort: adminPort})
	path := testutil.WriteFile(t, t.TempDir(), "envoy.yaml", bs)
	testutil.Start(t, "envoy "+name, testutil.EnvoyPath(t), "-c", path, "--use-dynamic-base-id", "-l", "warning", "--concurrency", "1")
	return fmt.Sprintf("http://127.0.0.1:%d", adminPort)
}

// envoyStat reads one counter from an Envoy's admin /stats.
func envoyStat(admin, name string) (int, error) {
	out, err := httpGetString(admin + "/stats?filter=^" + regexp.QuoteMeta(name) + "$")
	if err != nil {
		return 0, err
	}
	_, v, ok := strings.Cut(strings.TrimSpace(out), ": ")
	if !ok {
		return 0, fmt.Errorf("no stat %s in %q", name, out)
	}
	return strconv.Atoi(v)
}

// TestE2EMTLS runs switchyard with mutual TLS and a real Envoy: the Envoy
// with the right certificate gets its configuration over ADS and its
// requests picked over ext_proc; Envoys with no certificate, one from
// another CA, one with an unlisted SAN or an expired one get nothing, and
// the same certificates are refused on the ext_proc port; every refusal
// is logged with the peer address and counted.
func TestE2EMTLS(t *testing.T) {
	t.Parallel()
	p := newE2EPKI(t)
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf(`
pool "main" {
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), fleetOptions{switchyardArgs: p.args(), envoyTLSDir: p.envoy.Dir})

	// Configured (newFleet waited for the ACK and the picker's health
	// check over TLS); now requests are picked.
	before := f.mustStatus()
	for range 4 {
		resp, err := f.send(infReq{model: "m-a", prompt: "hello", maxTokens: 2})
		checkOK(t, resp, err, "m-a")
	}
	testutil.Eventually(t, 5*time.Second, "picks counted", func() error {
		s, err := f.status()
		if err != nil {
			return err
		}
		var picked int64
		for k, c := range s.counts() {
			picked += c[0] - before.counts()[k][0]
		}
		if picked != 4 {
			return fmt.Errorf("picked %d of 4", picked)
		}
		return nil
	})

	other, err := certgen.NewCA("other CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	expired := certgen.Validity{NotBefore: time.Now().Add(-72 * time.Hour), NotAfter: time.Now().Add(-24 * time.Hour)}
	noCert := func(pr envoy.Params) string {
		// A TLS bootstrap without the client certificate.
		pr.TLSDir = p.envoy.Dir
		bs, err := envoy.Bootstrap(pr)
		if err != nil {
			t.Fatal(err)
		}
		start := strings.Index(bs, "          tls_certificate_sds_secret_configs:")
		end := strings.Index(bs, "          validation_context_sds_secret_config:")
		return bs[:start] + bs[end:]
	}
	cases := []struct {
		name      string
		reason    string
		log       string
		bootstrap func(envoy.Params) string
		cert      *envoy.Layout // for the ext_proc check; nil: none
	}{
		{name: "no-certificate", reason: "no_certificate", log: "didn't provide a certificate", bootstrap: noCert},
		{name: "other-ca", reason: "unknown_ca", log: "not signed by the configured client CA",
			cert: ptr(p.envoyDir(other, certgen.LeafOptions{CommonName: "envoy", SANs: []string{p.allow}, Client: true}))},
		{name: "unlisted-san", reason: "san_not_allowed", log: "has no allowed SAN",
			cert: ptr(p.envoyDir(p.ca, certgen.LeafOptions{CommonName: "envoy", SANs: []string{"intruder.e2e"}, Client: true}))},
		{name: "expired", reason: "expired", log: "expired at",
			cert: ptr(p.envoyDir(p.ca, certgen.LeafOptions{CommonName: "old-envoy", SANs: []string{p.allow}, Client: true, Validity: expired}))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bootstrap := c.bootstrap
			if bootstrap == nil {
				bootstrap = func(pr envoy.Params) string {
					pr.TLSDir = c.cert.Dir
					bs, err := envoy.Bootstrap(pr)
					if err != nil {
						t.Fatal(err)
					}
					return bs
				}
			}
			key := "xds/" + c.reason
			n0, err := f.tlsRejected(key)
			if err != nil {
				t.Fatal(err)
			}
			admin := f.startRogueEnvoy(t, c.name, bootstrap)
			// ADS refused: wait for two refusals (Envoy retried), then it
			// must not have any configuration and not be a known node.
			testutil.Eventually(t, 30*time.Second, "ADS refusals counted", func() error {
				n, err := f.tlsRejected(key)
				if err != nil {
					return err
				}
				if n < n0+2 {
					return fmt.Errorf("%s: %d refusals, want %d", key, n-n0, 2)
				}
				return nil
			})
			if n, err := envoyStat(admin, "cluster_manager.cds.update_success"); err != nil || n != 0 {
				t.Fatalf("refused Envoy has CDS updates: %d, %v", n, err)
			}
			if n, err := envoyStat(admin, "listener_manager.lds.update_success"); err != nil || n != 0 {
				t.Fatalf("refused Envoy has LDS updates: %d, %v", n, err)
			}
			for _, n := range f.mustStatus().Envoys {
				if n.ID == "rogue-"+c.name {
					t.Fatalf("refused Envoy is a connected node: %+v", n)
				}
			}
			// ext_proc refused with the same credentials.
			ekey := "extproc/" + c.reason
			e0, _ := f.tlsRejected(ekey)
			if err := grpcHealth(f.extproc, p.ca, c.cert); err == nil {
				t.Fatal("ext_proc answered")
			}
			testutil.Eventually(t, 5*time.Second, "ext_proc refusal counted", func() error {
				if n, err := f.tlsRejected(ekey); err != nil || n <= e0 {
					return fmt.Errorf("%s: %d refusals (%v)", ekey, n-e0, err)
				}
				return nil
			})
			out := f.sy.Output()
			if !strings.Contains(out, "rejected TLS connection") || !strings.Contains(out, c.log) ||
				!regexp.MustCompile(`server=xds peer=127\.0\.0\.1:\d+ reason=`+c.reason).MatchString(out) {
				t.Fatalf("switchyard log lacks the refusal (%q):\n%s", c.log, tail(out, 3000))
			}
		})
	}

	// The refusals are in /metrics too.
	metrics, err := httpGetString("http://" + f.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`switchyard_tls_rejected_connections_total{reason="expired",server="xds"}`,
		`switchyard_tls_rejected_connections_total{reason="unknown_ca",server="extproc"}`, "switchyard_tls_certificate_expiry_timestamp_seconds"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// grpcHealth runs one gRPC health check on addr with the client
// certificate of dir (nil: none), trusting ca.
func grpcHealth(addr string, ca *certgen.CA, dir *envoy.Layout) error {
	cfg := &tls.Config{RootCAs: x509.NewCertPool(), ServerName: "switchyard"}
	cfg.RootCAs.AppendCertsFromPEM(ca.CertPEM)
	if dir != nil {
		kp, err := tls.LoadX509KeyPair(dir.Cert, dir.Key)
		if err != nil {
			return err
		}
		cfg.Certificates = []tls.Certificate{kp}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// TestE2EMTLSRotation rotates switchyard's certificate and the Envoy's
// client certificate on disk while requests flow through Envoy, and
// checks that no request failed, that both sides took the new
// certificates without a restart, and that new connections use them.
func TestE2EMTLSRotation(t *testing.T) {
	t.Parallel()
	p := newE2EPKI(t)
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf(`
pool "main" {
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), fleetOptions{switchyardArgs: p.args(), envoyTLSDir: p.envoy.Dir})

	ctx, cancel := context.WithCancel(context.Background())
	var (
		wg       sync.WaitGroup
		ok, fail atomic.Int64
		mu       sync.Mutex
		failures []string
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				resp, err := f.send(infReq{model: "m-a", prompt: "rotate", maxTokens: 2})
				if err == nil && resp.status == 200 {
					ok.Add(1)
					continue
				}
				fail.Add(1)
				mu.Lock()
				if err != nil {
					failures = append(failures, err.Error())
				} else {
					failures = append(failures, fmt.Sprintf("status %d: %s", resp.status, truncate(string(resp.body), 200)))
				}
				mu.Unlock()
			}
		}()
	}
	waitOK := func(n int64) {
		t.Helper()
		target := ok.Load() + n
		testutil.Eventually(t, 30*time.Second, "requests flowing", func() error {
			if ok.Load() < target {
				return fmt.Errorf("%d ok, want %d", ok.Load(), target)
			}
			return nil
		})
	}
	waitOK(50)

	// switchyard's certificate: rewritten on disk, reloaded within a
	// second; new handshakes get it (checked from outside with a client
	// certificate the CA signed).
	oldSerial := p.server.Cert.SerialNumber
	p.rotateServer()
	testutil.Eventually(t, 10*time.Second, "switchyard serves the new certificate", func() error {
		got, err := servedSerial(f.extproc, p.ca, &p.envoy)
		if err != nil {
			return err
		}
		if got.Cmp(p.server.Cert.SerialNumber) != 0 {
			return fmt.Errorf("serving serial %x, want %x (old %x)", got, p.server.Cert.SerialNumber, oldSerial)
		}
		return nil
	})
	waitOK(50)

	// The Envoy's client certificate: new key and certificate moved into
	// its directory; Envoy's /certs lists the new one.
	next, err := p.ca.Issue(certgen.LeafOptions{CommonName: "envoy-2", SANs: []string{p.allow}, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, p.envoy.Key, next.KeyPEM)
	writeFile(t, p.envoy.Cert, next.CertPEM)
	wantSerial := fmt.Sprintf("%x", next.Cert.SerialNumber)
	testutil.Eventually(t, 15*time.Second, "Envoy loaded its new certificate", func() error {
		out, err := httpGetString(f.envoyAdm + "/certs")
		if err != nil {
			return err
		}
		if !strings.Contains(strings.ToLower(out), wantSerial) {
			return fmt.Errorf("Envoy /certs lacks serial %s", wantSerial)
		}
		return nil
	})
	waitOK(50)
	cancel()
	wg.Wait()
	t.Logf("%d requests during the rotations, %d failed", ok.Load(), fail.Load())
	if fail.Load() > 0 {
		t.Fatalf("%d requests failed during rotation; first: %v", fail.Load(), failures[:min(5, len(failures))])
	}
	// New handshakes on both connections with only the rotated files: a
	// fresh Envoy from the same directory gets its clusters over ADS and
	// finds the picker healthy (its gRPC health checks run over mTLS).
	// Its listener cannot bind the port the first Envoy holds; that NACK
	// does not matter here.
	fresh := f.startRogueEnvoy(t, "after-rotation", func(pr envoy.Params) string {
		pr.TLSDir = p.envoy.Dir
		bs, err := envoy.Bootstrap(pr)
		if err != nil {
			t.Fatal(err)
		}
		return bs
	})
	testutil.Eventually(t, 30*time.Second, "a fresh Envoy uses the rotated certificates", func() error {
		st, err := f.status()
		if err != nil {
			return err
		}
		acked := false
		for _, n := range st.Envoys {
			if n.ID == "rogue-after-rotation" && n.Streams > 0 && n.Acked["Cluster"] == st.XDS.Versions["Cluster"] {
				acked = true
			}
		}
		if !acked {
			return errors.New("fresh Envoy has not ACKed the clusters")
		}
		out, err := httpGetString(fresh + "/clusters")
		if err != nil {
			return err
		}
		if !strings.Contains(out, "switchyard/picker::"+f.extproc+"::health_flags::healthy") {
			return errors.New("picker not healthy in the fresh Envoy")
		}
		return nil
	})
	if n := strings.Count(f.sy.Output(), `msg="TLS certificate in use"`); n < 2 {
		t.Fatalf("switchyard logged %d certificate loads, want the first and the rotation:\n%s", n, tail(f.sy.Output(), 3000))
	}
}

// servedSerial connects to addr with the client certificate of dir and
// returns the serial number of the certificate the server presented.
func servedSerial(addr string, ca *certgen.CA, dir *envoy.Layout) (*big.Int, error) {
	kp, err := tls.LoadX509KeyPair(dir.Cert, dir.Key)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{RootCAs: x509.NewCertPool(), ServerName: "switchyard", Certificates: []tls.Certificate{kp}, NextProtos: []string{"h2"}}
	cfg.RootCAs.AppendCertsFromPEM(ca.CertPEM)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber, nil
}

// TestE2EMTLSEnvoyChecksSwitchyard: an Envoy that expects another SAN on
// switchyard's certificate refuses it (fail_verify_san) and gets no
// configuration; mutual TLS authenticates the control plane too.
func TestE2EMTLSEnvoyChecksSwitchyard(t *testing.T) {
	t.Parallel()
	p := newE2EPKI(t)
	s1 := startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf("pool \"main\" {\n  endpoints = [%q]\n}\nmodel \"m-a\" {\n  pool = \"main\"\n}\n", s1.Addr),
		fleetOptions{switchyardArgs: p.args(), envoyTLSDir: p.envoy.Dir})
	l, err := p.ca.Issue(certgen.LeafOptions{CommonName: "envoy", SANs: []string{p.allow}, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	dir := envoy.TLSLayout(filepath.Join(t.TempDir(), "tls"))
	if err := dir.Write(l.CertPEM, l.KeyPEM, p.ca.CertPEM, []string{"impostor-check.e2e"}); err != nil {
		t.Fatal(err)
	}
	admin := f.startRogueEnvoy(t, "expects-other-san", func(pr envoy.Params) string {
		pr.TLSDir = dir.Dir
		bs, err := envoy.Bootstrap(pr)
		if err != nil {
			t.Fatal(err)
		}
		return bs
	})
	testutil.Eventually(t, 30*time.Second, "Envoy refuses switchyard's certificate", func() error {
		n, err := envoyStat(admin, "cluster.switchyard_xds.ssl.fail_verify_san")
		if err != nil {
			return err
		}
		if n < 1 {
			return errors.New("no SAN verification failure yet")
		}
		return nil
	})
	if n, err := envoyStat(admin, "cluster_manager.cds.update_success"); err != nil || n != 0 {
		t.Fatalf("Envoy took configuration from a server it did not accept: %d, %v", n, err)
	}
}

// TestE2EMTLSConsulConnect runs switchyard with its certificate and client
// CA from a real Consul dev agent's Connect CA (-tls-consul-service), and
// an Envoy whose certificate directory holds a Connect leaf of its own
// service: the Envoy gets configuration and picks, identified by its
// SPIFFE ID.
func TestE2EMTLSConsulConnect(t *testing.T) {
	t.Parallel()
	c := testutil.StartConsul(t)
	client, err := api.NewClient(&api.Config{Address: c.Addr})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	agent := client.Agent()
	envoyLeaf, _, err := agent.ConnectCALeaf("envoy-edge", (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	syLeaf, _, err := agent.ConnectCALeaf("switchyard", (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	roots, _, err := agent.ConnectCARoots((&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	var bundle strings.Builder
	for _, r := range roots.Roots {
		bundle.WriteString(r.RootCertPEM + "\n")
	}
	dir := envoy.TLSLayout(filepath.Join(t.TempDir(), "tls"))
	if err := dir.Write([]byte(envoyLeaf.CertPEM), []byte(envoyLeaf.PrivateKeyPEM), []byte(bundle.String()), []string{syLeaf.ServiceURI}); err != nil {
		t.Fatal(err)
	}
	s1 := startSim(t, simOptions{})
	f := newFleet(t, fmt.Sprintf("pool \"main\" {\n  endpoints = [%q]\n}\nmodel \"m-a\" {\n  pool = \"main\"\n}\n", s1.Addr), fleetOptions{
		switchyardArgs: []string{"-tls-consul-service", "switchyard", "-tls-allowed-san", envoyLeaf.ServiceURI, "-envoy-tls-dir", dir.Dir},
		switchyardEnv:  []string{"CONSUL_HTTP_ADDR=" + c.Addr},
		envoyTLSDir:    dir.Dir,
	})
	for range 3 {
		resp, err := f.send(infReq{model: "m-a", prompt: "hello", maxTokens: 2})
		checkOK(t, resp, err, "m-a")
	}
	var doc struct {
		TLS struct {
			Origin  string `json:"origin"`
			Subject string `json:"subject"`
		} `json:"tls"`
	}
	if err := getJSON("http://"+f.admin+"/api/status", &doc); err != nil {
		t.Fatal(err)
	}
	if doc.TLS.Origin != "consul" {
		t.Fatalf("serving certificate from %q, want consul", doc.TLS.Origin)
	}
}
