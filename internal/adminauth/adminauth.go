// Package adminauth owns who may change state through switchyard's admin
// HTTP server. Reading (GET, HEAD, OPTIONS: the status page, /api/status,
// /metrics, health) is open to whoever reaches the address. Any other
// method changes state and needs, when configured, the bearer token or a
// client certificate the TLS handshake verified; with neither configured
// it is allowed only when the admin server listens on loopback, and
// refused otherwise.
package adminauth

import (
	"bytes"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
)

// Options say what authorises a state-changing request.
type Options struct {
	// TokenFile holds the bearer token (surrounding whitespace ignored).
	// It is read on every state-changing request, so replacing the file
	// rotates the token.
	TokenFile string
	// ClientCerts accepts a request whose TLS connection presented a
	// client certificate (the server's tls.Config verified it).
	ClientCerts bool
	// Loopback is true when the admin server listens on loopback only.
	Loopback bool
	Logger   *slog.Logger
}

// Open reports whether state-changing requests need no credential (no
// token, no client certificates, loopback).
func (o Options) Open() bool { return o.TokenFile == "" && !o.ClientCerts && o.Loopback }

// Wrap returns h guarded by o.
func Wrap(h http.Handler, o Options) http.Handler {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			h.ServeHTTP(w, r)
			return
		}
		if o.Open() {
			h.ServeHTTP(w, r)
			return
		}
		if o.ClientCerts && r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			h.ServeHTTP(w, r)
			return
		}
		if o.TokenFile != "" {
			ok, err := tokenOK(o.TokenFile, r.Header.Get("Authorization"))
			if err != nil {
				o.Logger.Error("admin token file unreadable: refusing state-changing requests", "err", err)
				http.Error(w, "admin token unavailable\n", http.StatusInternalServerError)
				return
			}
			if ok {
				h.ServeHTTP(w, r)
				return
			}
		}
		o.Logger.Warn("refused state-changing admin request", "method", r.Method, "path", r.URL.Path, "peer", r.RemoteAddr)
		if o.TokenFile == "" && !o.ClientCerts {
			http.Error(w, "state-changing admin requests are refused on a non-loopback admin address without -admin-token-file or -admin-tls\n", http.StatusForbidden)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="switchyard admin"`)
		http.Error(w, "a bearer token or client certificate is required\n", http.StatusUnauthorized)
	})
}

func tokenOK(file, header string) (bool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return false, err
	}
	want := bytes.TrimSpace(b)
	if len(want) == 0 {
		return false, fmt.Errorf("%s is empty", file)
	}
	got, found := strings.CutPrefix(header, "Bearer ")
	if !found {
		return false, nil
	}
	return subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), want) == 1, nil
}
