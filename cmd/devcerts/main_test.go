package main

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/switchyard/switchyard/internal/mtls"
)

func devcerts(t *testing.T, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	if code := run(args, &stdout, &stderr); code != 0 {
		t.Fatalf("devcerts %q: exit %d: %s", args, code, stderr.String())
	}
	return stdout.String()
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

// picker returns an mTLS server as a replica runs it: its own files from
// dir and an allowlist.
func picker(t *testing.T, dir string, allowed ...string) *mtls.Server {
	t.Helper()
	s := mtls.NewServer(mtls.Options{AllowedSANs: allowed, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	err := s.LoadFiles(mtls.Files{Cert: filepath.Join(dir, "cert.pem"), Key: filepath.Join(dir, "key.pem"), ClientCA: filepath.Join(dir, "ca.pem")})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// The default run makes one directory per compose replica; each
// certificate has the shared names plus its own, and serves as a client
// certificate that another replica's allowlist admits by the shared name.
func TestReplicaCertificates(t *testing.T) {
	out := t.TempDir()
	msg := devcerts(t, "-out", out)
	if !strings.Contains(msg, "created a CA") {
		t.Errorf("output %q", msg)
	}
	want := map[string][]string{
		"switchyard-1": {"switchyard", "switchyard-1", "127.0.0.1", "10.231.0.11"},
		"switchyard-2": {"switchyard", "switchyard-2", "127.0.0.1", "10.231.0.13"},
	}
	for name, sans := range want {
		c := readCert(t, filepath.Join(out, name, "cert.pem"))
		got := mtls.SANs(c)
		slices.Sort(got)
		slices.Sort(sans)
		if !slices.Equal(got, sans) {
			t.Errorf("%s: SANs %v, want %v", name, got, sans)
		}
		if !slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageServerAuth) || !slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
			t.Errorf("%s: extended key usages %v, want server and client", name, c.ExtKeyUsage)
		}
	}
	if _, err := os.Stat(filepath.Join(out, "switchyard")); !os.IsNotExist(err) {
		t.Errorf("a shared switchyard/ directory was written next to the replicas' (%v)", err)
	}

	// Envoy accepts replicas by the shared names only, so a new replica
	// needs nothing on the Envoy hosts.
	sds, err := os.ReadFile(filepath.Join(out, "envoy", "ca-sds.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sds), `exact: "switchyard"`) || strings.Contains(string(sds), "switchyard-1") {
		t.Errorf("ca-sds.yaml should match the shared SAN switchyard only:\n%s", sds)
	}

	// Replica 2's picker with the compose allowlist admits replica 1's
	// certificate (and Envoy's); with the Envoy SAN alone it would not.
	raw := func(dir string) [][]byte { return [][]byte{readCert(t, filepath.Join(out, dir, "cert.pem")).Raw} }
	both := picker(t, filepath.Join(out, "switchyard-2"), "envoy.switchyard.internal", "switchyard")
	for _, client := range []string{"switchyard-1", "envoy"} {
		if _, err := both.VerifyClient(raw(client)); err != nil {
			t.Errorf("%s rejected by switchyard-2: %v", client, err)
		}
	}
	envoyOnly := picker(t, filepath.Join(out, "switchyard-2"), "envoy.switchyard.internal")
	if _, err := envoyOnly.VerifyClient(raw("switchyard-1")); err == nil {
		t.Error("an allowlist without the shared replica SAN admitted a replica")
	}
}

// -replicas "" keeps the single-directory layout; bad names are refused.
func TestReplicasFlag(t *testing.T) {
	out := t.TempDir()
	devcerts(t, "-out", out, "-replicas", "", "-switchyard-san", "sy.internal,10.0.0.5")
	c := readCert(t, filepath.Join(out, "switchyard", "cert.pem"))
	if got := mtls.SANs(c); !slices.Equal(got, []string{"sy.internal", "10.0.0.5"}) {
		t.Errorf("SANs %v", got)
	}
	for _, bad := range []string{"a=1.2.3.4,a=1.2.3.5", "../x=1.2.3.4", "ca=1.2.3.4", "envoy", "=1.2.3.4"} {
		var stderr bytes.Buffer
		if code := run([]string{"-out", t.TempDir(), "-replicas", bad}, io.Discard, &stderr); code != 1 || !strings.Contains(stderr.String(), "-replicas") {
			t.Errorf("-replicas %q: exit %d, %q", bad, code, stderr.String())
		}
	}
}

// TestModesUnderRestrictiveUmask: the containers read the bind-mounted
// certificate directories as their own users, so under umask 077 or 027
// every directory they mount must still be 0755 and every file they read
// world-readable; the CA's directory and key stay private. Re-running (a
// rotation) keeps it so. Not parallel: the umask is the process's.
func TestModesUnderRestrictiveUmask(t *testing.T) {
	for _, mask := range []int{0o077, 0o027} {
		old := syscall.Umask(mask)
		out := filepath.Join(t.TempDir(), "tls")
		for range 2 {
			devcerts(t, "-out", out)
		}
		syscall.Umask(old)
		for _, sub := range []string{"", "switchyard-1", "switchyard-2", "envoy"} {
			dir := filepath.Join(out, sub)
			if info, err := os.Stat(dir); err != nil || info.Mode().Perm() != 0o755 {
				t.Errorf("umask %03o: %s has mode %v (%v), want 0755", mask, dir, info.Mode().Perm(), err)
			}
			if sub == "" {
				continue
			}
			for _, f := range []string{"cert.pem", "key.pem", "ca.pem"} {
				p := filepath.Join(dir, f)
				if info, err := os.Stat(p); err != nil || info.Mode().Perm()&0o444 != 0o444 {
					t.Errorf("umask %03o: %s has mode %v (%v), want readable by all", mask, p, info.Mode().Perm(), err)
				}
			}
		}
		for p, want := range map[string]os.FileMode{filepath.Join(out, "ca"): 0o700, filepath.Join(out, "ca", "ca-key.pem"): 0o600} {
			if info, err := os.Stat(p); err != nil || info.Mode().Perm() != want {
				t.Errorf("umask %03o: %s has mode %v (%v), want %v", mask, p, info.Mode().Perm(), err, want)
			}
		}
	}
}
