package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestProbeCommand: the compose health check of a replica is
// `switchyard probe http://127.0.0.1:9090/readyz`; its exit code is what
// the engine reads.
func TestProbeCommand(t *testing.T) {
	t.Parallel()
	ready := make(chan bool, 1)
	ready <- true
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok := <-ready
		ready <- ok
		if !ok {
			http.Error(w, "draining", http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()

	if code, _, stderr := runCLI(t, "probe", srv.URL+"/readyz"); code != 0 {
		t.Errorf("probe of a ready server: exit %d, %s", code, stderr)
	}
	<-ready
	ready <- false
	if code, _, stderr := runCLI(t, "probe", "-timeout=1s", srv.URL+"/readyz"); code != 1 || !strings.Contains(stderr, "503") {
		t.Errorf("probe of an unready server: exit %d, stderr %q; want 1 and the status", code, stderr)
	}
	if code, _, _ := runCLI(t, "probe"); code != 2 {
		t.Errorf("probe without a URL: exit %d, want 2", code)
	}
	if code, _, _ := runCLI(t, "probe", "127.0.0.1:9090/readyz"); code != 1 {
		t.Errorf("probe of a URL without scheme: exit %d, want 1", code)
	}
	if code, stdout, _ := runCLI(t, "-h"); code != 0 || !strings.Contains(stdout, "switchyard probe URL") {
		t.Errorf("usage does not list probe:\n%s", stdout)
	}
}
