package probe

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestCheck(t *testing.T) {
	ready := true
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-r.Context().Done()
			return
		}
		if !ready {
			http.Error(w, "draining", http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	ctx := context.Background()

	if err := Check(ctx, srv.URL+"/readyz", Options{}); err != nil {
		t.Errorf("ready server: %v", err)
	}
	ready = false
	err := Check(ctx, srv.URL+"/readyz", Options{})
	if err == nil || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "draining") {
		t.Errorf("unready server: got %v, want an error naming 503 and the body", err)
	}
	start := time.Now()
	if err := Check(ctx, srv.URL+"/slow", Options{Timeout: 100 * time.Millisecond}); err == nil {
		t.Error("a server that does not answer passed the probe")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the probe took %v despite a 100ms timeout", d)
	}
	for _, bad := range []string{"", "127.0.0.1:9090/readyz", "ftp://x/y", "http:///readyz"} {
		if err := Check(ctx, bad, Options{}); err == nil {
			t.Errorf("Check(%q) = nil, want an error", bad)
		}
	}

	// Nothing listening: connection refused is a failure, not a hang.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	if err := Check(ctx, "http://"+addr+"/health", Options{}); err == nil {
		t.Error("a closed port passed the probe")
	}
}

func TestCheckTLS(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	if err := Check(context.Background(), srv.URL, Options{}); err == nil {
		t.Error("an unverifiable certificate passed without Insecure")
	}
	if err := Check(context.Background(), srv.URL, Options{Insecure: true}); err != nil {
		t.Errorf("Insecure: %v", err)
	}
}

// Flag wraps a failed check as Failed (the -probe flags exit 1 for it) and
// passes a 2xx answer.
func TestFlag(t *testing.T) {
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer ok.Close()
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer bad.Close()
	if err := Flag(context.Background(), ok.URL); err != nil {
		t.Errorf("2xx: %v", err)
	}
	err := Flag(context.Background(), bad.URL)
	if !errors.As(err, new(Failed)) {
		t.Errorf("503: %v (%T), want Failed", err, err)
	}
}
