package quality

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// The harness can put a real Envoy in front of the simulators instead of
// its in-process data plane (SWITCHYARD_QUALITY_ENVOY=1), to check that
// the figures it measures are Envoy's. Envoy gets a static bootstrap
// wired as the xDS translator wires a pool: ext_proc to the picker in
// FULL_DUPLEX_STREAMED mode both ways with trailers, envoy.lb metadata
// forwarded and received, the pool's route matched on the picker's
// x-switchyard-pool header, and the pool cluster's override_host policy
// reading the picker's choice.

// envoyBootstrap's arguments: admin port, listener port, picker port,
// pool name, the pool's lb_endpoints.
const envoyBootstrap = `
node: {id: quality, cluster: quality}
admin: {address: {socket_address: {address: 127.0.0.1, port_value: %[1]d}}}
static_resources:
  listeners:
  - name: main
    address: {socket_address: {address: 127.0.0.1, port_value: %[2]d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/", headers: [{name: x-switchyard-pool, string_match: {exact: %[4]s}}]}
                route: {cluster: pool/%[4]s, timeout: 300s}
              - match: {prefix: "/"}
                direct_response: {status: 599, body: {inline_string: "no pool header"}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: picker}, timeout: 300s}
              failure_mode_allow: false
              message_timeout: 300s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {untyped: ["envoy.lb", "envoy.lb.subset_hint"]}
                receiving_namespaces: {untyped: ["envoy.lb"]}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: picker
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {max_concurrent_streams: 100000}}
    circuit_breakers: {thresholds: [{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}]}
    load_assignment:
      cluster_name: picker
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %[3]d}}}}]}]
  - name: pool/%[4]s
    type: STATIC
    connect_timeout: 1s
    circuit_breakers: {thresholds: [{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}]}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
            selected_host_key: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint-served}]}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin}
    load_assignment:
      cluster_name: pool/%[4]s
      endpoints:
      - lb_endpoints:
%[5]s`

// useEnvoy reports whether SWITCHYARD_QUALITY_ENVOY asks for Envoy.
func useEnvoy() bool { return os.Getenv("SWITCHYARD_QUALITY_ENVOY") == "1" }

// startEnvoyDataPlane starts Envoy in front of the model servers at
// addrs with the picker at pickerAddr, and returns its base URL.
func startEnvoyDataPlane(t testing.TB, pickerAddr string, addrs []string) string {
	t.Helper()
	envoy := testutil.EnvoyPath(t)
	var eps strings.Builder
	for _, a := range addrs {
		host, port, _ := strings.Cut(a, ":")
		fmt.Fprintf(&eps, "        - endpoint: {address: {socket_address: {address: %s, port_value: %s}}}\n", host, port)
	}
	_, pickerPort, _ := strings.Cut(pickerAddr, ":")
	listen := testutil.FreePort(t)
	cfg := fmt.Sprintf(envoyBootstrap, testutil.FreePort(t), listen, mustAtoi(t, pickerPort), poolName, eps.String())
	path := testutil.WriteFile(t, t.TempDir(), "envoy.yaml", cfg)
	testutil.Start(t, "envoy", envoy, "-c", path, "--disable-hot-restart", "-l", "warning", "--concurrency", "2")
	addr := fmt.Sprintf("127.0.0.1:%d", listen)
	testutil.WaitTCP(t, addr, 30*time.Second)
	return "http://" + addr
}

func mustAtoi(t testing.TB, s string) int {
	t.Helper()
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		t.Fatalf("port %q: %v", s, err)
	}
	return n
}
