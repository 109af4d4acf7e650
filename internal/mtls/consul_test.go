package mtls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc/credentials"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
)

// TestConsulConnect takes switchyard's certificate and client CA from a
// real Consul dev agent (Connect's built-in CA), then connects with a leaf
// the same agent issued for an Envoy service: allowed by its SPIFFE ID;
// a leaf of another service, and a certificate of a foreign CA, are not.
func TestConsulConnect(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Consul agent")
	}
	c := testutil.StartConsul(t)
	client, err := api.NewClient(&api.Config{Address: c.Addr})
	if err != nil {
		t.Fatal(err)
	}
	agent := client.Agent()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	envoyLeaf, _, err := agent.ConnectCALeaf("envoy-edge", (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	otherLeaf, _, err := agent.ConnectCALeaf("web", (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	envoyID := envoyLeaf.ServiceURI
	if !strings.HasPrefix(envoyID, "spiffe://") || !strings.HasSuffix(envoyID, "/svc/envoy-edge") {
		t.Fatalf("unexpected Envoy leaf URI %q", envoyID)
	}

	var logs syncBuf
	s := NewServer(Options{AllowedSANs: []string{envoyID}, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err := s.LoadConsul(ctx, agent, "switchyard"); err != nil {
		t.Fatal(err)
	}
	if s.Current().Origin != "consul" || !strings.HasSuffix(SANs(s.Current().Leaf())[len(SANs(s.Current().Leaf()))-1], "/svc/switchyard") {
		t.Fatalf("serving %v from %s", SANs(s.Current().Leaf()), s.Current().Origin)
	}
	wctx, wcancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.WatchConsul(wctx, agent, "switchyard") }()
	defer func() { wcancel(); <-done }()
	addr := serve(t, s)

	roots, _, err := agent.ConnectCARoots(nil)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	for _, r := range roots.Roots {
		pool.AppendCertsFromPEM([]byte(r.RootCertPEM))
	}
	dial := func(l *api.LeafCert) error {
		kp, err := tls.X509KeyPair([]byte(l.CertPEM), []byte(l.PrivateKeyPEM))
		if err != nil {
			return err
		}
		// Connect leaves carry only the SPIFFE URI, no DNS name: verify
		// the chain and that URI, as Envoy's SAN matcher does.
		cfg := &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{kp}, InsecureSkipVerify: true,
			VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
				leaf, err := x509.ParseCertificate(raw[0])
				if err != nil {
					return err
				}
				if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool}); err != nil {
					return err
				}
				if len(leaf.URIs) == 0 || !strings.HasSuffix(leaf.URIs[0].String(), "/svc/switchyard") {
					t.Errorf("picker certificate URIs %v", leaf.URIs)
				}
				return nil
			}}
		return checkWith(addr, credentials.NewTLS(cfg))
	}
	if err := dial(envoyLeaf); err != nil {
		t.Fatalf("Envoy's Connect leaf refused: %v\n%s", err, logs.String())
	}
	if err := dial(otherLeaf); err == nil {
		t.Fatal("a leaf of another service was accepted")
	}
	waitRejected(t, s, ReasonSANNotAllowed, 1)
	foreign, err := certgen.NewCA("foreign", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	fl := issue(t, foreign, "envoy", certgen.Validity{}, envoyID)
	if err := dial(&api.LeafCert{CertPEM: string(fl.CertPEM), PrivateKeyPEM: string(fl.KeyPEM)}); err == nil {
		t.Fatal("a foreign CA's certificate with the right SPIFFE ID was accepted")
	}
	waitRejected(t, s, ReasonUnknownCA, 1)
}
