package testutil

import (
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestEnvoyPoolBootstrap: the bootstrap carries each setting where Envoy
// reads it, and Envoy itself accepts it (--mode validate).
func TestEnvoyPoolBootstrap(t *testing.T) {
	for _, c := range []struct {
		name string
		p    EnvoyPool
		want []string
	}{
		{"defaults", EnvoyPool{Name: "alpha", Endpoints: []string{"127.0.0.1:8001", "127.0.0.1:8002"}, Picker: "127.0.0.1:9002"},
			[]string{"exact: alpha}", "cluster: pool/alpha, timeout: 30s}", "timeout: 10s}", "message_timeout: 10s\n",
				"request_body_mode: FULL_DUPLEX_STREAMED", "port_value: 9002}}}}]}]",
				"address: 127.0.0.1, port_value: 8001}}}\n        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8002}}}\n"}},
		{"timeouts", EnvoyPool{Name: "fleet", Endpoints: []string{"127.0.0.1:8001"}, Picker: "127.0.0.1:9002",
			Processing: "                request_body_mode: BUFFERED", RouteTimeout: 300 * time.Second, ExtProcTimeout: 60 * time.Second,
			MessageTimeout: 300 * time.Millisecond, MaxMessageTimeout: 360 * time.Second},
			[]string{"cluster: pool/fleet, timeout: 300s}", "timeout: 60s}", "message_timeout: 0.3s\n              max_message_timeout: 360s\n",
				"response_header_mode: SEND\n                request_body_mode: BUFFERED\n"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := envoyPoolBootstrap(t, c.p, 9901, 10000)
			if missing := ContainsAll(cfg, c.want...); len(missing) > 0 {
				t.Fatalf("bootstrap lacks %q:\n%s", missing, cfg)
			}
			if strings.Contains(cfg, "$") {
				t.Fatalf("bootstrap has an unreplaced placeholder:\n%s", cfg)
			}
			path := WriteFile(t, t.TempDir(), "envoy.yaml", cfg)
			if out, err := exec.Command(EnvoyPath(t), "--mode", "validate", "-c", path, "-l", "error").CombinedOutput(); err != nil {
				t.Fatalf("envoy rejects the bootstrap: %v\n%s\n%s", err, out, cfg)
			}
		})
	}
}
