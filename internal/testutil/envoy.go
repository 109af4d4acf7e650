package testutil

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// EnvoyFullDuplex is the ext_proc body and trailer processing the xDS
// translator configures: FULL_DUPLEX_STREAMED both ways, trailers sent.
const EnvoyFullDuplex = `                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND`

// EnvoyPool describes the static Envoy that StartEnvoyPool runs in front
// of one pool and a picker, wired as the xDS translator wires a pool:
// ext_proc to the picker with envoy.lb metadata forwarded and received,
// the pool's route matched on the picker's x-switchyard-pool header, and
// the pool cluster's override_host policy reading the picker's choice
// (round robin when it names none). Connection and request limits are
// raised out of a load test's way.
type EnvoyPool struct {
	// Name is the pool's name: requests whose x-switchyard-pool header
	// says it go to cluster pool/Name; others get a 599.
	Name string
	// Endpoints are the pool's servers, host:port each.
	Endpoints []string
	// Picker is the picker's gRPC address, host:port.
	Picker string
	// Processing is the ext_proc settings after its header modes (SEND
	// both ways), indented as EnvoyFullDuplex is; EnvoyFullDuplex when
	// empty.
	Processing string
	// RouteTimeout bounds a request on the pool's route; 30 s when zero.
	RouteTimeout time.Duration
	// ExtProcTimeout is ext_proc's gRPC and message timeout; 10 s when
	// zero.
	ExtProcTimeout time.Duration
	// MessageTimeout, when set, is ext_proc's message timeout instead.
	MessageTimeout time.Duration
	// MaxMessageTimeout, when set, is how far the picker may extend the
	// message timeout (ext_proc's max_message_timeout).
	MaxMessageTimeout time.Duration
	// Concurrency is Envoy's worker thread count; 1 when zero.
	Concurrency int
}

// StartEnvoyPool starts Envoy (EnvoyPath) on a free loopback port as p
// describes, stops it when the test ends, and returns its base URL once
// it accepts connections.
func StartEnvoyPool(t testing.TB, p EnvoyPool) string {
	t.Helper()
	envoy := EnvoyPath(t)
	listen := FreePort(t)
	cfg := envoyPoolBootstrap(t, p, FreePort(t), listen)
	path := WriteFile(t, t.TempDir(), "envoy.yaml", cfg)
	Start(t, "envoy", envoy, "-c", path, "--disable-hot-restart", "-l", "warning", "--concurrency", fmt.Sprint(max(p.Concurrency, 1)))
	addr := fmt.Sprintf("127.0.0.1:%d", listen)
	WaitTCP(t, addr, 30*time.Second)
	return "http://" + addr
}

// envoyPoolBootstrap is p's Envoy 1.40 bootstrap with its admin and
// listener on adminPort and listen.
func envoyPoolBootstrap(t testing.TB, p EnvoyPool, adminPort, listen int) string {
	t.Helper()
	or := func(d, def time.Duration) string {
		if d <= 0 {
			d = def
		}
		return fmt.Sprintf("%gs", d.Seconds())
	}
	socket := func(hostPort string) string {
		host, port, err := net.SplitHostPort(hostPort)
		if err != nil {
			t.Fatalf("envoy pool %s: %v", p.Name, err)
		}
		return fmt.Sprintf("{socket_address: {address: %s, port_value: %s}}", host, port)
	}
	processing := p.Processing
	if processing == "" {
		processing = EnvoyFullDuplex
	}
	extProc := or(p.ExtProcTimeout, 10*time.Second)
	message := "message_timeout: " + extProc
	if p.MessageTimeout > 0 {
		message = "message_timeout: " + or(p.MessageTimeout, 0)
	}
	if p.MaxMessageTimeout > 0 {
		message += "\n              max_message_timeout: " + or(p.MaxMessageTimeout, 0)
	}
	var eps strings.Builder
	for _, a := range p.Endpoints {
		fmt.Fprintf(&eps, "        - endpoint: {address: %s}\n", socket(a))
	}
	r := strings.NewReplacer(
		"$ADMIN", fmt.Sprint(adminPort), "$LISTEN", fmt.Sprint(listen), "$POOL", p.Name,
		"$ROUTE_TIMEOUT", or(p.RouteTimeout, 30*time.Second), "$EXT_PROC_TIMEOUT", extProc,
		"$MESSAGE_TIMEOUT", message, "$PROCESSING", processing,
		"$PICKER", socket(p.Picker), "$ENDPOINTS", eps.String())
	return r.Replace(envoyPoolTemplate)
}

const envoyPoolTemplate = `
node: {id: switchyard-test, cluster: switchyard-test}
admin: {address: {socket_address: {address: 127.0.0.1, port_value: $ADMIN}}}
static_resources:
  listeners:
  - name: main
    address: {socket_address: {address: 127.0.0.1, port_value: $LISTEN}}
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
              - match: {prefix: "/", headers: [{name: x-switchyard-pool, string_match: {exact: $POOL}}]}
                route: {cluster: pool/$POOL, timeout: $ROUTE_TIMEOUT}
              - match: {prefix: "/"}
                direct_response: {status: 599, body: {inline_string: "no pool header"}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: picker}, timeout: $EXT_PROC_TIMEOUT}
              failure_mode_allow: false
              $MESSAGE_TIMEOUT
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
$PROCESSING
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
      endpoints: [{lb_endpoints: [{endpoint: {address: $PICKER}}]}]
  - name: pool/$POOL
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
      cluster_name: pool/$POOL
      endpoints:
      - lb_endpoints:
$ENDPOINTS`
