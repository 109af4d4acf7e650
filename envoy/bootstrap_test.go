package envoy

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/testutil"
)

func TestBootstrapRendersParams(t *testing.T) {
	out, err := Bootstrap(Params{NodeID: "edge-7", XDSHost: "10.0.0.9", XDSPort: 18123, AdminPort: 19001})
	if err != nil {
		t.Fatal(err)
	}
	if missing := testutil.ContainsAll(out,
		"id: edge-7 # @node_id",
		"address: 10.0.0.9 # @xds_host",
		"port_value: 18123 # @xds_port",
		"port_value: 19001 # @admin_port",
		"address: 127.0.0.1 # @admin_host", // untouched default
	); len(missing) > 0 {
		t.Fatalf("rendered bootstrap lacks %q:\n%s", missing, out)
	}
	if strings.Contains(out, "port_value: 18000") {
		t.Fatalf("default xDS port survived rendering:\n%s", out)
	}
}

func TestBootstrapRejectsBadPort(t *testing.T) {
	if _, err := Bootstrap(Params{XDSPort: 70000}); err == nil {
		t.Fatal("port 70000 accepted")
	}
}

func TestBootstrapQuotesOddValues(t *testing.T) {
	out, err := Bootstrap(Params{NodeID: "a b#c"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `id: "a b#c" # @node_id`) {
		t.Fatalf("node id not quoted:\n%s", out)
	}
}

// TestBootstrapValidatesInEnvoy checks both the shipped file and a rendered
// one with Envoy's own config validation.
func TestBootstrapValidatesInEnvoy(t *testing.T) {
	envoy := testutil.EnvoyPath(t)
	dir := t.TempDir()
	rendered, err := Bootstrap(Params{NodeID: "validate", XDSPort: 18999, AdminPort: 19999})
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"shipped.yaml": Template(), "rendered.yaml": rendered} {
		path := testutil.WriteFile(t, dir, name, content)
		cmd := exec.Command(envoy, "--mode", "validate", "-c", path, "-l", "warning", "--use-dynamic-base-id")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("envoy --mode validate %s: %v\n%s", filepath.Base(path), err, b)
		}
	}
}
