// Package mtls owns the transport security of switchyard's servers: the
// serving certificate and the client CA (from files, reloaded when they
// change, or from Consul Connect's CA), who may connect (a client
// certificate that chains to the CA and, optionally, carries one of a list
// of SANs), the log line and counter of every rejected handshake, and the
// rule that a server listens in plaintext only on loopback unless an
// operator explicitly allows otherwise.
//
// A Server is safe for concurrent use; the material it serves is swapped
// atomically, so a rotation affects new handshakes only and never an open
// connection.
package mtls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Material is what a Server serves: its certificate chain and key (with
// Leaf parsed) and the CAs client certificates must chain to.
type Material struct {
	Certificate tls.Certificate
	ClientCAs   *x509.CertPool
	// Origin says where the material came from, for logs and status
	// ("files", "consul").
	Origin string
}

// Leaf returns the serving certificate.
func (m *Material) Leaf() *x509.Certificate { return m.Certificate.Leaf }

// Options configure a Server.
type Options struct {
	// AllowedSANs, when not empty, admits only client certificates with at
	// least one of these subject alternative names (DNS names, URIs such as
	// SPIFFE IDs, IP addresses, e-mail addresses; exact match).
	AllowedSANs []string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Now defaults to time.Now; tests move the clock.
	Now func() time.Time
	// LogEvery bounds rejection log lines: after one is logged for a peer
	// IP and reason, the same pair is logged again only after LogEvery
	// (with the count of those not logged). Default 10s. Every rejection
	// is counted regardless.
	LogEvery time.Duration
}

// Reasons a handshake is rejected, the reason label of the rejection
// counter.
const (
	ReasonNoCertificate  = "no_certificate"
	ReasonUnknownCA      = "unknown_ca"
	ReasonExpired        = "expired"
	ReasonNotYetValid    = "not_yet_valid"
	ReasonSANNotAllowed  = "san_not_allowed"
	ReasonBadCertificate = "bad_certificate"
	ReasonNotTLS         = "not_tls"
	ReasonAborted        = "aborted"
	ReasonOther          = "other"
)

// RejectError is the error a client certificate check returns.
type RejectError struct {
	Reason string
	msg    string
}

func (e *RejectError) Error() string { return e.msg }

// Server serves Material to TLS handshakes and checks client certificates.
type Server struct {
	opts    Options
	log     *slog.Logger
	allowed map[string]bool
	mat     atomic.Pointer[Material]
	reloads atomic.Uint64

	mu       sync.Mutex
	rejected map[RejectKey]uint64
	lastLog  map[logKey]logState
	// consulKey identifies the Consul leaf and roots in use.
	consulKey string
	// loaded is the file content LoadFiles set.
	loaded fileSet
}

// RejectKey labels rejected handshakes: which server, and why.
type RejectKey struct {
	Server, Reason string
}

type logKey struct {
	server, ip, reason string
}

type logState struct {
	at         time.Time
	suppressed uint64
}

// NewServer returns a Server with no material yet: handshakes fail until
// Set is called (LoadFiles or WatchConsul do).
func NewServer(opts Options) *Server {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.LogEvery <= 0 {
		opts.LogEvery = 10 * time.Second
	}
	s := &Server{opts: opts, log: opts.Logger, allowed: map[string]bool{},
		rejected: map[RejectKey]uint64{}, lastLog: map[logKey]logState{}}
	for _, san := range opts.AllowedSANs {
		s.allowed[san] = true
	}
	return s
}

// Set replaces the material new handshakes use.
func (s *Server) Set(m *Material) {
	if s.mat.Swap(m) != nil {
		s.reloads.Add(1)
	}
	leaf := m.Leaf()
	s.log.Info("TLS certificate in use", "origin", m.Origin, "subject", leaf.Subject.String(),
		"sans", strings.Join(SANs(leaf), ","), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
	if now := s.opts.Now(); now.After(leaf.NotAfter) {
		s.log.Error("the serving TLS certificate has expired: clients will refuse it", "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
	}
}

// Current returns the material in use, nil before the first Set.
func (s *Server) Current() *Material { return s.mat.Load() }

// Stats is a snapshot of the Server's counters.
type Stats struct {
	// Rejected counts rejected handshakes.
	Rejected map[RejectKey]uint64
	// Reloads counts material replacements after the first.
	Reloads uint64
	// NotAfter is when the serving certificate expires (zero before Set).
	NotAfter time.Time
	Subject  string
	Origin   string
}

// Stats returns the counters.
func (s *Server) Stats() Stats {
	st := Stats{Reloads: s.reloads.Load(), Rejected: map[RejectKey]uint64{}}
	if m := s.mat.Load(); m != nil {
		st.NotAfter, st.Subject, st.Origin = m.Leaf().NotAfter, m.Leaf().Subject.String(), m.Origin
	}
	s.mu.Lock()
	for k, v := range s.rejected {
		st.Rejected[k] = v
	}
	s.mu.Unlock()
	return st
}

// Config returns the tls.Config of a server: it presents the current
// certificate and, with requireClientCert, refuses clients without a
// certificate the current CA and AllowedSANs accept. Without it a client
// certificate is optional, but one that is presented must pass the same
// checks (the admin server: state-changing requests then need one).
func (s *Server) Config(requireClientCert bool, nextProtos ...string) *tls.Config {
	auth := tls.RequestClientCert
	if requireClientCert {
		auth = tls.RequireAnyClientCert
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: slices.Clone(nextProtos),
		ClientAuth: auth,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			m := s.mat.Load()
			if m == nil {
				return nil, errors.New("no TLS certificate loaded yet")
			}
			return &m.Certificate, nil
		},
		// Verification is done here, not by crypto/tls, so that the CA in
		// use is always the current one and rejections say exactly why.
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 {
				return nil // optional and not given; required is enforced by ClientAuth
			}
			_, err := s.VerifyClient(raw)
			return err
		},
	}
}

// VerifyClient checks a client's certificate chain (leaf first, DER) and
// returns the parsed leaf; the error is a *RejectError.
func (s *Server) VerifyClient(raw [][]byte) (*x509.Certificate, error) {
	m := s.mat.Load()
	if m == nil {
		return nil, &RejectError{ReasonOther, "no client CA loaded yet"}
	}
	certs := make([]*x509.Certificate, 0, len(raw))
	for _, b := range raw {
		c, err := x509.ParseCertificate(b)
		if err != nil {
			return nil, &RejectError{ReasonBadCertificate, fmt.Sprintf("client certificate does not parse: %v", err)}
		}
		certs = append(certs, c)
	}
	leaf := certs[0]
	now := s.opts.Now()
	switch {
	case now.After(leaf.NotAfter):
		return nil, &RejectError{ReasonExpired, fmt.Sprintf("client certificate %s expired at %s (%s ago)",
			Describe(leaf), leaf.NotAfter.UTC().Format(time.RFC3339), now.Sub(leaf.NotAfter).Round(time.Second))}
	case now.Before(leaf.NotBefore):
		return nil, &RejectError{ReasonNotYetValid, fmt.Sprintf("client certificate %s is not valid before %s",
			Describe(leaf), leaf.NotBefore.UTC().Format(time.RFC3339))}
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	_, err := leaf.Verify(x509.VerifyOptions{Roots: m.ClientCAs, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	if err != nil {
		var ua x509.UnknownAuthorityError
		if errors.As(err, &ua) {
			return nil, &RejectError{ReasonUnknownCA, fmt.Sprintf("client certificate %s (issuer %q) is not signed by the configured client CA",
				Describe(leaf), leaf.Issuer.String())}
		}
		return nil, &RejectError{ReasonBadCertificate, fmt.Sprintf("client certificate %s: %v", Describe(leaf), err)}
	}
	if len(s.allowed) > 0 && !slices.ContainsFunc(SANs(leaf), func(n string) bool { return s.allowed[n] }) {
		return nil, &RejectError{ReasonSANNotAllowed, fmt.Sprintf("client certificate %s has no allowed SAN (allowed: %s)",
			Describe(leaf), strings.Join(s.opts.AllowedSANs, ", "))}
	}
	return leaf, nil
}

// Rejected records a failed handshake on server from peer: it is counted,
// and logged unless the same peer IP was logged for the same reason
// within LogEvery.
func (s *Server) Rejected(server string, peer net.Addr, err error) {
	reason := Classify(err)
	ip := peerString(peer)
	if h, _, splitErr := net.SplitHostPort(ip); splitErr == nil {
		ip = h
	}
	now := s.opts.Now()
	s.mu.Lock()
	s.rejected[RejectKey{server, reason}]++
	k := logKey{server, ip, reason}
	st, seen := s.lastLog[k]
	logIt := !seen || now.Sub(st.at) >= s.opts.LogEvery
	suppressed := st.suppressed
	if logIt {
		s.lastLog[k] = logState{at: now}
		if len(s.lastLog) > 4096 { // bound memory under a scan: forget old entries
			for lk, ls := range s.lastLog {
				if now.Sub(ls.at) >= s.opts.LogEvery {
					delete(s.lastLog, lk)
				}
			}
			if len(s.lastLog) > 4096 { // all recent: start over rather than grow
				clear(s.lastLog)
				s.lastLog[k] = logState{at: now}
			}
		}
	} else {
		st.suppressed++
		s.lastLog[k] = st
	}
	s.mu.Unlock()
	if !logIt {
		return
	}
	attrs := []any{"server", server, "peer", peerString(peer), "reason", reason, "err", err.Error()}
	if suppressed > 0 {
		attrs = append(attrs, "not_logged_since_last", suppressed)
	}
	s.log.Warn("rejected TLS connection", attrs...)
}

func peerString(a net.Addr) string {
	if a == nil {
		return "unknown"
	}
	return a.String()
}

// Classify returns the reason label of a handshake error.
func Classify(err error) string {
	var re *RejectError
	if errors.As(err, &re) {
		return re.Reason
	}
	var rh tls.RecordHeaderError
	msg := err.Error()
	switch {
	case errors.As(err, &rh):
		return ReasonNotTLS
	case strings.Contains(msg, "didn't provide a certificate"):
		return ReasonNoCertificate
	case errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed), strings.Contains(msg, "connection reset"):
		return ReasonAborted
	}
	return ReasonOther
}

// Describe names a certificate in log lines: its subject and SANs.
func Describe(c *x509.Certificate) string {
	d := fmt.Sprintf("%q", c.Subject.String())
	if sans := SANs(c); len(sans) > 0 {
		d += " [" + strings.Join(sans, " ") + "]"
	}
	return d
}

// SANs returns every subject alternative name of c as a string.
func SANs(c *x509.Certificate) []string {
	var out []string
	out = append(out, c.DNSNames...)
	for _, u := range c.URIs {
		out = append(out, u.String())
	}
	for _, ip := range c.IPAddresses {
		out = append(out, ip.String())
	}
	return append(out, c.EmailAddresses...)
}

// ClientConfig returns the tls.Config for dialling another switchyard
// replica at host (an IP or name its certificate carries): this server's
// current certificate is presented as the client certificate, and the peer
// must present one that chains to the current CA and is valid for host.
// Both are read at each handshake, so rotation applies to replica traffic
// too. The peer's own SAN allowlist decides whether it accepts this one.
func (s *Server) ClientConfig(host string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2"},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			m := s.mat.Load()
			if m == nil {
				return nil, errors.New("no TLS certificate loaded yet")
			}
			return &m.Certificate, nil
		},
		// Verified here against the current CA (crypto/tls would freeze
		// the pool at construction).
		InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			m := s.mat.Load()
			if m == nil {
				return errors.New("no CA loaded yet")
			}
			if len(raw) == 0 {
				return errors.New("the replica presented no certificate")
			}
			certs := make([]*x509.Certificate, len(raw))
			for i, der := range raw {
				c, err := x509.ParseCertificate(der)
				if err != nil {
					return fmt.Errorf("replica certificate: %w", err)
				}
				certs[i] = c
			}
			inter := x509.NewCertPool()
			for _, c := range certs[1:] {
				inter.AddCert(c)
			}
			_, err := certs[0].Verify(x509.VerifyOptions{Roots: m.ClientCAs, Intermediates: inter, DNSName: host,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
			return err
		},
	}
}
