// Command devcerts creates a local CA and the certificates for mutual TLS
// between Envoy and switchyard replicas: the docker-compose stack's (make
// compose-certs) or any small test setup's. It needs no openssl.
//
//	devcerts -out examples/compose/tls
//
// writes
//
//	OUT/ca/ca.pem, ca-key.pem            the CA (kept: re-running reuses it)
//	OUT/<replica>/cert.pem, key.pem, ca.pem  one directory per -replicas
//	                                     entry, for that replica's -tls-cert,
//	                                     -tls-key, -tls-client-ca
//	OUT/envoy/cert.pem, key.pem, ca.pem, cert-sds.yaml, ca-sds.yaml
//	                                     an Envoy certificate directory
//	                                     (envoy.TLSLayout) for -envoy-dir
//
// Every replica has its own key. Its certificate carries the names all
// replicas share (-switchyard-san, by default the DNS name "switchyard",
// which is also the SNI Envoy sends) plus its own name and IP, and is
// valid for both server and client authentication: Envoy accepts any
// replica by the shared names (so adding a replica changes nothing on the
// Envoy hosts), and a replica that connects to another's picker presents
// its own certificate, which the other admits when its -tls-allowed-san
// lists a shared name. With -replicas "" one directory, OUT/switchyard/,
// gets a certificate with the shared names only.
//
// Re-running it issues new leaf certificates from the same CA: that is a
// rotation, picked up by a running switchyard within a second and by Envoy
// when the new set moves in. Each certificate directory's cert.pem, key.pem
// and ca.pem are links into a data directory that a rotation swaps in one
// rename (envoy.WriteFileSet), so no reader ever pairs a new certificate
// with the old key. Directories are world-readable (0755) and so are the
// certificates, whatever the umask; the CA's directory is private (0700).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/certgen"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type options struct {
	out           string
	switchyardSAN string
	replicas      string
	envoySAN      string
	envoyDir      string
	days          int
	keyMode       os.FileMode
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("devcerts", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	var worldReadable bool
	fs.StringVar(&o.out, "out", "examples/compose/tls", "output `directory`")
	fs.StringVar(&o.switchyardSAN, "switchyard-san", "switchyard,127.0.0.1", "comma-separated `names` (DNS or IP) every replica's certificate carries; Envoy accepts switchyard by these")
	fs.StringVar(&o.replicas, "replicas", "switchyard-1=10.231.0.11,switchyard-2=10.231.0.13", "comma-separated `name=ip` list, one certificate directory OUT/<name> per switchyard replica, whose certificate adds the name and the IP (or other name) to -switchyard-san; empty: one directory OUT/switchyard with -switchyard-san only")
	fs.StringVar(&o.envoySAN, "envoy-san", "envoy.switchyard.internal", "comma-separated `names` of the Envoy certificate (switchyard's -tls-allowed-san)")
	fs.StringVar(&o.envoyDir, "envoy-dir", envoy.DefaultTLSDir, "`path` where Envoy sees its certificate directory (the SDS files name it)")
	fs.IntVar(&o.days, "days", 365, "validity of the leaf certificates in `days`")
	fs.BoolVar(&worldReadable, "world-readable-keys", true, "write private keys world-readable, as containers running under their own users need for bind mounts; false writes them 0600")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	o.keyMode = 0o600
	if worldReadable {
		o.keyMode = 0o644
	}
	if err := generate(o, stdout); err != nil {
		fmt.Fprintf(stderr, "devcerts: %v\n", err)
		return 1
	}
	return 0
}

func split(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// replica is one switchyard replica's certificate directory and names.
type replica struct {
	name string   // directory under -out, and a DNS SAN
	sans []string // every SAN of its certificate
}

// parseReplicas reads -replicas ("name=ip,..."); the shared SANs come
// first in every replica's list.
func parseReplicas(spec string, shared []string) ([]replica, error) {
	entries := split(spec)
	if len(entries) == 0 {
		return []replica{{name: "switchyard", sans: shared}}, nil
	}
	var out []replica
	seen := map[string]bool{}
	for _, e := range entries {
		name, extra, _ := strings.Cut(e, "=")
		name, extra = strings.TrimSpace(name), strings.TrimSpace(extra)
		switch {
		case name == "" || name == "." || name == ".." || strings.ContainsAny(name, `/\`):
			return nil, fmt.Errorf("-replicas: %q: want name=ip with a plain directory name", e)
		case name == "ca" || name == "envoy":
			return nil, fmt.Errorf("-replicas: %q: the name %q is taken by the CA or Envoy directory", e, name)
		case seen[name]:
			return nil, fmt.Errorf("-replicas: %q listed twice", name)
		}
		seen[name] = true
		sans := append(append([]string(nil), shared...), name)
		if extra != "" {
			sans = append(sans, extra)
		}
		out = append(out, replica{name: name, sans: sans})
	}
	return out, nil
}

func generate(o options, stdout io.Writer) error {
	shared := split(o.switchyardSAN)
	replicas, err := parseReplicas(o.replicas, shared)
	if err != nil {
		return err
	}
	// Every directory gets its mode explicitly: under a restrictive umask
	// (077, 027) MkdirAll alone makes them 0700 or 0750, and the
	// containers' own users could not enter the bind-mounted ones.
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	if err := os.Chmod(o.out, 0o755); err != nil {
		return err
	}
	ca, created, err := loadOrCreateCA(filepath.Join(o.out, "ca"))
	if err != nil {
		return err
	}
	validity := certgen.Validity{NotAfter: time.Now().AddDate(0, 0, o.days)}
	var notAfter time.Time
	var names []string
	for _, r := range replicas {
		// Server and client: a replica serves Envoys and, with the same
		// certificate, connects to the other replicas' pickers.
		sy, err := ca.Issue(certgen.LeafOptions{CommonName: r.name, SANs: r.sans, Server: true, Client: true, Validity: validity})
		if err != nil {
			return err
		}
		notAfter = sy.Cert.NotAfter
		// One set, swapped in at once: a replica polling its files never
		// pairs the new certificate with the old key.
		if err := envoy.WriteFileSet(filepath.Join(o.out, r.name), 0o755, []envoy.File{
			{Name: "key.pem", Data: sy.KeyPEM, Mode: o.keyMode},
			{Name: "cert.pem", Data: sy.CertPEM, Mode: 0o644},
			{Name: "ca.pem", Data: ca.CertPEM, Mode: 0o644},
		}); err != nil {
			return err
		}
		names = append(names, fmt.Sprintf("%s %v", r.name, r.sans))
	}
	ev, err := ca.Issue(certgen.LeafOptions{CommonName: "envoy", SANs: split(o.envoySAN), Client: true, Validity: validity})
	if err != nil {
		return err
	}
	// Envoy accepts every replica by the names they share.
	if err := envoy.TLSLayout(o.envoyDir).WriteTo(filepath.Join(o.out, "envoy"), ev.CertPEM, ev.KeyPEM, ca.CertPEM, shared, o.keyMode); err != nil {
		return err
	}
	what := "reused the CA in"
	if created {
		what = "created a CA in"
	}
	fmt.Fprintf(stdout, "devcerts: %s %s; switchyard certificates %s and Envoy certificate %v (accepting %v) valid until %s\n",
		what, filepath.Join(o.out, "ca"), strings.Join(names, ", "), split(o.envoySAN), shared, notAfter.UTC().Format(time.DateOnly))
	return nil
}

func loadOrCreateCA(dir string) (*certgen.CA, bool, error) {
	certPath, keyPath := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	c, cerr := os.ReadFile(certPath)
	k, kerr := os.ReadFile(keyPath)
	if cerr == nil && kerr == nil {
		ca, err := certgen.LoadCA(c, k)
		if err != nil {
			return nil, false, fmt.Errorf("%s: %w", dir, err)
		}
		return ca, false, nil
	}
	if !errors.Is(cerr, os.ErrNotExist) || !errors.Is(kerr, os.ErrNotExist) {
		return nil, false, fmt.Errorf("CA in %s is incomplete or unreadable: %v, %v", dir, cerr, kerr)
	}
	ca, err := certgen.NewCA("switchyard local CA", certgen.Validity{NotAfter: time.Now().AddDate(5, 0, 0)})
	if err != nil {
		return nil, false, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, false, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, false, err
	}
	if err := envoy.WriteAtomic(keyPath, ca.KeyPEM, 0o600); err != nil {
		return nil, false, err
	}
	if err := envoy.WriteAtomic(certPath, ca.CertPEM, 0o644); err != nil {
		return nil, false, err
	}
	return ca, true, nil
}
