package deploy

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/switchyard/switchyard/internal/testutil"
)

// generatedTLS reports whether rel (a path relative to the repository)
// lies in the certificates `make compose-certs` writes.
func generatedTLS(rel string) bool {
	return strings.HasPrefix(filepath.ToSlash(rel), composeTLSDir+"/")
}

// devcerts runs cmd/devcerts with -out out and more args.
func devcerts(t *testing.T, out string, args ...string) {
	t.Helper()
	cmd := exec.Command(testutil.Binary(t, "devcerts"), append([]string{"-out", out}, args...)...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("devcerts: %v\n%s", err, b)
	}
}

func readCert(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s: no PEM", file)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestComposeMTLS checks that the stack runs ADS and ext_proc over mutual
// TLS with what `make compose-certs` generates: each replica's TLS flags
// name files in its own mounted certificate directory, Envoy mounts its
// directory where the replicas' picker cluster and the bootstrap expect
// it, the certificates carry the names each side checks (Envoy accepts
// every replica; every replica admits Envoy and, for replica-to-replica
// connections to its picker port, the other replicas' own certificates),
// and the generated files stay out of git.
func TestComposeMTLS(t *testing.T) {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	replicas := replicaServices(t, p)
	out := t.TempDir()
	devcerts(t, out)
	certDir := func(sy types.ServiceConfig) string {
		return filepath.Join(out, path.Base(bindSourceFor(t, sy, switchyardTLSTarget)))
	}

	// What Envoy accepts on a replica's certificate (ca-sds.yaml).
	sds, err := os.ReadFile(filepath.Join(out, "envoy", "ca-sds.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var accepted []string
	for _, m := range regexp.MustCompile(`matcher: \{exact: "([^"]+)"\}`).FindAllStringSubmatch(string(sds), -1) {
		accepted = append(accepted, m[1])
	}
	if !slices.Contains(accepted, replicaSAN) {
		t.Errorf("Envoy accepts %v on switchyard's certificate, want the shared replica SAN %q", accepted, replicaSAN)
	}
	envoyCert := readCert(t, filepath.Join(out, "envoy", "cert.pem"))

	for _, sy := range replicas {
		t.Run(sy.Name, func(t *testing.T) {
			flags := serveFlags(t, sy)
			for flag, file := range map[string]string{"tls-cert": "cert.pem", "tls-key": "key.pem", "tls-client-ca": "ca.pem"} {
				if want := path.Join(switchyardTLSTarget, file); flags[flag] != want {
					t.Errorf("-%s = %q, want %q", flag, flags[flag], want)
				}
			}
			if rel, _ := filepath.Rel(root, bindSourceFor(t, sy, switchyardTLSTarget)); filepath.ToSlash(rel) != composeTLSDir+"/"+sy.Name {
				t.Errorf("mounts %s at %s, want %s/%s (its own certificate)", rel, switchyardTLSTarget, composeTLSDir, sy.Name)
			}
			if flags["envoy-tls-dir"] != envoyTLSTarget {
				t.Errorf("-envoy-tls-dir = %q, want %q", flags["envoy-tls-dir"], envoyTLSTarget)
			}
			if _, ok := flags["allow-plaintext"]; ok {
				t.Error("the stack must not allow plaintext")
			}
			allowed := strings.Split(flags["tls-allowed-san"], ",")
			if !slices.Equal(sorted(allowed), sorted([]string{envoySAN, replicaSAN})) {
				t.Errorf("-tls-allowed-san = %q, want Envoy's SAN %s and the replicas' shared SAN %s", flags["tls-allowed-san"], envoySAN, replicaSAN)
			}

			c := readCert(t, filepath.Join(certDir(sy), "cert.pem"))
			sans := certSANs(c)
			ip := staticIP(t, sy, stackNetwork).String()
			for _, want := range []string{replicaSAN, sy.Name, ip} {
				if !slices.Contains(sans, want) {
					t.Errorf("certificate SANs %v lack %s", sans, want)
				}
			}
			if !slices.ContainsFunc(accepted, func(a string) bool { return slices.Contains(sans, a) }) {
				t.Errorf("Envoy accepts %v, none of the certificate's SANs %v", accepted, sans)
			}

			// This replica's client check (chain to its CA with client
			// usage, one allowed SAN) admits Envoy and every other
			// replica's certificate; TestComposeRegistrationsLive makes
			// the same connections against running replicas.
			roots := x509.NewCertPool()
			roots.AddCert(readCert(t, filepath.Join(certDir(sy), "ca.pem")))
			admits := func(c *x509.Certificate) error {
				if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
					return err
				}
				if !slices.ContainsFunc(certSANs(c), func(n string) bool { return slices.Contains(allowed, n) }) {
					return fmt.Errorf("no SAN of %v in %v", certSANs(c), allowed)
				}
				return nil
			}
			if err := admits(envoyCert); err != nil {
				t.Errorf("Envoy's certificate rejected: %v", err)
			}
			for _, other := range replicas {
				if other.Name == sy.Name {
					continue
				}
				if err := admits(readCert(t, filepath.Join(certDir(other), "cert.pem"))); err != nil {
					t.Errorf("%s's certificate, used as a client certificate, rejected: %v", other.Name, err)
				}
			}
		})
	}
	env := service(t, p, svcEnvoy)
	if rel, _ := filepath.Rel(root, bindSourceFor(t, env, envoyTLSTarget)); filepath.ToSlash(rel) != composeTLSDir+"/envoy" {
		t.Errorf("envoy mounts %s at %s, want %s/envoy", rel, envoyTLSTarget, composeTLSDir)
	}
	if !slices.Contains(envoyCert.DNSNames, envoySAN) {
		t.Errorf("Envoy certificate SANs %v lack %q", envoyCert.DNSNames, envoySAN)
	}
	certSDS, err := os.ReadFile(filepath.Join(out, "envoy", "cert-sds.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(certSDS), path.Join(envoyTLSTarget, "cert.pem")) {
		t.Errorf("cert-sds.yaml does not name the container path %s:\n%s", envoyTLSTarget, certSDS)
	}
	// Re-running reuses the CA: it is a rotation, not a new trust root.
	first := filepath.Join(certDir(replicas[0]), "cert.pem")
	before := readCert(t, first)
	ca := readCert(t, filepath.Join(out, "ca", "ca.pem"))
	devcerts(t, out)
	if again := readCert(t, filepath.Join(out, "ca", "ca.pem")); !again.Equal(ca) {
		t.Error("a second run replaced the CA")
	}
	if next := readCert(t, first); next.SerialNumber.Cmp(before.SerialNumber) == 0 {
		t.Error("a second run did not issue a new certificate")
	}

	gi, err := os.ReadFile(filepath.Join(root, ".gitignore"))
	if err != nil || !strings.Contains(string(gi), "/"+composeTLSDir+"/") {
		t.Errorf(".gitignore must list /%s/ (private keys): %v", composeTLSDir, err)
	}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil || !strings.Contains(string(mk), "compose-certs:") {
		t.Errorf("Makefile lacks the compose-certs target: %v", err)
	}
}

// certSANs returns c's DNS and IP SANs as strings.
func certSANs(c *x509.Certificate) []string {
	out := append([]string(nil), c.DNSNames...)
	for _, ip := range c.IPAddresses {
		out = append(out, ip.String())
	}
	return out
}
