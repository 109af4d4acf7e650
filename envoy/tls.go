package envoy

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
)

// DefaultTLSDir is where an Envoy host keeps its switchyard certificates
// (bootstrap-mtls.yaml, and switchyard serve's -envoy-tls-dir default).
const DefaultTLSDir = "/etc/envoy/switchyard-tls"

// Secret names of the SDS resources; the bootstrap's ADS cluster and the
// picker cluster switchyard pushes both use them.
const (
	CertificateSecret = "switchyard-client"
	ValidationSecret  = "switchyard-ca"
)

// Layout is the certificate directory of an Envoy host:
//
//	cert.pem       the Envoy's client certificate (chain)
//	key.pem        its private key
//	ca.pem         the CA switchyard's certificate must chain to
//	cert-sds.yaml  SDS resource naming cert.pem and key.pem
//	ca-sds.yaml    SDS resource naming ca.pem and the SANs accepted on
//	               switchyard's certificate
//
// Envoy watches the directory (watched_directory) and re-reads every file
// whenever something is moved into it. A certificate and its key renamed
// into place one after the other would show it a new certificate next to
// the old key (KEY_VALUES_MISMATCH, a failed rotation). So cert.pem,
// key.pem and ca.pem are symbolic links into a data directory that a
// rotation replaces with one rename (WriteFileSet), the way Kubernetes
// updates mounted secrets.
type Layout struct {
	Dir, Cert, Key, CA, CertSDS, CASDS string
}

// TLSLayout returns the layout of dir.
func TLSLayout(dir string) Layout {
	j := func(n string) string { return filepath.Join(dir, n) }
	return Layout{Dir: dir, Cert: j("cert.pem"), Key: j("key.pem"), CA: j("ca.pem"),
		CertSDS: j("cert-sds.yaml"), CASDS: j("ca-sds.yaml")}
}

// SDSFiles returns the contents of cert-sds.yaml and ca-sds.yaml for the
// layout. serverSANs, when not empty, are the subject alternative names
// Envoy accepts on switchyard's certificate (any one, exact match; an IP
// literal matches an IP SAN, a string with "://" a URI SAN such as a
// SPIFFE ID, anything else a DNS SAN); empty accepts any certificate the
// CA signed.
func (l Layout) SDSFiles(serverSANs []string) (certSDS, caSDS string) {
	certSDS = fmt.Sprintf(`# Envoy's client certificate for switchyard (file-based SDS).
resources:
- "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
  name: %s
  tls_certificate:
    certificate_chain: {filename: %q}
    private_key: {filename: %q}
    watched_directory: {path: %q}
`, CertificateSecret, l.Cert, l.Key, l.Dir)
	var b strings.Builder
	fmt.Fprintf(&b, `# What Envoy accepts as switchyard's certificate (file-based SDS).
resources:
- "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
  name: %s
  validation_context:
    trusted_ca: {filename: %q}
    watched_directory: {path: %q}
`, ValidationSecret, l.CA, l.Dir)
	if len(serverSANs) > 0 {
		b.WriteString("    match_typed_subject_alt_names:\n")
		for _, san := range serverSANs {
			fmt.Fprintf(&b, "    - {san_type: %s, matcher: {exact: %q}}\n", sanType(san), san)
		}
	}
	return certSDS, b.String()
}

func sanType(s string) string {
	if net.ParseIP(s) != nil {
		return "IP_ADDRESS"
	}
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		return "URI"
	}
	return "DNS"
}

// Write creates the directory and writes the certificate, key and CA into
// it as one set (WriteFileSet), then both SDS files, each by writing a
// temporary file and renaming it. The SDS files are written last, so an
// Envoy starting meanwhile never reads a reference to a missing file.
func (l Layout) Write(cert, key, ca []byte, serverSANs []string) error {
	return l.WriteTo(l.Dir, cert, key, ca, serverSANs, 0o600)
}

// WriteTo is Write into another directory than the one the files name:
// for a directory that Envoy will see elsewhere, such as a bind mount
// into a container. keyMode is the private key's file mode.
func (l Layout) WriteTo(dir string, cert, key, ca []byte, serverSANs []string, keyMode os.FileMode) error {
	set := []File{
		{Name: filepath.Base(l.Key), Data: key, Mode: keyMode},
		{Name: filepath.Base(l.Cert), Data: cert, Mode: 0o644},
		{Name: filepath.Base(l.CA), Data: ca, Mode: 0o644},
	}
	if err := WriteFileSet(dir, 0o755, set); err != nil {
		return fmt.Errorf("envoy TLS dir: %w", err)
	}
	certSDS, caSDS := l.SDSFiles(serverSANs)
	for _, f := range []struct {
		path string
		data []byte
	}{{l.CertSDS, []byte(certSDS)}, {l.CASDS, []byte(caSDS)}} {
		if err := WriteAtomic(filepath.Join(dir, filepath.Base(f.path)), f.data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// WriteAtomic writes data to a temporary file in path's directory and
// renames it to path.
func WriteAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	_, werr := tmp.Write(data)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr, os.Chmod(tmp.Name(), mode)); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
