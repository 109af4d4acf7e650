package mtls

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"
)

// Files names the PEM files a Server loads: its certificate chain, its
// private key, and the CA bundle client certificates must chain to.
type Files struct {
	Cert, Key, ClientCA string
}

// Validate reports a Files with some but not all paths set.
func (f Files) Validate() error {
	set := 0
	for _, p := range []string{f.Cert, f.Key, f.ClientCA} {
		if p != "" {
			set++
		}
	}
	if set != 0 && set != 3 {
		return errors.New("TLS needs a certificate, its key and a client CA file together")
	}
	return nil
}

// fileSet is the content of the three files as last read.
type fileSet struct{ cert, key, ca []byte }

func (f Files) read() (fileSet, error) {
	var fs fileSet
	var err error
	if fs.cert, err = os.ReadFile(f.Cert); err != nil {
		return fs, fmt.Errorf("TLS certificate: %w", err)
	}
	if fs.key, err = os.ReadFile(f.Key); err != nil {
		return fs, fmt.Errorf("TLS key: %w", err)
	}
	if fs.ca, err = os.ReadFile(f.ClientCA); err != nil {
		return fs, fmt.Errorf("TLS client CA: %w", err)
	}
	return fs, nil
}

func (a fileSet) equal(b fileSet) bool {
	return bytes.Equal(a.cert, b.cert) && bytes.Equal(a.key, b.key) && bytes.Equal(a.ca, b.ca)
}

// Parse builds Material from PEM: a certificate chain, its key, and a CA
// bundle.
func Parse(certPEM, keyPEM, caPEM []byte, origin string) (*Material, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate and key: %w", err)
	}
	if cert.Leaf == nil {
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, fmt.Errorf("certificate: %w", err)
		}
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("client CA: no PEM certificate found")
	}
	return &Material{Certificate: cert, ClientCAs: pool, Origin: origin}, nil
}

func (fs fileSet) parse(f Files) (*Material, error) {
	m, err := Parse(fs.cert, fs.key, fs.ca, "files")
	if err != nil {
		return nil, fmt.Errorf("%s, %s, %s: %w", f.Cert, f.Key, f.ClientCA, err)
	}
	return m, nil
}

// LoadFiles reads f once and sets the Server's material; it fails if the
// files are missing or do not form a usable certificate, key and CA.
func (s *Server) LoadFiles(f Files) error {
	fs, err := f.read()
	if err != nil {
		return err
	}
	m, err := fs.parse(f)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.loaded = fs
	s.mu.Unlock()
	s.Set(m)
	return nil
}

// WatchFiles re-reads f every interval until ctx ends, and sets the new
// material whenever the content changed and loads. Content that does not
// load (a rotation caught half-way, say the new certificate next to the
// old key) is logged once and the material in use stays; the next change
// is tried again. Reading files is cheap enough to poll, and polling sees
// every way of replacing them: in place, by rename, by symlink swap.
func (s *Server) WatchFiles(ctx context.Context, f Files, interval time.Duration) error {
	// Start from what LoadFiles loaded, so a change made since is seen.
	s.mu.Lock()
	last := s.loaded
	s.mu.Unlock()
	var failed fileSet
	lastErr := ""
	report := func(msg string, err error) {
		if err.Error() != lastErr {
			s.log.Warn(msg, "err", err)
			lastErr = err.Error()
		}
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		fs, err := f.read()
		if err != nil {
			report("TLS files unreadable; keeping the certificate in use", err)
			continue
		}
		if fs.equal(last) || fs.equal(failed) {
			continue
		}
		m, err := fs.parse(f)
		if err != nil {
			report("TLS files changed but do not load; keeping the certificate in use", err)
			failed = fs
			continue
		}
		last, failed, lastErr = fs, fileSet{}, ""
		s.Set(m)
	}
}
