// Package translator owns the last translation stage: it turns an ir.Config
// into Envoy v3 resources (listeners, routes, clusters, endpoints) for the
// snapshot cache. It is the only switchyard package that builds Envoy
// protos; it makes no routing decisions of its own. Every resource is
// checked with its generated Validate() before it is returned.
package translator

import (
	"errors"
	"fmt"
	"sort"
	"time"

	xdscorev3 "github.com/cncf/xds/go/xds/core/v3"
	xdsmatcherv3 "github.com/cncf/xds/go/xds/type/matcher/v3"
	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	tracev3 "github.com/envoyproxy/go-control-plane/envoy/config/trace/v3"
	celv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3"
	streamv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	matchingv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/matching/v3"
	skipv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/common/matcher/action/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	headermutationv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_mutation/v3"
	jsonmetav3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/json_to_metadata/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	leastrequestv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	randomv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/random/v3"
	subsetv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/subset/v3"
	previoushostsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	metadatav3 "github.com/envoyproxy/go-control-plane/envoy/type/metadata/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/switchyard/switchyard/xds/ir"
)

// Resources are Envoy resources keyed by xDS type URL, each list sorted by
// resource name.
type Resources map[resource.Type][]types.Resource

// ProcessingMode is the ext_proc processing mode switchyard configures. It
// is the single place to change what Envoy sends the picker: headers and
// trailers in both directions, bodies as full-duplex streams (the Endpoint
// Picker Protocol requires FULL_DUPLEX_STREAMED, and Envoy requires the
// matching trailer mode to be SEND).
func ProcessingMode() *extprocv3.ProcessingMode {
	return &extprocv3.ProcessingMode{
		RequestHeaderMode:   extprocv3.ProcessingMode_SEND,
		RequestBodyMode:     extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		RequestTrailerMode:  extprocv3.ProcessingMode_SEND,
		ResponseHeaderMode:  extprocv3.ProcessingMode_SEND,
		ResponseBodyMode:    extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseTrailerMode: extprocv3.ProcessingMode_SEND,
	}
}

// Extension names used in the generated config.
const (
	hcmFilterName      = "envoy.filters.network.http_connection_manager"
	extProcFilterName  = "envoy.filters.http.ext_proc"
	routerFilterName   = "envoy.filters.http.router"
	overrideHostPolicy = "envoy.load_balancing_policies.override_host"
	leastRequestPolicy = "envoy.load_balancing_policies.least_request"
	subsetPolicy       = "envoy.load_balancing_policies.subset"
	randomPolicy       = "envoy.load_balancing_policies.random"
	jsonToMetadataName = "envoy.filters.http.json_to_metadata"
	celFilterName      = "envoy.access_loggers.extension_filters.cel"
	previousHostsName  = "envoy.retry_host_predicates.previous_hosts"
	httpProtocolKey    = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
	stdoutAccessLog    = "envoy.access_loggers.stdout"
	tlsSocketName      = "envoy.transport_sockets.tls"
	otelTracerName     = "envoy.tracers.opentelemetry"
)

// Translate builds every resource for cfg. It returns all problems joined;
// on error the Resources must not be published.
func Translate(cfg *ir.Config) (Resources, error) {
	t := &translation{res: Resources{}, tracing: cfg.Tracing}
	t.add(resource.ClusterType, t.pickerCluster(cfg.Picker))
	if cfg.Tracing != nil {
		t.add(resource.ClusterType, t.tracingCluster(cfg.Tracing))
	}
	t.add(resource.EndpointType, pickerAssignment(cfg.Picker))
	for _, p := range cfg.Pools {
		t.add(resource.ClusterType, t.poolCluster(p))
		if p.FailOpenCluster != "" {
			t.add(resource.ClusterType, t.failOpenCluster(p))
		}
		t.add(resource.EndpointType, loadAssignment(p))
	}
	for _, l := range cfg.Listeners {
		t.add(resource.ListenerType, t.listener(cfg.Picker, l))
		t.add(resource.RouteType, t.routeConfig(l))
	}
	for _, list := range t.res {
		sort.Slice(list, func(i, j int) bool { return resourceName(list[i]) < resourceName(list[j]) })
	}
	if err := errors.Join(t.errs...); err != nil {
		return nil, err
	}
	return t.res, nil
}

type translation struct {
	res  Resources
	errs []error
	// tracing is Envoy's tracing (nil: off).
	tracing *ir.Tracing
}

type validator interface{ Validate() error }

// add validates r and appends it under typ.
func (t *translation) add(typ resource.Type, r types.Resource) {
	if r == nil {
		return
	}
	if v, ok := r.(validator); ok {
		if err := v.Validate(); err != nil {
			t.errs = append(t.errs, fmt.Errorf("%s %q: %w", typ, resourceName(r), err))
			return
		}
	}
	t.res[typ] = append(t.res[typ], r)
}

// any packs m, recording a failure.
func (t *translation) any(m proto.Message) *anypb.Any {
	// Deterministic, so the same configuration always encodes to the same
	// bytes: xDS versions are hashes of the encoded resources.
	a := &anypb.Any{}
	err := anypb.MarshalFrom(a, m, proto.MarshalOptions{Deterministic: true})
	if err != nil {
		t.errs = append(t.errs, fmt.Errorf("pack %T: %w", m, err))
	}
	return a
}

func resourceName(r types.Resource) string {
	if n, ok := r.(interface{ GetName() string }); ok {
		return n.GetName()
	}
	if c, ok := r.(*endpointv3.ClusterLoadAssignment); ok {
		return c.GetClusterName()
	}
	return ""
}

func dur(d time.Duration) *durationpb.Duration { return durationpb.New(d) }

func socket(a ir.Address) *corev3.Address {
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address:       a.IP,
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: a.Port},
	}}}
}

func adsSource() *corev3.ConfigSource {
	return &corev3.ConfigSource{
		ResourceApiVersion:    corev3.ApiVersion_V3,
		ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
	}
}

// Flow-control windows Envoy advertises to the picker (what the picker may
// send back unacknowledged: streamed request and response bodies). They
// equal Envoy's defaults, stated so a change of defaults cannot shrink
// them; request bodies towards the picker are limited by the picker's own
// (gRPC server) windows instead.
const (
	pickerStreamWindow     = 16 << 20
	pickerConnectionWindow = 24 << 20
)

// pickerCluster is the picker's gRPC cluster: HTTP/2, actively health
// checked with the ext_proc gRPC health service, and with a panic threshold
// of 0 so that a dead picker has no host at all and ext_proc fails when it
// opens the stream, before any request body is sent.
//
// How fast Envoy stops and resumes using the picker:
//   - update_merge_window 0: Envoy merges host health changes that follow
//     another within this window (default 1s) and applies them only when
//     it ends. A crash soon after the picker came back (its unejection
//     starts a window) would then leave the ejected picker in use for up
//     to a second, every stream failing after its body was sent.
//   - a crash under traffic: the first refused or reset stream ejects the
//     picker (outlier detection below), at once, and that stream is
//     retried on another picker (extProc's retry policy).
//   - an idle crash: health checks every HealthInterval, healthy or not;
//     UnhealthyThreshold (3) refused connections in a row mark it
//     unhealthy, a few hundred milliseconds; NOT_SERVING does at once
//     (Envoy applies the threshold to network failures only).
//   - a stall (a stopped process, a GC pause, a VM not scheduled): its
//     connections stay up and its streams wait, so only health checks can
//     take it out. Each waits HealthTimeout (1s) and UnhealthyThreshold
//     must time out in a row, so a picker is taken out only after about
//     3 x (1s + HealthInterval) = 3.3 s without an answer; a stall of a
//     second or two delays requests and fails none.
//   - recovery: checks continue every HealthInterval while it is down; the
//     first SERVING answer marks it healthy and also lifts an outlier
//     ejection (successful_active_health_check_uneject_host).
func (t *translation) pickerCluster(p ir.Picker) *clusterv3.Cluster {
	h2 := &httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{
				Http2ProtocolOptions: &corev3.Http2ProtocolOptions{
					InitialStreamWindowSize:     wrapperspb.UInt32(pickerStreamWindow),
					InitialConnectionWindowSize: wrapperspb.UInt32(pickerConnectionWindow),
				},
			},
		}},
	}
	return &clusterv3.Cluster{
		Name:                          p.ClusterName,
		TransportSocket:               t.pickerTLS(p.TLS),
		ClusterDiscoveryType:          &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:              &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource()},
		ConnectTimeout:                dur(p.ConnectTimeout),
		TypedExtensionProtocolOptions: map[string]*anypb.Any{httpProtocolKey: t.any(h2)},
		// Every request in flight holds one ext_proc stream until its
		// response ends. Envoy's default thresholds (1,024) would fail or,
		// for fail-open pools, silently bypass the picker for every request
		// past them, and the picker would never know.
		CircuitBreakers: circuitBreakers(p.MaxStreams),
		HealthChecks: []*corev3.HealthCheck{{
			Timeout:                  dur(p.HealthTimeout),
			Interval:                 dur(p.HealthInterval),
			NoTrafficInterval:        dur(p.HealthInterval),
			NoTrafficHealthyInterval: dur(p.HealthInterval),
			UnhealthyInterval:        dur(p.HealthInterval),
			UnhealthyEdgeInterval:    dur(p.HealthInterval),
			HealthyEdgeInterval:      dur(p.HealthInterval),
			UnhealthyThreshold:       wrapperspb.UInt32(p.UnhealthyThreshold),
			HealthyThreshold:         wrapperspb.UInt32(1),
			HealthChecker: &corev3.HealthCheck_GrpcHealthCheck_{GrpcHealthCheck: &corev3.HealthCheck_GrpcHealthCheck{
				ServiceName: p.HealthService,
			}},
		}},
		CommonLbConfig: &clusterv3.Cluster_CommonLbConfig{
			HealthyPanicThreshold: &typev3.Percent{Value: 0},
			UpdateMergeWindow:     dur(0),
		},
		// Eject the picker on its first local-origin failure (connection
		// refused, reset, connect timeout), so a crashed picker stops being
		// tried at once instead of at the next health check: with no host
		// left, ext_proc fails when opening the stream, which is what makes
		// fail-open work. gRPC errors the picker returns on purpose never
		// eject it (consecutive 5xx enforcement is off). max_ejection_percent
		// 100 lets the only host be ejected (the default 10% would not).
		// A stalled picker has no local-origin failure (its connections and
		// streams stay open), so this never takes out a picker that is only
		// slow.
		OutlierDetection: &clusterv3.OutlierDetection{
			SplitExternalLocalOriginErrors:         true,
			ConsecutiveLocalOriginFailure:          wrapperspb.UInt32(1),
			EnforcingConsecutiveLocalOriginFailure: wrapperspb.UInt32(100),
			EnforcingConsecutive_5Xx:               wrapperspb.UInt32(0),
			EnforcingSuccessRate:                   wrapperspb.UInt32(0),
			Interval:                               dur(p.HealthInterval),
			BaseEjectionTime:                       dur(p.EjectionTime),
			MaxEjectionTime:                        dur(10 * p.EjectionTime),
			MaxEjectionPercent:                     wrapperspb.UInt32(100),
			SuccessfulActiveHealthCheckUnejectHost: wrapperspb.Bool(true),
		},
		// Kernel keepalive probes on idle picker connections, so a peer
		// that vanished without closing them (host down, NAT state lost) is
		// noticed. HTTP/2 PINGs would do it faster but gRPC-Go closes
		// connections that ping more often than its enforcement policy
		// allows, which would kill streams waiting on a long generation.
		UpstreamConnectionOptions: &clusterv3.UpstreamConnectionOptions{
			TcpKeepalive: &corev3.TcpKeepalive{
				KeepaliveTime:     wrapperspb.UInt32(30),
				KeepaliveInterval: wrapperspb.UInt32(5),
				KeepaliveProbes:   wrapperspb.UInt32(3),
			},
		},
	}
}

// pickerTLS is the picker cluster's mutual-TLS transport socket, nil for
// plaintext. Certificate, key and CA come from file-based SDS on the Envoy
// host (ir.PickerTLS says why); the same files serve the bootstrap's ADS
// cluster, so Envoy loads them once. ALPN h2 is stated because gRPC-Go
// refuses TLS connections that do not negotiate it. Health checks use this
// socket too.
func (t *translation) pickerTLS(p *ir.PickerTLS) *corev3.TransportSocket {
	if p == nil {
		return nil
	}
	source := func(path string) *corev3.ConfigSource {
		return &corev3.ConfigSource{
			ResourceApiVersion: corev3.ApiVersion_V3,
			ConfigSourceSpecifier: &corev3.ConfigSource_PathConfigSource{PathConfigSource: &corev3.PathConfigSource{
				Path:             path,
				WatchedDirectory: &corev3.WatchedDirectory{Path: p.WatchDir},
			}},
		}
	}
	ctx := &tlsv3.UpstreamTlsContext{
		Sni: p.SNI,
		CommonTlsContext: &tlsv3.CommonTlsContext{
			AlpnProtocols: []string{"h2"},
			TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{{
				Name: p.CertificateSecret, SdsConfig: source(p.CertificateSDS),
			}},
			ValidationContextType: &tlsv3.CommonTlsContext_ValidationContextSdsSecretConfig{
				ValidationContextSdsSecretConfig: &tlsv3.SdsSecretConfig{Name: p.ValidationSecret, SdsConfig: source(p.ValidationSDS)},
			},
		},
	}
	return &corev3.TransportSocket{
		Name:       tlsSocketName,
		ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: t.any(ctx)},
	}
}

// pickerAssignment lists every replica's picker (EDS of the picker
// cluster), so replicas joining or leaving change endpoints only.
func pickerAssignment(p ir.Picker) *endpointv3.ClusterLoadAssignment {
	loc := &endpointv3.LocalityLbEndpoints{}
	for _, a := range p.Addresses {
		loc.LbEndpoints = append(loc.LbEndpoints, lbEndpoint(a))
	}
	return &endpointv3.ClusterLoadAssignment{ClusterName: p.ClusterName, Endpoints: []*endpointv3.LocalityLbEndpoints{loc}}
}

// poolCluster is a pool's EDS cluster for picked requests, using
// override_host: the host comes only from the picker's envoy.lb metadata
// (never a client header) and the served host is written back to envoy.lb.
// Its fallback policy never returns a host: when none of the picked hosts
// is in the cluster any more (EDS removed them since the pick) or retries
// used them all, the request fails with 503 instead of going to a server
// the picker did not choose, which may not serve the model or adapter.
func (t *translation) poolCluster(p ir.Pool) *clusterv3.Cluster {
	oh := &overridehostv3.OverrideHost{
		OverrideHostSources: []*overridehostv3.OverrideHost_OverrideHostSource{{
			Metadata: metadataKey(ir.LBNamespace, ir.DestinationKey),
		}},
		SelectedHostKey: metadataKey(ir.LBNamespace, ir.ServedKey),
		FallbackPolicy:  t.noHostPolicy(),
	}
	return &clusterv3.Cluster{
		Name:                 p.ClusterName,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource()},
		ConnectTimeout:       dur(p.ConnectTimeout),
		LoadBalancingPolicy: &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
			TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: overrideHostPolicy, TypedConfig: t.any(oh)},
		}}},
		CircuitBreakers:               circuitBreakers(p.MaxRequests),
		TypedExtensionProtocolOptions: map[string]*anypb.Any{httpProtocolKey: t.any(http1())},
	}
}

// failOpenCluster is a fail-open pool's cluster for requests the picker did
// not process: the pool's endpoints (the same EDS resource, through
// service_name) balanced by least request.
func (t *translation) failOpenCluster(p ir.Pool) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 p.FailOpenCluster,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource(), ServiceName: p.ClusterName},
		ConnectTimeout:       dur(p.ConnectTimeout),
		LoadBalancingPolicy: &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
			TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: leastRequestPolicy, TypedConfig: t.any(&leastrequestv3.LeastRequest{})},
		}}},
		CircuitBreakers:               circuitBreakers(p.MaxRequests),
		TypedExtensionProtocolOptions: map[string]*anypb.Any{httpProtocolKey: t.any(http1())},
	}
}

// noHostPolicy is a load-balancing policy that never selects a host: a
// subset balancer whose only selector names a key no endpoint carries and
// that has no fallback. Envoy has no built-in "none" policy.
func (t *translation) noHostPolicy() *clusterv3.LoadBalancingPolicy {
	subset := &subsetv3.Subset{
		FallbackPolicy:  subsetv3.Subset_NO_FALLBACK,
		SubsetSelectors: []*subsetv3.Subset_LbSubsetSelector{{Keys: []string{"switchyard-no-fallback"}}},
		SubsetLbPolicy: &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
			TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: randomPolicy, TypedConfig: t.any(&randomv3.Random{})},
		}}},
	}
	return &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
		TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: subsetPolicy, TypedConfig: t.any(subset)},
	}}}
}

func http1() *httpv3.HttpProtocolOptions {
	return &httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_HttpProtocolOptions{
				HttpProtocolOptions: &corev3.Http1ProtocolOptions{},
			},
		}},
	}
}

// circuitBreakers sets every default-priority threshold to limit.
func circuitBreakers(limit uint32) *clusterv3.CircuitBreakers {
	l := wrapperspb.UInt32(limit)
	return &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
		Priority:           corev3.RoutingPriority_DEFAULT,
		MaxConnections:     l,
		MaxPendingRequests: l,
		MaxRequests:        l,
		MaxRetries:         l,
	}}}
}

func metadataKey(namespace, key string) *metadatav3.MetadataKey {
	return &metadatav3.MetadataKey{
		Key:  namespace,
		Path: []*metadatav3.MetadataKey_PathSegment{{Segment: &metadatav3.MetadataKey_PathSegment_Key{Key: key}}},
	}
}

func lbEndpoint(a ir.Address) *endpointv3.LbEndpoint {
	return &endpointv3.LbEndpoint{HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: socket(a)}}}
}

// loadAssignment is a pool's EDS resource; an empty pool has no endpoints
// (requests routed to it get 503 no healthy upstream).
func loadAssignment(p ir.Pool) *endpointv3.ClusterLoadAssignment {
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: p.ClusterName}
	if len(p.Endpoints) == 0 {
		return cla
	}
	loc := &endpointv3.LocalityLbEndpoints{}
	for _, a := range p.Endpoints {
		loc.LbEndpoints = append(loc.LbEndpoints, lbEndpoint(a))
	}
	cla.Endpoints = []*endpointv3.LocalityLbEndpoints{loc}
	return cla
}

// Retry backoff of an ext_proc stream that could not reach its picker:
// short, since the retry goes to another picker (previous_hosts), and the
// request waits for it.
const (
	pickerRetryBase = 5 * time.Millisecond
	pickerRetryMax  = 50 * time.Millisecond
)

// pickerStreamRetry is the ext_proc streams' retry policy. Envoy's gRPC
// client opens each stream through the picker cluster like any upstream
// request, so when the picker it chose refuses the connection (it died),
// or resets the stream before sending anything back (it died with the
// stream open, or the connection Envoy picked was already closing), the
// stream is opened again on another picker. With a retry policy the
// ext_proc filter makes Envoy keep a copy of what it sent on the stream
// (the request headers and the body streamed so far) until the picker's
// first answer, and replays it there; after that first answer nothing is
// kept and a reset fails the request as before. Only those transport
// failures are retried: a gRPC status the picker returns never is.
func (t *translation) pickerStreamRetry(p ir.Picker) *corev3.RetryPolicy {
	return &corev3.RetryPolicy{
		RetryOn:    "connect-failure,refused-stream,reset",
		NumRetries: wrapperspb.UInt32(p.StreamRetries),
		RetryBackOff: &corev3.BackoffStrategy{
			BaseInterval: dur(pickerRetryBase),
			MaxInterval:  dur(pickerRetryMax),
		},
		RetryHostPredicate: []*corev3.RetryPolicy_RetryHostPredicate{{
			Name:       previousHostsName,
			ConfigType: &corev3.RetryPolicy_RetryHostPredicate_TypedConfig{TypedConfig: t.any(&previoushostsv3.PreviousHostsPredicate{})},
		}},
		HostSelectionRetryMaxAttempts: 5,
	}
}

// extProc is the picker filter of every listener.
func (t *translation) extProc(p ir.Picker, l ir.Listener) *extprocv3.ExternalProcessor {
	return &extprocv3.ExternalProcessor{
		GrpcService: &corev3.GrpcService{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{
			ClusterName: p.ClusterName,
		}}, RetryPolicy: t.pickerStreamRetry(p)},
		// Always allow: a request the picker could not process continues
		// without its metadata and the routes decide (fail-open pool or a
		// 503), so editing pools never changes the Listener (which would
		// leave open connections on the old filter chain until drained).
		FailureModeAllow:  true,
		ProcessingMode:    ProcessingMode(),
		MessageTimeout:    dur(p.MessageTimeout),
		MaxMessageTimeout: dur(p.MaxMessageTimeout),
		AllowModeOverride: false,
		StatusOnError:     &typev3.HttpStatus{Code: typev3.StatusCode_ServiceUnavailable},
		MetadataOptions: &extprocv3.MetadataOptions{
			ForwardingNamespaces: &extprocv3.MetadataOptions_MetadataNamespaces{Untyped: []string{ir.LBNamespace, ir.SubsetHintNamespace}},
			ReceivingNamespaces:  &extprocv3.MetadataOptions_MetadataNamespaces{Untyped: []string{ir.LBNamespace, ir.PDNamespace}},
		},
	}
}

// stripFilterName names the listener's first filter: header_mutation,
// removing ir.StrippedRequestHeaders before the picker runs.
const stripFilterName = "switchyard.strip_client_headers"

// stripHeaders removes the prefill/decode routing headers from every
// request, ahead of the picker: the picker sets them for the requests it
// splits, and a request it does not process (a fail_open pool while it is
// down) reaches a sidecar without a client's. Unconditional, so editing
// pools never changes the listener.
func stripHeaders() *headermutationv3.HeaderMutation {
	m := &headermutationv3.Mutations{}
	for _, h := range ir.StrippedRequestHeaders {
		m.RequestMutations = append(m.RequestMutations, &mutationrulesv3.HeaderMutation{
			Action: &mutationrulesv3.HeaderMutation_Remove{Remove: h},
		})
	}
	return &headermutationv3.HeaderMutation{Mutations: m}
}

// modelFilterName names the listener's json_to_metadata filter, run only
// for requests the picker did not process.
const modelFilterName = "switchyard.request_model"

// modelFilter reads the request body's top-level "model" into
// ir.ModelNamespace metadata for requests that arrive without the picker's
// decision, so the routes can keep them in their own pool. It skips every
// request carrying x-switchyard-pool: the picker sets that header on each
// request it routes (and strips a client's), so picked requests are never
// buffered or parsed twice. A client that sends the header while the
// picker is down only loses the model routing: its request gets the
// picker-unavailable answer, never another pool.
func (t *translation) modelFilter(l ir.Listener) *matchingv3.ExtensionWithMatcher {
	jm := &jsonmetav3.JsonToMetadata{
		RequestRules: &jsonmetav3.JsonToMetadata_MatchRules{
			Rules: []*jsonmetav3.JsonToMetadata_Rule{{
				Selectors: []*jsonmetav3.JsonToMetadata_Selector{{Selector: &jsonmetav3.JsonToMetadata_Selector_Key{Key: "model"}}},
				OnPresent: &jsonmetav3.JsonToMetadata_KeyValuePair{MetadataNamespace: ir.ModelNamespace, Key: ir.ModelKey, Type: jsonmetav3.JsonToMetadata_STRING},
			}},
			// Clients label JSON bodies loosely (curl -d says form data);
			// the content is what counts, as for the picker.
			AllowContentTypesRegex: &matcherv3.RegexMatcher{Regex: ".*"},
			AllowEmptyContentType:  true,
		},
	}
	present := &xdsmatcherv3.Matcher_MatcherList_Predicate{MatchType: &xdsmatcherv3.Matcher_MatcherList_Predicate_SinglePredicate_{
		SinglePredicate: &xdsmatcherv3.Matcher_MatcherList_Predicate_SinglePredicate{
			Input: &xdscorev3.TypedExtensionConfig{Name: "picked", TypedConfig: t.any(&matcherv3.HttpRequestHeaderMatchInput{HeaderName: ir.PoolHeader})},
			Matcher: &xdsmatcherv3.Matcher_MatcherList_Predicate_SinglePredicate_ValueMatch{ValueMatch: &xdsmatcherv3.StringMatcher{
				MatchPattern: &xdsmatcherv3.StringMatcher_SafeRegex{SafeRegex: &xdsmatcherv3.RegexMatcher{
					EngineType: &xdsmatcherv3.RegexMatcher_GoogleRe2{GoogleRe2: &xdsmatcherv3.RegexMatcher_GoogleRE2{}},
					Regex:      ".*",
				}},
			}},
		},
	}}
	return &matchingv3.ExtensionWithMatcher{
		XdsMatcher: &xdsmatcherv3.Matcher{MatcherType: &xdsmatcherv3.Matcher_MatcherList_{MatcherList: &xdsmatcherv3.Matcher_MatcherList{
			Matchers: []*xdsmatcherv3.Matcher_MatcherList_FieldMatcher{{
				Predicate: present,
				OnMatch: &xdsmatcherv3.Matcher_OnMatch{OnMatch: &xdsmatcherv3.Matcher_OnMatch_Action{Action: &xdscorev3.TypedExtensionConfig{
					Name: "skip", TypedConfig: t.any(&skipv3.SkipFilter{}),
				}}},
			}},
		}}},
		ExtensionConfig: &corev3.TypedExtensionConfig{Name: jsonToMetadataName, TypedConfig: t.any(jm)},
	}
}

// pickerErrorReply gives the answers Envoy makes up when an ext_proc stream
// fails after the request body was sent to the picker (the picker died
// mid-request; failure_mode_allow cannot continue such a request) the
// picker's JSON error shape instead of an empty body. The picker's own
// answers have other details (switchyard_picker_*), so they are untouched.
func (t *translation) pickerErrorReply() *hcmv3.LocalReplyConfig {
	cel := &celv3.ExpressionFilter{Expression: "response.code == 503 && response.code_details.startsWith('ext_proc_error')"}
	return &hcmv3.LocalReplyConfig{Mappers: []*hcmv3.ResponseMapper{{
		Filter: &accesslogv3.AccessLogFilter{FilterSpecifier: &accesslogv3.AccessLogFilter_ExtensionFilter{ExtensionFilter: &accesslogv3.ExtensionFilter{
			Name:       celFilterName,
			ConfigType: &accesslogv3.ExtensionFilter_TypedConfig{TypedConfig: t.any(cel)},
		}}},
		Body: &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: ir.PickerUnavailableBody}},
		BodyFormatOverride: &corev3.SubstitutionFormatString{
			Format:      &corev3.SubstitutionFormatString_TextFormatSource{TextFormatSource: &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: "%LOCAL_REPLY_BODY%"}}},
			ContentType: "application/json",
		},
	}}}
}

func (t *translation) listener(p ir.Picker, l ir.Listener) *listenerv3.Listener {
	hcm := &hcmv3.HttpConnectionManager{
		CodecType:  hcmv3.HttpConnectionManager_AUTO,
		StatPrefix: l.StatPrefix,
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{
			ConfigSource:    adsSource(),
			RouteConfigName: l.RouteConfigName,
		}},
		StreamIdleTimeout: dur(l.StreamIdleTimeout),
		// Headers must arrive promptly (slow-loris protection); bodies and
		// streamed responses are governed by the stream idle timeout.
		RequestHeadersTimeout: dur(10 * time.Second),
		// Envoy is the edge: judge clients by their connection address,
		// never by a client-sent x-forwarded-for, and count no address as
		// internal. Every request is then external, so Envoy strips the
		// x-envoy-* headers a client could use to force retries of
		// non-idempotent LLM POSTs or change timeouts.
		UseRemoteAddress:      wrapperspb.Bool(true),
		InternalAddressConfig: &hcmv3.HttpConnectionManager_InternalAddressConfig{},
		HttpFilters: []*hcmv3.HttpFilter{
			{Name: stripFilterName, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: t.any(stripHeaders())}},
			{Name: extProcFilterName, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: t.any(t.extProc(p, l))}},
			{Name: modelFilterName, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: t.any(t.modelFilter(l))}},
			{Name: routerFilterName, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: t.any(&routerv3.Router{})}},
		},
		LocalReplyConfig: t.pickerErrorReply(),
		Tracing:          t.hcmTracing(),
	}
	if l.AccessLog {
		hcm.AccessLog = []*accesslogv3.AccessLog{{
			Name:       stdoutAccessLog,
			ConfigType: &accesslogv3.AccessLog_TypedConfig{TypedConfig: t.any(&streamv3.StdoutAccessLog{})},
		}}
	}
	addr := socket(l.Address)
	if l.Address.IP == "::" {
		// "[::]:port" means every address: accept IPv4 clients too.
		addr.GetSocketAddress().Ipv4Compat = true
	}
	return &listenerv3.Listener{
		Name:    l.Name,
		Address: addr,
		// The model filter buffers the body of a request the picker did
		// not process; Envoy answers 413 past this limit.
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(l.ModelBodyLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Filters: []*listenerv3.Filter{{
				Name:       hcmFilterName,
				ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: t.any(hcm)},
			}},
		}},
	}
}

func (t *translation) routeConfig(l ir.Listener) *routev3.RouteConfiguration {
	vh := &routev3.VirtualHost{Name: l.Name, Domains: []string{"*"}}
	for _, r := range l.Routes {
		vh.Routes = append(vh.Routes, t.route(r))
	}
	return &routev3.RouteConfiguration{Name: l.RouteConfigName, VirtualHosts: []*routev3.VirtualHost{vh}}
}

// oneOf matches a string value equal to one of names.
func oneOf(names []string) *matcherv3.ValueMatcher {
	exact := func(n string) *matcherv3.ValueMatcher {
		return &matcherv3.ValueMatcher{MatchPattern: &matcherv3.ValueMatcher_StringMatch{StringMatch: &matcherv3.StringMatcher{
			MatchPattern: &matcherv3.StringMatcher_Exact{Exact: n},
		}}}
	}
	if len(names) == 1 {
		return exact(names[0])
	}
	or := &matcherv3.OrMatcher{}
	for _, n := range names {
		or.ValueMatchers = append(or.ValueMatchers, exact(n))
	}
	return &matcherv3.ValueMatcher{MatchPattern: &matcherv3.ValueMatcher_OrMatch{OrMatch: or}}
}

func (t *translation) route(r ir.Route) *routev3.Route {
	m := &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}}
	if r.PoolHeader != "" {
		m.Headers = []*routev3.HeaderMatcher{{
			Name: ir.PoolHeader,
			HeaderMatchSpecifier: &routev3.HeaderMatcher_StringMatch{StringMatch: &matcherv3.StringMatcher{
				MatchPattern: &matcherv3.StringMatcher_Exact{Exact: r.PoolHeader},
			}},
		}}
	}
	if len(r.Models) > 0 {
		m.DynamicMetadata = append(m.DynamicMetadata, &matcherv3.MetadataMatcher{
			Filter: ir.ModelNamespace,
			Path:   []*matcherv3.MetadataMatcher_PathSegment{{Segment: &matcherv3.MetadataMatcher_PathSegment_Key{Key: ir.ModelKey}}},
			Value:  oneOf(r.Models),
		})
	}
	if r.Picked != ir.PickedAny {
		m.DynamicMetadata = append(m.DynamicMetadata, &matcherv3.MetadataMatcher{
			Filter: ir.LBNamespace,
			Path:   []*matcherv3.MetadataMatcher_PathSegment{{Segment: &matcherv3.MetadataMatcher_PathSegment_Key{Key: ir.DestinationKey}}},
			Value:  &matcherv3.ValueMatcher{MatchPattern: &matcherv3.ValueMatcher_PresentMatch{PresentMatch: true}},
			Invert: r.Picked == ir.PickedNo,
		})
	}
	out := &routev3.Route{Name: r.Name, Match: m}
	if r.Direct != nil {
		out.Action = &routev3.Route_DirectResponse{DirectResponse: &routev3.DirectResponseAction{
			Status: r.Direct.Status,
			Body:   &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: r.Direct.Body}},
		}}
		out.ResponseHeadersToAdd = []*corev3.HeaderValueOption{{
			Header:       &corev3.HeaderValue{Key: "content-type", Value: r.Direct.ContentType},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		}}
		return out
	}
	ra := &routev3.RouteAction{
		ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: r.Cluster},
		Timeout:          dur(r.Timeout),
	}
	if r.Retry != nil {
		ra.RetryPolicy = &routev3.RetryPolicy{
			RetryOn:    r.Retry.On,
			NumRetries: wrapperspb.UInt32(r.Retry.NumRetries),
			RetryHostPredicate: []*routev3.RetryPolicy_RetryHostPredicate{{
				Name:       previousHostsName,
				ConfigType: &routev3.RetryPolicy_RetryHostPredicate_TypedConfig{TypedConfig: t.any(&previoushostsv3.PreviousHostsPredicate{})},
			}},
			HostSelectionRetryMaxAttempts: r.Retry.HostSelectionMaxAttempts,
		}
	}
	out.Action = &routev3.Route_Route{Route: ra}
	return out
}

// hcmTracing is a listener's tracing: Envoy's OpenTelemetry tracer
// exporting to the collector cluster. Envoy starts a trace for the
// configured share of requests (or follows the client's traceparent),
// gives the ext_proc call to the picker a child span whose context it
// sends in the stream's gRPC metadata, and a span per upstream attempt
// whose traceparent the model server receives. Nil when tracing is off.
func (t *translation) hcmTracing() *hcmv3.HttpConnectionManager_Tracing {
	tr := t.tracing
	if tr == nil {
		return nil
	}
	otel := &tracev3.OpenTelemetryConfig{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: tr.ClusterName}},
			Timeout:         dur(time.Second),
		},
		ServiceName: tr.ServiceName,
	}
	return &hcmv3.HttpConnectionManager_Tracing{
		RandomSampling:    &typev3.Percent{Value: tr.SamplePercent},
		SpawnUpstreamSpan: wrapperspb.Bool(true),
		Provider: &tracev3.Tracing_Http{
			Name:       otelTracerName,
			ConfigType: &tracev3.Tracing_Http_TypedConfig{TypedConfig: t.any(otel)},
		},
	}
}

// tracingCluster is the OTLP/gRPC collector Envoy exports spans to: a
// static address, or a name Envoy resolves.
func (t *translation) tracingCluster(tr *ir.Tracing) *clusterv3.Cluster {
	h2 := &httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{Http2ProtocolOptions: &corev3.Http2ProtocolOptions{}},
		}},
	}
	typ := clusterv3.Cluster_STATIC
	if tr.DNS {
		typ = clusterv3.Cluster_STRICT_DNS
	}
	addr := &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address: tr.Host, PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: tr.Port},
	}}}
	return &clusterv3.Cluster{
		Name:                          tr.ClusterName,
		ClusterDiscoveryType:          &clusterv3.Cluster_Type{Type: typ},
		ConnectTimeout:                dur(time.Second),
		TypedExtensionProtocolOptions: map[string]*anypb.Any{httpProtocolKey: t.any(h2)},
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: tr.ClusterName,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: addr}},
			}}}},
		},
	}
}
