// Package ir owns the intermediate model between switchyard's registry state
// and Envoy resources. Build turns a registry.State plus Options into plain,
// sorted, fully defaulted structs; it never imports Envoy protos, so every
// routing decision (which routes exist, in what order, which pool fails open)
// is made here and can be tested without Envoy. The translator package turns
// a Config into Envoy resources.
package ir

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strconv"
	"time"

	"github.com/switchyard/switchyard/internal/contract"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/registry"
)

// Well-known names shared with the picker, defined once in
// internal/contract.
const (
	// PoolHeader is the request header the picker sets to the chosen pool.
	PoolHeader = contract.PoolHeader
	// LBNamespace is the dynamic metadata namespace override_host reads.
	LBNamespace = contract.LBNamespace
	// SubsetHintNamespace carries the subset hint to the picker.
	SubsetHintNamespace = contract.SubsetHintNamespace
	// DestinationKey is the metadata key holding the picked "ip:port" list.
	DestinationKey = contract.DestinationKey
	// ServedKey is the metadata key Envoy fills with the host it served from.
	ServedKey = contract.ServedKey
	// PickerCluster is the Envoy cluster name of the picker's gRPC server.
	PickerCluster = contract.PickerCluster
	// TracingCluster is the OTLP collector Envoy sends its spans to.
	TracingCluster = contract.TracingCluster
	// PickerHealthService is the gRPC health service Envoy checks on the
	// picker; it turns SERVING once the picker has pool state.
	PickerHealthService = contract.PickerHealthService
	// ModelNamespace and ModelKey name the dynamic metadata Envoy fills
	// itself, without the picker, with the request body's top-level
	// "model" (the client's name, before any rewrite): routes for requests
	// the picker did not process match on it, so a request reaches only
	// its own model's pool when the picker is unavailable.
	ModelNamespace = contract.ModelNamespace
	ModelKey       = contract.ModelKey
	// PDNamespace is the dynamic metadata of the picker's prefill/decode
	// decision, kept for access logs.
	PDNamespace = contract.PDNamespace
)

// StrippedRequestHeaders are the request headers Envoy removes from every
// request before the picker sees it: the prefill/decode routing headers a
// decode server's sidecar acts on (pd.ClientHeaders). The picker sets
// them itself; a request that bypasses it (a fail_open pool while the
// picker is down) must not carry a client's.
var StrippedRequestHeaders = pd.ClientHeaders

// Sentinel errors returned (wrapped, joined) by Build and Validate.
var (
	ErrBadAddress    = errors.New("invalid ip:port address")
	ErrDuplicateName = errors.New("duplicate name")
	ErrEmptyName     = errors.New("empty name")
)

// ClusterName returns the Envoy cluster name of a pool: the cluster picked
// requests go to, where only the picker's choice selects a host.
func ClusterName(pool string) string { return "pool/" + pool }

// FailOpenClusterName returns the name of a fail-open pool's second
// cluster, which shares the pool's endpoints (EDS resource ClusterName) and
// balances the requests the picker did not process by least request.
func FailOpenClusterName(pool string) string { return "pool/" + pool + "/fail-open" }

// ListenerName returns the Envoy listener name of a registry listener.
func ListenerName(listener string) string { return "listener/" + listener }

// RouteConfigName returns the RDS route configuration name of a listener.
func RouteConfigName(listener string) string { return "listener/" + listener + "/routes" }

// Options are the translation settings that do not come from the registry.
// Zero values mean the documented default.
type Options struct {
	// PickerAddr is the picker's ext_proc gRPC address as Envoy reaches it,
	// "ip:port" (default 127.0.0.1:9002), used when the state lists no
	// replicas (State.Replicas, which then all are).
	PickerAddr string
	// PickerConnectTimeout bounds connecting to the picker (default 1s).
	PickerConnectTimeout time.Duration
	// PickerHealthInterval is how often Envoy health-checks the picker,
	// healthy or not, with or without traffic (default 100ms). An idle
	// Envoy notices a dead picker within PickerUnhealthyThreshold
	// intervals (refused connections fail at once); with traffic the
	// first refused stream ejects it at once. A restarted picker is used
	// again within one interval of answering SERVING.
	PickerHealthInterval time.Duration
	// PickerHealthTimeout bounds one health check (default 1s). With
	// PickerUnhealthyThreshold it sets the longest stall (a GC pause, a
	// busy VM not scheduling the process) a picker survives: checks that
	// time out mark it unhealthy only after threshold x (timeout +
	// interval), about 3.3 s by default.
	PickerHealthTimeout time.Duration
	// PickerUnhealthyThreshold is how many health checks in a row must
	// fail (refused, reset or timed out) before Envoy stops using the
	// picker (default 3). A NOT_SERVING answer (draining, not ready yet)
	// takes it out at once.
	PickerUnhealthyThreshold uint32
	// PickerStreamRetries is how often Envoy retries opening an ext_proc
	// stream on another picker when the one it chose cannot be reached
	// or resets the stream before answering (default 3): a request whose
	// picker died before it answered is picked by another replica
	// instead of failing.
	PickerStreamRetries uint32
	// PickerEjectionTime is the outlier-detection base ejection time of
	// the picker (default 1s). A passing health check unejects the picker
	// sooner, so this only bounds how long a picker whose health checks
	// cannot run stays ejected.
	PickerEjectionTime time.Duration
	// MessageTimeout bounds ext_proc messages that are not part of a
	// full-duplex body exchange (default 10s). Envoy applies no message
	// timeout to FULL_DUPLEX_STREAMED bodies.
	MessageTimeout time.Duration
	// UpstreamConnectTimeout bounds connecting to a model server (default 2s).
	UpstreamConnectTimeout time.Duration
	// MaxRequests raises each pool cluster's circuit breakers (connections,
	// pending and active requests; default 100000).
	MaxRequests uint32
	// PickerMaxStreams raises the picker cluster's circuit breakers: every
	// request in flight holds one ext_proc stream for its whole response,
	// and a stream Envoy cannot open because a threshold is reached fails
	// the request (fail-closed) or bypasses the picker (fail-open) without
	// the picker ever seeing it. Envoy's default is 1,024 (default here
	// 100000 per Envoy).
	PickerMaxStreams uint32
	// ModelBodyLimit is the largest request body Envoy reads itself to
	// find the model when the picker is unavailable, set as the
	// listeners' per-connection buffer limit (default 4 MiB; Envoy's own
	// default is 1 MiB). Without the picker a larger body gets 413.
	ModelBodyLimit uint32
	// NumRetries is how often a request is retried on another endpoint when
	// no byte reached the first one (default 2; see DisableRetries).
	NumRetries uint32
	// DisableRetries turns retries off entirely.
	DisableRetries bool
	// PickerTLS, when set, makes Envoy talk to the picker over mutual TLS
	// (the picker then requires it). Nil: plaintext.
	PickerTLS *PickerTLS
	// Tracing, when set, makes every listener trace requests with Envoy's
	// OpenTelemetry tracer and propagate the trace to the picker and the
	// model servers. Nil: Envoy does not trace.
	Tracing *TracingOptions
	// Listener holds the defaults for every listener.
	Listener ListenerOptions
	// PerListener overrides Listener for the listener of that name; zero
	// fields fall back to Listener.
	PerListener map[string]ListenerOptions
}

// ListenerOptions are per-listener settings.
type ListenerOptions struct {
	// StreamIdleTimeout resets a stream that moved no byte for this long
	// (default 5m). LLM streams send a chunk per token, so this only fires
	// for stuck requests.
	StreamIdleTimeout time.Duration
	// RouteTimeout bounds a whole upstream request including the streamed
	// response; 0 (the default) means no limit, because LLM generations
	// can legitimately run for many minutes.
	RouteTimeout time.Duration
	// AccessLog writes one stdout access-log line per request.
	AccessLog bool
}

// Defaults for Options.
const (
	DefaultPickerAddr               = "127.0.0.1:9002"
	DefaultPickerConnectTimeout     = time.Second
	DefaultPickerHealthInterval     = 100 * time.Millisecond
	DefaultPickerHealthTimeout      = time.Second
	DefaultPickerUnhealthyThreshold = 3
	DefaultPickerStreamRetries      = 3
	DefaultPickerEjectionTime       = time.Second
	DefaultMessageTimeout           = 10 * time.Second
	DefaultUpstreamConnectTimeout   = 2 * time.Second
	DefaultMaxRequests              = 100000
	DefaultPickerMaxStreams         = 100000
	DefaultModelBodyLimit           = 4 << 20
	DefaultNumRetries               = 2
	DefaultStreamIdleTimeout        = 5 * time.Minute
)

// WithDefaults returns o with every zero field set to its default.
func (o Options) WithDefaults() Options {
	if o.PickerAddr == "" {
		o.PickerAddr = DefaultPickerAddr
	}
	if o.PickerConnectTimeout <= 0 {
		o.PickerConnectTimeout = DefaultPickerConnectTimeout
	}
	if o.PickerHealthInterval <= 0 {
		o.PickerHealthInterval = DefaultPickerHealthInterval
	}
	if o.PickerHealthTimeout <= 0 {
		o.PickerHealthTimeout = DefaultPickerHealthTimeout
	}
	if o.PickerUnhealthyThreshold == 0 {
		o.PickerUnhealthyThreshold = DefaultPickerUnhealthyThreshold
	}
	if o.PickerStreamRetries == 0 {
		o.PickerStreamRetries = DefaultPickerStreamRetries
	}
	if o.PickerEjectionTime <= 0 {
		o.PickerEjectionTime = DefaultPickerEjectionTime
	}
	if o.MessageTimeout <= 0 {
		o.MessageTimeout = DefaultMessageTimeout
	}
	if o.UpstreamConnectTimeout <= 0 {
		o.UpstreamConnectTimeout = DefaultUpstreamConnectTimeout
	}
	if o.MaxRequests == 0 {
		o.MaxRequests = DefaultMaxRequests
	}
	if o.PickerMaxStreams == 0 {
		o.PickerMaxStreams = DefaultPickerMaxStreams
	}
	if o.ModelBodyLimit == 0 {
		o.ModelBodyLimit = DefaultModelBodyLimit
	}
	if o.NumRetries == 0 {
		o.NumRetries = DefaultNumRetries
	}
	if o.DisableRetries {
		o.NumRetries = 0
	}
	if o.Listener.StreamIdleTimeout <= 0 {
		o.Listener.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	return o
}

// listener returns the effective settings for one listener.
func (o Options) listener(name string) ListenerOptions {
	l := o.Listener
	if p, ok := o.PerListener[name]; ok {
		if p.StreamIdleTimeout > 0 {
			l.StreamIdleTimeout = p.StreamIdleTimeout
		}
		if p.RouteTimeout > 0 {
			l.RouteTimeout = p.RouteTimeout
		}
		if p.AccessLog {
			l.AccessLog = true
		}
	}
	return l
}

// Config is the whole intermediate model: everything Envoy needs, sorted.
type Config struct {
	Picker Picker
	// Tracing is Envoy's tracing (nil: off).
	Tracing   *Tracing
	Listeners []Listener // sorted by Name
	Pools     []Pool     // sorted by Name
	// DefaultFailOpen is the fail-open cluster that takes requests the
	// picker did not process whose model no pool declares (or that have no
	// model), when Routing.DefaultPool fails open; "" answers them 503.
	DefaultFailOpen string
	// Warnings are non-fatal translation notes worth logging.
	Warnings []string
}

// Picker is the picker's gRPC cluster and the ext_proc filter settings.
type Picker struct {
	ClusterName string
	// Addresses are every replica's picker address (sorted), or this
	// switchyard's alone when no replicas are configured. Envoy gets them
	// through EDS, so replicas joining and leaving change only endpoints.
	Addresses      []Address
	ConnectTimeout time.Duration
	HealthInterval time.Duration
	HealthTimeout  time.Duration
	// UnhealthyThreshold is how many failed health checks in a row take
	// a picker out (Options.PickerUnhealthyThreshold).
	UnhealthyThreshold uint32
	HealthService      string
	EjectionTime       time.Duration
	// StreamRetries is how often Envoy retries opening an ext_proc
	// stream elsewhere (Options.PickerStreamRetries).
	StreamRetries  uint32
	MessageTimeout time.Duration
	// MaxMessageTimeout bounds how long the picker may ask Envoy to wait
	// for its answer (override_message_timeout): a request waiting in an
	// admission queue asks for its TTL.
	MaxMessageTimeout time.Duration
	MaxStreams        uint32     // circuit-breaker thresholds (Options.PickerMaxStreams)
	TLS               *PickerTLS // nil: plaintext
}

// TracingOptions configure Envoy's tracing.
type TracingOptions struct {
	// Collector is the OTLP/gRPC collector as Envoy hosts reach it:
	// "ip:port", or "host:port" resolved by DNS.
	Collector string
	// ServiceName names Envoy's spans (default "envoy").
	ServiceName string
	// SamplePercent is the share of requests, 0 to 100, that Envoy
	// starts a trace for when the client sent no sampling decision.
	SamplePercent float64
}

// Tracing is Envoy's tracing as translated: the collector cluster and the
// tracer's settings.
type Tracing struct {
	ClusterName string
	// Host and Port are the collector; DNS is true when Host is a name.
	Host          string
	Port          uint32
	DNS           bool
	ServiceName   string
	SamplePercent float64
}

// PickerTLS says where each Envoy finds, on its own host, what it needs for
// mutual TLS with the picker: file-based SDS resources naming its client
// certificate and key, and the CA (plus the SANs) it accepts on the
// picker's certificate. Key material never travels over xDS; Envoy watches
// WatchDir and reloads the files when one is moved into it, so a rotation
// on the Envoy host needs no restart and no new configuration.
type PickerTLS struct {
	CertificateSDS    string // path of the SDS file with the client certificate
	CertificateSecret string // name of that secret
	ValidationSDS     string // path of the SDS file with the validation context
	ValidationSecret  string // name of that secret
	WatchDir          string // directory Envoy watches for moves
	// SNI is the server name Envoy sends; empty sends none.
	SNI string
}

// Address is a resolved socket address.
type Address struct {
	IP   string // textual IP, IPv6 without brackets
	Port uint32
}

// String returns the "ip:port" form ("[v6]:port" for IPv6).
func (a Address) String() string {
	return net.JoinHostPort(a.IP, strconv.FormatUint(uint64(a.Port), 10))
}

// Listener is one Envoy listener with its route table.
type Listener struct {
	Name            string // "listener/<registry name>"
	RouteConfigName string
	StatPrefix      string
	Address         Address
	// The ext_proc filter always lets a request continue when the picker
	// cannot be reached (failure_mode_allow); the routes decide what
	// happens to it (fail-open pool or 503), so the Listener resource does
	// not change when pools or their failure modes do.
	StreamIdleTimeout time.Duration
	AccessLog         bool
	// ModelBodyLimit bounds the body Envoy buffers to read the model
	// itself for requests the picker did not process (a filter after
	// ext_proc that picked requests skip).
	ModelBodyLimit uint32
	Routes         []Route // in match order
}

// Route is one route of a listener, matched in order.
type Route struct {
	Name string
	// PoolHeader, when set, requires header x-switchyard-pool == PoolHeader.
	PoolHeader string
	// Picked selects on whether the picker set envoy.lb destination
	// metadata: PickedYes requires it, PickedNo requires its absence,
	// PickedAny ignores it.
	Picked Picked
	// Models, when set, requires the request body's model (ModelNamespace
	// metadata, read by Envoy) to be one of these names.
	Models []string
	// Cluster is the target cluster; empty means Direct is answered.
	Cluster string
	Timeout time.Duration // 0 = none
	Retry   *Retry
	Direct  *DirectResponse
}

// Picked is a route's condition on the picker's destination metadata.
type Picked int

// Picked values.
const (
	PickedAny Picked = iota
	PickedYes
	PickedNo
)

// Retry is a route's retry policy.
type Retry struct {
	// On is Envoy's retry_on list. Only conditions where the upstream
	// cannot have started work are used, since LLM POSTs are not idempotent.
	On                       string
	NumRetries               uint32
	HostSelectionMaxAttempts int64
}

// DirectResponse is a response Envoy answers itself.
type DirectResponse struct {
	Status      uint32
	ContentType string
	Body        string
}

// Pool is one pool's Envoy clusters and its EDS endpoints.
type Pool struct {
	Name        string
	ClusterName string // picked requests; also the EDS resource name
	FailOpen    bool
	// FailOpenCluster, for a fail-open pool, balances the requests the
	// picker did not process over the same endpoints ("" otherwise).
	FailOpenCluster string
	// Models are the client-visible model names that map to this pool,
	// sorted: without the picker, Envoy routes on them.
	Models         []string
	ConnectTimeout time.Duration
	MaxRequests    uint32
	Endpoints      []Address // sorted by String()
}

// RetryOn is the retry_on list of pool routes: connection failures and
// resets before any request byte was written, plus HTTP/2 refused streams.
// None of these can have reached the model server's scheduler.
const RetryOn = "connect-failure,refused-stream,reset-before-request"

// NoPoolBody is the JSON body of the 404 answered when no pool matched.
const NoPoolBody = `{"error":{"type":"not_found_error","code":404,"message":"no model pool matched this request"}}`

// PickerUnavailableBody is the JSON body (the picker's error shape) of the
// 503 answered for a request the picker did not process, because it was
// unreachable or failed mid-request, when the request's pool fails closed.
const PickerUnavailableBody = `{"error":{"type":"service_unavailable","code":503,"message":"endpoint picker unavailable"}}`

// PickerUnavailableRoute names the route answering PickerUnavailableBody.
const PickerUnavailableRoute = "picker-unavailable"

// Build translates s into a Config. Draining endpoints and endpoints whose
// metrics scrapes fail (Endpoint.ScrapeFailing, the registry's health
// input) are left out of EDS, except that a pool whose every non-draining
// endpoint fails keeps them all: a picker that cannot scrape metrics must
// not black-hole a pool. A disaggregated pool's prefill servers are left
// out of EDS altogether: only the decode servers' sidecars contact them. Errors are joined; on error the returned Config
// must not be used.
func Build(s *registry.State, o Options) (*Config, error) {
	o = o.WithDefaults()
	var errs []error
	cfg := &Config{}

	if s == nil {
		s = registry.Empty()
	}
	var pickerAddrs []Address
	if len(s.Replicas) == 0 {
		a, err := ParseAddress(o.PickerAddr)
		if err != nil {
			errs = append(errs, fmt.Errorf("picker address: %w", err))
		}
		pickerAddrs = []Address{a}
	}
	for _, r := range s.Replicas {
		a, err := ParseAddress(r.Address)
		if err != nil {
			errs = append(errs, fmt.Errorf("replica %q: %w", r.ID, err))
			continue
		}
		pickerAddrs = append(pickerAddrs, a)
	}
	pickerAddrs, err := sortAddresses(pickerAddrs)
	if err != nil {
		errs = append(errs, fmt.Errorf("replicas: %w", err))
	}
	cfg.Picker = Picker{
		ClusterName:        PickerCluster,
		Addresses:          pickerAddrs,
		ConnectTimeout:     o.PickerConnectTimeout,
		HealthInterval:     o.PickerHealthInterval,
		HealthTimeout:      o.PickerHealthTimeout,
		UnhealthyThreshold: o.PickerUnhealthyThreshold,
		HealthService:      PickerHealthService,
		EjectionTime:       o.PickerEjectionTime,
		StreamRetries:      o.PickerStreamRetries,
		MessageTimeout:     o.MessageTimeout,
		// The longest admission wait a pool may configure, and a margin.
		MaxMessageTimeout: registry.MaxAdmissionTTL + time.Minute,
		MaxStreams:        o.PickerMaxStreams,
	}
	if t := o.Tracing; t != nil {
		tr, err := buildTracing(*t)
		if err != nil {
			errs = append(errs, err)
		} else {
			cfg.Tracing = tr
		}
	}
	if t := o.PickerTLS; t != nil {
		if t.CertificateSDS == "" || t.CertificateSecret == "" || t.ValidationSDS == "" || t.ValidationSecret == "" {
			errs = append(errs, errors.New("picker TLS: SDS paths and secret names are required"))
		}
		tc := *t
		cfg.Picker.TLS = &tc
	}
	models := map[string][]string{} // pool -> client model names
	for _, m := range s.ModelNames() {
		pool := s.Models[m].Pool
		models[pool] = append(models[pool], m)
	}

	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		if name == "" {
			errs = append(errs, fmt.Errorf("pool: %w", ErrEmptyName))
			continue
		}
		pool := Pool{
			Name:           name,
			ClusterName:    ClusterName(name),
			FailOpen:       p.FailureMode == registry.FailOpen,
			Models:         models[name],
			ConnectTimeout: o.UpstreamConnectTimeout,
			MaxRequests:    o.MaxRequests,
		}
		if pool.FailOpen {
			pool.FailOpenCluster = FailOpenClusterName(name)
		}
		var healthy, unhealthy []Address
		for _, ep := range p.Endpoints {
			a, err := ParseAddress(ep.Address)
			if err != nil {
				errs = append(errs, fmt.Errorf("pool %q endpoint: %w", name, err))
				continue
			}
			if a.String() != ep.Address {
				// override_host compares strings: the picker names this
				// endpoint ep.Address, Envoy knows it as a.String().
				cfg.Warnings = append(cfg.Warnings, fmt.Sprintf("pool %q endpoint %q is not in canonical form %q; picks of it will not match", name, ep.Address, a.String()))
			}
			if ep.Draining {
				continue
			}
			if p.Disaggregation != nil && !ep.Role.Decodes() {
				// A prefill server takes prefills from the sidecars, never
				// a client's request: not even a fail-open pool's
				// balancer may send it one.
				continue
			}
			if ep.ScrapeFailing {
				unhealthy = append(unhealthy, a)
				continue
			}
			healthy = append(healthy, a)
		}
		if len(healthy) == 0 && len(unhealthy) > 0 {
			cfg.Warnings = append(cfg.Warnings, fmt.Sprintf("pool %q: all %d endpoints are unhealthy; keeping them in EDS", name, len(unhealthy)))
			healthy = unhealthy
		}
		pool.Endpoints, err = sortAddresses(healthy)
		if err != nil {
			errs = append(errs, fmt.Errorf("pool %q: %w", name, err))
		}
		cfg.Pools = append(cfg.Pools, pool)
	}

	if d, ok := s.Pools[s.Routing.DefaultPool]; ok && d.FailureMode == registry.FailOpen {
		cfg.DefaultFailOpen = FailOpenClusterName(d.Name)
	}

	seen := map[string]bool{}
	for _, l := range s.Listeners {
		if l.Name == "" {
			errs = append(errs, fmt.Errorf("listener: %w", ErrEmptyName))
			continue
		}
		if seen[l.Name] {
			errs = append(errs, fmt.Errorf("listener %q: %w", l.Name, ErrDuplicateName))
			continue
		}
		seen[l.Name] = true
		a, err := ParseAddress(l.Address)
		if err != nil {
			errs = append(errs, fmt.Errorf("listener %q: %w", l.Name, err))
			continue
		}
		lo := o.listener(l.Name)
		cfg.Listeners = append(cfg.Listeners, Listener{
			Name:              ListenerName(l.Name),
			RouteConfigName:   RouteConfigName(l.Name),
			StatPrefix:        l.Name,
			Address:           a,
			StreamIdleTimeout: lo.StreamIdleTimeout,
			AccessLog:         lo.AccessLog,
			ModelBodyLimit:    o.ModelBodyLimit,
			Routes:            routes(cfg, o, lo),
		})
	}
	sort.Slice(cfg.Listeners, func(i, j int) bool { return cfg.Listeners[i].Name < cfg.Listeners[j].Name })

	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return cfg, nil
}

// routes builds a listener's route table:
//  1. one route per pool, matching x-switchyard-pool AND the picker's
//     envoy.lb destination metadata, so a client-sent header alone never
//     selects a pool;
//  2. requests without picker metadata passed ext_proc unprocessed (the
//     picker either picks or answers a request itself): it was
//     unreachable. Envoy has read the body's model into ModelNamespace
//     metadata, and each pool with models gets a route on its client
//     names: a fail-open pool's goes to its fail-open cluster, a
//     fail-closed pool's answers 503 JSON. A request is never served by
//     another pool than its model's;
//  3. unprocessed requests whose model no pool declares (or with no
//     model, or a body Envoy could not read) go to the default pool's
//     fail-open cluster when the default pool fails open, like the picker
//     would send them; otherwise they get the 503;
//  4. a catch-all 404 JSON answer (a pool the routes do not know yet).
func routes(cfg *Config, o Options, lo ListenerOptions) []Route {
	var retry *Retry
	if o.NumRetries > 0 {
		retry = &Retry{On: RetryOn, NumRetries: o.NumRetries, HostSelectionMaxAttempts: 5}
	}
	unavailable := &DirectResponse{Status: 503, ContentType: "application/json", Body: PickerUnavailableBody}
	var rs []Route
	for _, p := range cfg.Pools {
		rs = append(rs, Route{
			Name:       p.ClusterName,
			PoolHeader: p.Name,
			Picked:     PickedYes,
			Cluster:    p.ClusterName,
			Timeout:    lo.RouteTimeout,
			Retry:      retry,
		})
	}
	for _, p := range cfg.Pools {
		if len(p.Models) == 0 {
			continue
		}
		r := Route{Name: "unpicked/" + p.Name, Picked: PickedNo, Models: p.Models}
		if p.FailOpen {
			r.Cluster, r.Timeout, r.Retry = p.FailOpenCluster, lo.RouteTimeout, retry
		} else {
			r.Direct = unavailable
		}
		rs = append(rs, r)
	}
	if cfg.DefaultFailOpen != "" {
		rs = append(rs, Route{
			Name:    "unpicked/default",
			Picked:  PickedNo,
			Cluster: cfg.DefaultFailOpen,
			Timeout: lo.RouteTimeout,
			Retry:   retry,
		})
	} else {
		rs = append(rs, Route{Name: PickerUnavailableRoute, Picked: PickedNo, Direct: unavailable})
	}
	rs = append(rs, Route{
		Name:   "no-pool",
		Direct: &DirectResponse{Status: 404, ContentType: "application/json", Body: NoPoolBody},
	})
	return rs
}

// sortAddresses sorts by the "ip:port" string (the name Envoy and the
// picker use) and rejects duplicates.
func sortAddresses(as []Address) ([]Address, error) {
	type keyed struct {
		key string
		a   Address
	}
	ks := make([]keyed, len(as))
	for i, a := range as {
		ks[i] = keyed{a.String(), a}
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i].key < ks[j].key })
	out := make([]Address, len(ks))
	var errs []error
	for i, k := range ks {
		if i > 0 && k.key == ks[i-1].key {
			errs = append(errs, fmt.Errorf("endpoint %s: %w", k.key, ErrDuplicateName))
		}
		out[i] = k.a
	}
	return out, errors.Join(errs...)
}

// ParseAddress parses "ip:port" or "[v6]:port" into an Address. Host names
// are rejected: EDS endpoints and override_host need literal IPs.
func ParseAddress(s string) (Address, error) {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return Address{}, fmt.Errorf("%q: %w", s, ErrBadAddress)
	}
	if ap.Port() == 0 {
		return Address{}, fmt.Errorf("%q: port 0: %w", s, ErrBadAddress)
	}
	if ap.Addr().Zone() != "" {
		return Address{}, fmt.Errorf("%q: IPv6 zones are not supported: %w", s, ErrBadAddress)
	}
	return Address{IP: ap.Addr().String(), Port: uint32(ap.Port())}, nil
}

// buildTracing checks Envoy's tracing options.
func buildTracing(o TracingOptions) (*Tracing, error) {
	host, port, err := net.SplitHostPort(o.Collector)
	if err != nil || host == "" {
		return nil, fmt.Errorf("tracing collector %q: want host:port: %w", o.Collector, ErrBadAddress)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return nil, fmt.Errorf("tracing collector %q: bad port: %w", o.Collector, ErrBadAddress)
	}
	if o.SamplePercent < 0 || o.SamplePercent > 100 {
		return nil, fmt.Errorf("tracing sample percent %v: want 0 to 100", o.SamplePercent)
	}
	t := &Tracing{ClusterName: TracingCluster, Host: host, Port: uint32(p), ServiceName: o.ServiceName, SamplePercent: o.SamplePercent}
	if t.ServiceName == "" {
		t.ServiceName = "envoy"
	}
	if _, err := netip.ParseAddr(host); err != nil {
		t.DNS = true
	}
	return t, nil
}
