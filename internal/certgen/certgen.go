// Package certgen owns generating X.509 certificates for switchyard's
// mutual TLS without openssl: a private CA and the server and client
// certificates it signs, as PEM. Tests use it to build good, expired,
// foreign-CA and wrong-SAN certificates; cmd/devcerts uses it to create the
// certificates of the docker-compose stack and the demo. Keys are ECDSA
// P-256, written as PKCS#8.
package certgen

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"time"
)

// CA is a certificate authority that can issue leaf certificates.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	KeyPEM  []byte
	key     crypto.Signer
}

// Leaf is an issued certificate with its private key.
type Leaf struct {
	Cert    *x509.Certificate
	CertPEM []byte
	KeyPEM  []byte
}

// Validity is a certificate's validity window. Zero values mean one hour
// ago and one year from now.
type Validity struct {
	NotBefore, NotAfter time.Time
}

func (v Validity) window() (time.Time, time.Time) {
	nb, na := v.NotBefore, v.NotAfter
	if nb.IsZero() {
		nb = time.Now().Add(-time.Hour)
	}
	if na.IsZero() {
		na = time.Now().AddDate(1, 0, 0)
	}
	return nb, na
}

// NewCA creates a self-signed CA named name.
func NewCA(name string, v Validity) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	nb, na := v.window()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"switchyard"}},
		NotBefore:             nb,
		NotAfter:              na,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, CertPEM: encodeCert(der), KeyPEM: keyPEM, key: key}, nil
}

// LoadCA reads a CA written earlier (CertPEM and KeyPEM).
func LoadCA(certPEM, keyPEM []byte) (*CA, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("CA certificate: no PEM CERTIFICATE block")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	k, _ := pem.Decode(keyPEM)
	if k == nil {
		return nil, fmt.Errorf("CA key: no PEM block")
	}
	parsed, err := x509.ParsePKCS8PrivateKey(k.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CA key: %w", err)
	}
	signer, ok := parsed.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("CA key: %T cannot sign", parsed)
	}
	return &CA{Cert: cert, CertPEM: certPEM, KeyPEM: keyPEM, key: signer}, nil
}

// LeafOptions describe a certificate to issue. Names are split by kind: an
// IP literal becomes an IP SAN, a string with "://" a URI SAN (for example
// a SPIFFE ID), anything else a DNS SAN.
type LeafOptions struct {
	CommonName string
	SANs       []string
	// Server and Client set the extended key usages; neither means both.
	Server, Client bool
	Validity       Validity
}

// Issue signs a new leaf certificate.
func (ca *CA) Issue(o LeafOptions) (*Leaf, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	nb, na := o.Validity.window()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: o.CommonName, Organization: []string{"switchyard"}},
		NotBefore:    nb,
		NotAfter:     na,
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	if o.Server || !o.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if o.Client || !o.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	for _, s := range o.SANs {
		if ip := net.ParseIP(s); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			continue
		}
		if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
			tmpl.URIs = append(tmpl.URIs, u)
			continue
		}
		tmpl.DNSNames = append(tmpl.DNSNames, s)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.key)
	if err != nil {
		return nil, fmt.Errorf("create certificate %q: %w", o.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse certificate %q: %w", o.CommonName, err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	return &Leaf{Cert: cert, CertPEM: encodeCert(der), KeyPEM: keyPEM}, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		// crypto/rand does not fail on supported platforms.
		panic(fmt.Sprintf("certgen: serial number: %v", err))
	}
	return n
}

func encodeCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func encodeKey(k crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, fmt.Errorf("marshal key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}
