package adminauth

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

func TestWrap(t *testing.T) {
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	withCert := &tls.ConnectionState{PeerCertificates: []*x509.Certificate{{}}}
	cases := []struct {
		desc   string
		opts   Options
		method string
		auth   string
		tls    *tls.ConnectionState
		want   int
	}{
		{"read on a public address", Options{}, "GET", "", nil, 204},
		{"loopback without credentials configured", Options{Loopback: true}, "POST", "", nil, 204},
		{"public without credentials configured", Options{}, "POST", "", nil, 403},
		{"token configured, none sent", Options{TokenFile: token, Loopback: true}, "POST", "", nil, 401},
		{"wrong token", Options{TokenFile: token}, "POST", "Bearer nope", nil, 401},
		{"right token", Options{TokenFile: token}, "POST", "Bearer s3cret", nil, 204},
		{"token in the wrong scheme", Options{TokenFile: token}, "POST", "Basic s3cret", nil, 401},
		{"client certificate", Options{ClientCerts: true}, "DELETE", "", withCert, 204},
		{"TLS without a client certificate", Options{ClientCerts: true}, "POST", "", &tls.ConnectionState{}, 401},
		{"missing token file", Options{TokenFile: filepath.Join(t.TempDir(), "gone")}, "POST", "Bearer s3cret", nil, 500},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			r := httptest.NewRequest(c.method, "/api/reload", nil)
			if c.auth != "" {
				r.Header.Set("Authorization", c.auth)
			}
			r.TLS = c.tls
			w := httptest.NewRecorder()
			Wrap(ok, c.opts).ServeHTTP(w, r)
			if w.Code != c.want {
				t.Fatalf("status %d, want %d: %s", w.Code, c.want, w.Body)
			}
		})
	}
}
