package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry/hclfile"
)

const policyConfig = "listener \"l\" {\n  address = \"127.0.0.1:8080\"\n}\npool \"p\" {\n  endpoints = [\"127.0.0.1:8001\"]\n}\nmodel \"m\" {\n  pool = \"p\"\n}\n"

// TestServeRefusesPlaintextOffLoopback: ADS or ext_proc on a non-loopback
// address without TLS stops serve before it listens; -allow-plaintext lets
// it start with a warning.
func TestServeRefusesPlaintextOffLoopback(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	testutil.WriteFile(t, dir, "switchyard.hcl", policyConfig)
	code, _, stderr := runCLI(t, "serve", "-config", dir, "-xds-addr", "0.0.0.0:18000", "-admin-addr", testutil.FreeAddr(t))
	if code != 1 || !strings.Contains(stderr, "ADS (-xds-addr) listens on 0.0.0.0:18000, not a loopback address, without TLS") {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr)
	}

	// Allowed: built in-process (nothing listens), the warning is logged.
	cfg, diags := hclfile.Load(dir, sched.Rules)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	var logs bytes.Buffer
	f := serveFlags{config: dir, extprocAddr: "10.0.0.5:9002", xdsAddr: "127.0.0.1:18000", adminAddr: "0.0.0.0:9090"}
	f.tls.allowPlaintext = true
	a, err := newApp(f, cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	a.close()
	for _, want := range []string{"ext_proc (-extproc-addr) listens on 10.0.0.5:9002 in plaintext (-allow-plaintext)",
		"the admin server is not on loopback and has no -admin-token-file or -admin-tls"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs.String())
		}
	}
}

// TestServeAdminAuth runs serve with mutual TLS, the admin server over
// HTTPS and a bearer token: reading needs nothing, POST /api/reload needs
// the token or a client certificate of the CA.
func TestServeAdminAuth(t *testing.T) {
	t.Parallel()
	p := newE2EPKI(t)
	dir := t.TempDir()
	testutil.WriteFile(t, dir, "switchyard.hcl", policyConfig)
	token := testutil.WriteFile(t, t.TempDir(), "token", "let-me-in\n")
	admin := testutil.FreeAddr(t)
	args := append([]string{"serve", "-config", dir, "-extproc-addr", testutil.FreeAddr(t), "-xds-addr", testutil.FreeAddr(t),
		"-admin-addr", admin, "-admin-tls", "-admin-token-file", token}, p.args()...)
	proc := testutil.Start(t, "switchyard", testutil.Binary(t, "switchyard"), args...)

	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(p.ca.CertPEM)
	client := func(withCert bool) *http.Client {
		cfg := &tls.Config{RootCAs: roots, ServerName: "switchyard"}
		if withCert {
			kp, err := tls.LoadX509KeyPair(p.envoy.Cert, p.envoy.Key)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Certificates = []tls.Certificate{kp}
		}
		return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
	}
	base := "https://" + admin
	testutil.Eventually(t, 15*time.Second, "admin /readyz over HTTPS", func() error {
		if proc.Exited() {
			return fmt.Errorf("switchyard exited:\n%s", proc.Output())
		}
		resp, err := client(false).Get(base + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("/readyz %d", resp.StatusCode)
		}
		return nil
	})
	post := func(c *http.Client, auth string) int {
		req, _ := http.NewRequest(http.MethodPost, base+"/api/reload", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, c := range []struct {
		desc string
		cert bool
		auth string
		want int
	}{
		{"nothing", false, "", 401},
		{"wrong token", false, "Bearer guess", 401},
		{"token", false, "Bearer let-me-in", 202},
		{"client certificate", true, "", 202},
	} {
		if got := post(client(c.cert), c.auth); got != c.want {
			t.Errorf("%s: POST /api/reload = %d, want %d", c.desc, got, c.want)
		}
	}
	resp, err := client(false).Get(base + "/api/status")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /api/status without credentials: %d", resp.StatusCode)
	}
	// A certificate from another CA is refused at the handshake.
	other, err := certgen.NewCA("other", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	bad := p.envoyDir(other, certgen.LeafOptions{CommonName: "x", Client: true})
	kp, err := tls.LoadX509KeyPair(bad.Cert, bad.Key)
	if err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: "switchyard", Certificates: []tls.Certificate{kp}}}}
	if _, err := c.Get(base + "/api/status"); err == nil {
		t.Fatal("a foreign CA's client certificate was accepted")
	}
	if !strings.Contains(proc.Output(), "configuration reload requested over the admin API") {
		t.Fatalf("reload not logged:\n%s", proc.Output())
	}
}

// TestTLSFlagsMerge: the HCL tls block fills what flags left unset; a flag
// that is set wins.
func TestTLSFlagsMerge(t *testing.T) {
	f := tlsFlags{cert: "/flag/cert.pem", envoyDir: "/etc/envoy/switchyard-tls"}
	f.merge(&hclfile.TLS{CertFile: "/hcl/cert.pem", KeyFile: "/hcl/key.pem", ClientCAFile: "/hcl/ca.pem",
		AllowedSANs: []string{"a", "b"}, EnvoyDir: "/srv/tls", AdminTLS: true})
	want := tlsFlags{cert: "/flag/cert.pem", key: "/hcl/key.pem", clientCA: "/hcl/ca.pem", allowedSANs: "a,b",
		envoyDir: "/srv/tls", adminTLS: true}
	if f != want {
		t.Fatalf("merged %+v, want %+v", f, want)
	}
	if got := f.sans(); len(got) != 2 || got[1] != "b" {
		t.Fatalf("sans %q", got)
	}
}
