// Package apikey owns the format of tenants' API keys and of the hashes the
// configuration stores instead of them: creating a random key, hashing a
// key, and parsing a hash line ("sha256:<64 hex digits>").
//
// Keys are 256-bit random tokens ("sy-" and 43 base64url characters), not
// passwords: nobody can guess one, so an unsalted SHA-256 is enough to make
// the configuration useless to whoever reads it (a salted, slow hash such as
// bcrypt protects low-entropy secrets against dictionary attacks, which do
// not exist for random keys, and would cost milliseconds on every request).
// The picker compares digests in constant time (picker/tenant).
package apikey

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// Prefix starts every key New makes, so secret scanners and people can
// tell a switchyard key when they see one. Keys made elsewhere work too:
// any string without spaces is hashed as it is.
const Prefix = "sy-"

// Scheme names the hash in a hash line.
const Scheme = "sha256:"

// Digest is the SHA-256 digest of a key.
type Digest [sha256.Size]byte

// New returns a new random key and its hash line.
func New() (key, hash string, err error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", "", fmt.Errorf("random key: %w", err)
	}
	key = Prefix + base64.RawURLEncoding.EncodeToString(b[:])
	return key, Hash(key), nil
}

// Sum returns the digest of key.
func Sum(key []byte) Digest { return sha256.Sum256(key) }

// Hash returns the hash line of key: "sha256:" and its digest in lower-case
// hex.
func Hash(key string) string { return Format(Sum([]byte(key))) }

// Format renders a digest as a hash line.
func Format(d Digest) string { return Scheme + hex.EncodeToString(d[:]) }

// ErrNotHash is wrapped by ParseHash's errors.
var ErrNotHash = errors.New("not an API key hash")

// ParseHash parses a hash line (surrounding spaces ignored, hex in either
// case). A string that looks like a key rather than a hash gets an error
// saying so.
func ParseHash(s string) (Digest, error) {
	var d Digest
	s = strings.TrimSpace(s)
	hexPart, ok := strings.CutPrefix(s, Scheme)
	if !ok {
		if strings.HasPrefix(s, Prefix) {
			return d, fmt.Errorf("%w: this is a key, not its hash; store %q instead (switchyard key hash prints it)", ErrNotHash, Hash(s))
		}
		return d, fmt.Errorf("%w: want %q followed by 64 hex digits", ErrNotHash, Scheme)
	}
	if len(hexPart) != 2*len(d) {
		return d, fmt.Errorf("%w: %d hex digits after %q, want 64", ErrNotHash, len(hexPart), Scheme)
	}
	if _, err := hex.Decode(d[:], []byte(hexPart)); err != nil {
		return d, fmt.Errorf("%w: %q is not hexadecimal", ErrNotHash, hexPart)
	}
	return d, nil
}

// Canonical returns the hash line of s in canonical form (lower-case hex,
// no spaces).
func Canonical(s string) (string, error) {
	d, err := ParseHash(s)
	if err != nil {
		return "", err
	}
	return Format(d), nil
}

// ParseFile parses a key file: one hash line per line; blank lines and
// lines starting with # are skipped. Every bad line is reported, with its
// 1-based line number.
func ParseFile(content []byte) ([]string, []LineError) {
	var (
		out  []string
		errs []LineError
	)
	for i, line := range strings.Split(string(content), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		h, err := Canonical(line)
		if err != nil {
			errs = append(errs, LineError{Line: i + 1, Err: err})
			continue
		}
		out = append(out, h)
	}
	return out, errs
}

// LineError is a bad line of a key file.
type LineError struct {
	Line int
	Err  error
}

func (e LineError) Error() string { return fmt.Sprintf("line %d: %v", e.Line, e.Err) }
