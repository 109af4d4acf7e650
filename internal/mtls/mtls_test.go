package mtls

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
)

// pki is a CA with a server certificate written to files, and a client
// certificate from the same CA.
type pki struct {
	ca     *certgen.CA
	files  Files
	client *certgen.Leaf
}

func newPKI(t *testing.T, dir string) *pki {
	t.Helper()
	ca, err := certgen.NewCA("test CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Issue(certgen.LeafOptions{CommonName: "switchyard", SANs: []string{"switchyard", "127.0.0.1"}, Server: true})
	if err != nil {
		t.Fatal(err)
	}
	cl := issue(t, ca, "envoy-1", certgen.Validity{}, "envoy-1.edge", "spiffe://test/envoy")
	p := &pki{ca: ca, client: cl, files: Files{Cert: filepath.Join(dir, "cert.pem"), Key: filepath.Join(dir, "key.pem"), ClientCA: filepath.Join(dir, "ca.pem")}}
	writeAtomic(t, p.files.Cert, srv.CertPEM)
	writeAtomic(t, p.files.Key, srv.KeyPEM)
	writeAtomic(t, p.files.ClientCA, ca.CertPEM)
	return p
}

func issue(t *testing.T, ca *certgen.CA, cn string, v certgen.Validity, sans ...string) *certgen.Leaf {
	t.Helper()
	l, err := ca.Issue(certgen.LeafOptions{CommonName: cn, SANs: sans, Client: true, Validity: v})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func writeAtomic(t *testing.T, path string, b []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// serve starts a gRPC health server with s's credentials on loopback.
func serve(t *testing.T, s *Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(s.GRPCCredentials("extproc")))
	healthpb.RegisterHealthServer(g, health.NewServer())
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return lis.Addr().String()
}

// check runs one health check with the given client certificate (nil:
// none) trusting rootCA.
func check(addr string, rootCA *certgen.CA, cert *certgen.Leaf) error {
	cfg := &tls.Config{RootCAs: x509.NewCertPool(), ServerName: "switchyard"}
	cfg.RootCAs.AppendCertsFromPEM(rootCA.CertPEM)
	if cert != nil {
		kp, err := tls.X509KeyPair(cert.CertPEM, cert.KeyPEM)
		if err != nil {
			return err
		}
		cfg.Certificates = []tls.Certificate{kp}
	}
	return checkWith(addr, credentials.NewTLS(cfg))
}

func checkWith(addr string, creds credentials.TransportCredentials) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false))
	return err
}

func newTestServer(t *testing.T, p *pki, logs *syncBuf, allowed ...string) *Server {
	t.Helper()
	s := NewServer(Options{AllowedSANs: allowed, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err := s.LoadFiles(p.files); err != nil {
		t.Fatal(err)
	}
	return s
}

// waitRejected waits for the counter of (server, reason) to reach n: the
// server records a rejection after the client has seen it fail.
func waitRejected(t *testing.T, s *Server, reason string, n uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Rejected[RejectKey{"extproc", reason}] < n {
		if time.Now().After(deadline) {
			t.Fatalf("rejections %v, want %d of %s", s.Stats().Rejected, n, reason)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestWhoMayConnect(t *testing.T) {
	p := newPKI(t, t.TempDir())
	other, err := certgen.NewCA("other CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuf
	s := newTestServer(t, p, &logs, "spiffe://test/envoy", "envoy-2.edge")
	addr := serve(t, s)

	if err := check(addr, p.ca, p.client); err != nil {
		t.Fatalf("client with the right certificate: %v", err)
	}
	if err := check(addr, p.ca, issue(t, p.ca, "envoy-2", certgen.Validity{}, "envoy-2.edge")); err != nil {
		t.Fatalf("client with another allowed SAN: %v", err)
	}
	cases := []struct {
		desc   string
		cert   *certgen.Leaf
		reason string
		log    string
	}{
		{"no certificate", nil, ReasonNoCertificate, "didn't provide a certificate"},
		{"another CA", issue(t, other, "envoy-x", certgen.Validity{}, "spiffe://test/envoy"), ReasonUnknownCA, "not signed by the configured client CA"},
		{"unlisted SAN", issue(t, p.ca, "intruder", certgen.Validity{}, "intruder.edge"), ReasonSANNotAllowed, "has no allowed SAN"},
		{"expired", issue(t, p.ca, "old-envoy", certgen.Validity{NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour)}, "spiffe://test/envoy"),
			ReasonExpired, `O=switchyard\" [spiffe://test/envoy] expired at`},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			if err := check(addr, p.ca, c.cert); err == nil {
				t.Fatal("health check succeeded")
			}
			waitRejected(t, s, c.reason, 1)
			// The line is written just after the count, outside the lock.
			testutil.Eventually(t, 5*time.Second, "the rejection is logged", func() error {
				if !strings.Contains(logs.String(), c.log) {
					return fmt.Errorf("log lacks %q:\n%s", c.log, logs.String())
				}
				return nil
			})
		})
	}
	if !strings.Contains(logs.String(), "msg=\"rejected TLS connection\" server=extproc peer=127.0.0.1:") {
		t.Fatalf("rejections not logged with the peer address:\n%s", logs.String())
	}
	if err := checkWith(addr, insecure.NewCredentials()); err == nil {
		t.Fatal("plaintext client got an answer")
	}
	waitRejected(t, s, ReasonNotTLS, 1)
}

func TestRejectionLogsAreRateLimited(t *testing.T) {
	var logs syncBuf
	now := time.Unix(1_800_000_000, 0)
	s := NewServer(Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return now }})
	peer := &net.TCPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 4000}
	err := &RejectError{ReasonUnknownCA, "not signed"}
	for range 5 {
		s.Rejected("xds", peer, err)
	}
	now = now.Add(11 * time.Second)
	s.Rejected("xds", peer, err)
	if got := s.Stats().Rejected[RejectKey{"xds", ReasonUnknownCA}]; got != 6 {
		t.Fatalf("counted %d rejections, want 6", got)
	}
	if n := strings.Count(logs.String(), "rejected TLS connection"); n != 2 {
		t.Fatalf("%d log lines, want 2:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "not_logged_since_last=4") {
		t.Fatalf("second line does not count the suppressed ones:\n%s", logs.String())
	}
}

// TestRotation replaces the server certificate and the client CA on disk
// and checks new handshakes use them, a half-done rotation (new cert, old
// key) leaves the old material in force, and open connections survive.
func TestRotation(t *testing.T) {
	p := newPKI(t, t.TempDir())
	var logs syncBuf
	s := newTestServer(t, p, &logs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.WatchFiles(ctx, p.files, 10*time.Millisecond) }()
	addr := serve(t, s)

	// An open connection from before the rotation.
	kp, _ := tls.X509KeyPair(p.client.CertPEM, p.client.KeyPEM)
	oldCfg := &tls.Config{RootCAs: x509.NewCertPool(), ServerName: "switchyard", Certificates: []tls.Certificate{kp}}
	oldCfg.RootCAs.AppendCertsFromPEM(p.ca.CertPEM)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(oldCfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	if _, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}

	next, err := certgen.NewCA("next CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := next.Issue(certgen.LeafOptions{CommonName: "switchyard-2", SANs: []string{"switchyard"}, Server: true})
	if err != nil {
		t.Fatal(err)
	}
	// Half a rotation: the new certificate next to the old key.
	writeAtomic(t, p.files.Cert, srv.CertPEM)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "do not load") {
		if time.Now().After(deadline) {
			t.Fatalf("mismatched pair not reported:\n%s", logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := s.Current().Leaf().Subject.CommonName; got != "switchyard" {
		t.Fatalf("serving %q after a half rotation", got)
	}
	if err := check(addr, p.ca, p.client); err != nil {
		t.Fatalf("old material not in force during a half rotation: %v", err)
	}
	writeAtomic(t, p.files.Key, srv.KeyPEM)
	writeAtomic(t, p.files.ClientCA, next.CertPEM)
	newClient := issue(t, next, "envoy-new", certgen.Validity{}, "envoy-1.edge")
	deadline = time.Now().Add(5 * time.Second)
	for check(addr, next, newClient) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("rotated material not in use: %v\n%s", check(addr, next, newClient), logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if s.Stats().Reloads == 0 {
		t.Fatal("no reload counted")
	}
	if err := check(addr, p.ca, p.client); err == nil {
		t.Fatal("a client of the retired CA still connects")
	}
	if _, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("connection opened before the rotation broke: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestLoadFilesErrors(t *testing.T) {
	p := newPKI(t, t.TempDir())
	s := NewServer(Options{})
	bad := p.files
	bad.Key = p.files.ClientCA // a certificate where the key should be
	if err := s.LoadFiles(bad); err == nil || !strings.Contains(err.Error(), "certificate and key") {
		t.Fatalf("mismatched key: %v", err)
	}
	missing := p.files
	missing.ClientCA = filepath.Join(t.TempDir(), "nope.pem")
	if err := s.LoadFiles(missing); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing CA: %v", err)
	}
	if err := (Files{Cert: "a"}).Validate(); err == nil {
		t.Fatal("a certificate without key and CA accepted")
	}
	if s.Current() != nil {
		t.Fatal("failed loads set material")
	}
}

func TestCheckPlaintext(t *testing.T) {
	for _, c := range []struct {
		addr    string
		allow   bool
		wantErr bool
		warn    bool
	}{
		{"127.0.0.1:9002", false, false, false},
		{"127.5.0.1:9002", false, false, false},
		{"[::1]:9002", false, false, false},
		{"localhost:9002", false, false, false},
		{"0.0.0.0:9002", false, true, false},
		{":9002", false, true, false},
		{"10.0.0.5:18000", false, true, false},
		{"10.0.0.5:18000", true, false, true},
		{"[::]:18000", true, false, true},
	} {
		warn, err := CheckPlaintext("xds", c.addr, c.allow)
		if (err != nil) != c.wantErr || (warn != "") != c.warn {
			t.Errorf("CheckPlaintext(%q, %v) = %q, %v", c.addr, c.allow, warn, err)
		}
	}
}

// TestReplicaClientConfig: a replica dials another with its own
// certificate as client certificate (server and client usage), and
// accepts the peer only if its certificate chains to the CA and names the
// address dialled.
func TestReplicaClientConfig(t *testing.T) {
	p := newPKI(t, t.TempDir())
	both, err := p.ca.Issue(certgen.LeafOptions{CommonName: "switchyard", SANs: []string{"switchyard", "127.0.0.1"}, Server: true, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	writeAtomic(t, p.files.Cert, both.CertPEM)
	writeAtomic(t, p.files.Key, both.KeyPEM)
	var logs syncBuf
	a := newTestServer(t, p, &logs, "switchyard")
	b := newTestServer(t, p, &logs, "switchyard")
	addr := serve(t, a)
	if err := checkWith(addr, credentials.NewTLS(b.ClientConfig("127.0.0.1"))); err != nil {
		t.Fatalf("replica to replica: %v", err)
	}
	// The peer must be valid for the host dialled.
	if err := checkWith(addr, credentials.NewTLS(b.ClientConfig("10.9.9.9"))); err == nil {
		t.Fatal("a peer certificate without the dialled address was accepted")
	}
	// A replica whose CA differs does not trust the peer.
	other := newPKI(t, t.TempDir())
	c := newTestServer(t, other, &logs, "switchyard")
	if err := checkWith(addr, credentials.NewTLS(c.ClientConfig("127.0.0.1"))); err == nil {
		t.Fatal("a peer from another CA was accepted")
	}
}
