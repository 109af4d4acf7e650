package deploy

import (
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

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
// TLS with what `make compose-certs` generates: switchyard's TLS flags
// name files in its mounted certificate directory, Envoy mounts its
// directory where switchyard's picker cluster and the bootstrap expect
// it, the certificates carry the names each side checks, and the
// generated files stay out of git.
func TestComposeMTLS(t *testing.T) {
	p := loadProject(t)
	root := testutil.RepoRoot(t)
	sy := service(t, p, svcSwitchyard)
	flags := serveFlags(t, sy)
	for flag, file := range map[string]string{"tls-cert": "cert.pem", "tls-key": "key.pem", "tls-client-ca": "ca.pem"} {
		if want := path.Join(switchyardTLSTarget, file); flags[flag] != want {
			t.Errorf("-%s = %q, want %q", flag, flags[flag], want)
		}
	}
	if rel, _ := filepath.Rel(root, bindSourceFor(t, sy, switchyardTLSTarget)); filepath.ToSlash(rel) != composeTLSDir+"/switchyard" {
		t.Errorf("switchyard mounts %s at %s, want %s/switchyard", rel, switchyardTLSTarget, composeTLSDir)
	}
	if flags["envoy-tls-dir"] != envoyTLSTarget {
		t.Errorf("-envoy-tls-dir = %q, want %q", flags["envoy-tls-dir"], envoyTLSTarget)
	}
	if _, ok := flags["allow-plaintext"]; ok {
		t.Error("the stack must not allow plaintext")
	}
	env := service(t, p, svcEnvoy)
	if rel, _ := filepath.Rel(root, bindSourceFor(t, env, envoyTLSTarget)); filepath.ToSlash(rel) != composeTLSDir+"/envoy" {
		t.Errorf("envoy mounts %s at %s, want %s/envoy", rel, envoyTLSTarget, composeTLSDir)
	}

	out := t.TempDir()
	devcerts(t, out)
	syCert := readCert(t, filepath.Join(out, "switchyard", "cert.pem"))
	ip := staticIP(t, sy, stackNetwork)
	if !slices.ContainsFunc(syCert.IPAddresses, func(a net.IP) bool { return a.String() == ip.String() }) || !slices.Contains(syCert.DNSNames, svcSwitchyard) {
		t.Errorf("switchyard certificate SANs %v %v lack %s and %s", syCert.DNSNames, syCert.IPAddresses, svcSwitchyard, ip)
	}
	envoyCert := readCert(t, filepath.Join(out, "envoy", "cert.pem"))
	if !slices.Contains(envoyCert.DNSNames, flags["tls-allowed-san"]) {
		t.Errorf("Envoy certificate SANs %v lack switchyard's -tls-allowed-san %q", envoyCert.DNSNames, flags["tls-allowed-san"])
	}
	sds, err := os.ReadFile(filepath.Join(out, "envoy", "cert-sds.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sds), path.Join(envoyTLSTarget, "cert.pem")) {
		t.Errorf("cert-sds.yaml does not name the container path %s:\n%s", envoyTLSTarget, sds)
	}
	// Re-running reuses the CA: it is a rotation, not a new trust root.
	ca := readCert(t, filepath.Join(out, "ca", "ca.pem"))
	devcerts(t, out)
	if again := readCert(t, filepath.Join(out, "ca", "ca.pem")); !again.Equal(ca) {
		t.Error("a second run replaced the CA")
	}
	if next := readCert(t, filepath.Join(out, "switchyard", "cert.pem")); next.SerialNumber.Cmp(syCert.SerialNumber) == 0 {
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
