package tenant

import (
	"bytes"
	"errors"
)

// Header names a request's API key may come in (lower case, as Envoy
// sends them).
const (
	HeaderAuthorization = "authorization"
	HeaderAPIKey        = "x-api-key"
)

// MaxKeyBytes bounds an API key; longer values are rejected unhashed.
const MaxKeyBytes = 1024

// Credential errors; each is answered with 401. Their messages never
// contain what the client sent.
var (
	ErrNoKey      = errors.New("no API key: send it as Authorization: Bearer KEY or x-api-key: KEY")
	ErrBadScheme  = errors.New("the Authorization header must use the Bearer scheme: Authorization: Bearer KEY")
	ErrMalformed  = errors.New("the API key is empty, too long or contains spaces")
	ErrAmbiguous  = errors.New("the request carries more than one API key")
	ErrUnknownKey = errors.New("the API key is not valid")
)

const spaceOrTab = " \t"

var bearer = []byte("bearer")

// Credentials collects the headers a key may come in while the picker
// walks a request's headers.
type Credentials struct {
	auth, apiKey   []byte
	nAuth, nAPIKey int
}

// Add notes header k (lower case) with value v if it can carry a key, and
// reports whether it did: such headers are removed before the request goes
// upstream.
func (c *Credentials) Add(k string, v []byte) bool {
	switch k {
	case HeaderAuthorization:
		c.auth = v
		c.nAuth++
	case HeaderAPIKey:
		c.apiKey = v
		c.nAPIKey++
	default:
		return false
	}
	return true
}

// Key returns the request's API key: the token of Authorization: Bearer
// (scheme case-insensitive), or the value of x-api-key, surrounding spaces
// trimmed. Both may be sent if they agree. A header sent twice, two
// different keys, another scheme, or a key that is empty, has inner spaces
// or exceeds MaxKeyBytes is an error. The key aliases the header value.
func (c *Credentials) Key() ([]byte, error) {
	if c.nAuth > 1 || c.nAPIKey > 1 {
		return nil, ErrAmbiguous
	}
	var fromAuth, fromHeader []byte
	if c.nAuth == 1 {
		v := bytes.Trim(c.auth, spaceOrTab)
		i := bytes.IndexAny(v, spaceOrTab)
		if i < 0 || !bytes.EqualFold(v[:i], bearer) {
			if i < 0 && bytes.EqualFold(v, bearer) {
				return nil, ErrMalformed // "Bearer" and nothing else
			}
			return nil, ErrBadScheme
		}
		fromAuth = bytes.TrimLeft(v[i:], spaceOrTab)
		if err := checkKey(fromAuth); err != nil {
			return nil, err
		}
	}
	if c.nAPIKey == 1 {
		fromHeader = bytes.Trim(c.apiKey, spaceOrTab)
		if err := checkKey(fromHeader); err != nil {
			return nil, err
		}
	}
	switch {
	case fromAuth != nil && fromHeader != nil:
		if !bytes.Equal(fromAuth, fromHeader) {
			return nil, ErrAmbiguous
		}
		return fromAuth, nil
	case fromAuth != nil:
		return fromAuth, nil
	case fromHeader != nil:
		return fromHeader, nil
	}
	return nil, ErrNoKey
}

func checkKey(k []byte) error {
	if len(k) == 0 || len(k) > MaxKeyBytes || bytes.ContainsAny(k, " \t\r\n") {
		return ErrMalformed
	}
	return nil
}
