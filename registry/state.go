// Package registry owns where pools, models, listeners and endpoints come
// from (HCL files, Consul) and merges every source into one immutable,
// versioned State. Consumers (the picker, the xDS translator) only ever read
// a *State and wait for the next one; they never mutate it.
//
// Data flows one way: each Source sends its full contribution as an Update;
// the Manager merges the latest Update of every source (Merge), checks the
// result (Validate), and publishes it with Version+1 through a Publisher,
// which consumers read as a View. A source that fails to refresh, or a
// merged state that does not validate, never replaces the last good state.
// The HCL file source lives in registry/hclfile.
package registry

import (
	"sort"
	"time"
)

// Engine names a model-server metrics dialect.
type Engine string

// The engines whose metrics the picker knows how to read.
const (
	EngineVLLM      Engine = "vllm"
	EngineSGLang    Engine = "sglang"
	EngineTRTLLM    Engine = "trtllm-serve"
	EngineTritonTRT Engine = "triton-tensorrt-llm"
)

// Engines lists every supported engine, in documentation order.
var Engines = []Engine{EngineVLLM, EngineSGLang, EngineTRTLLM, EngineTritonTRT}

// FailureMode says what Envoy does with a pool's requests when the picker is
// unreachable.
type FailureMode string

const (
	// FailClosed answers 5xx quickly when the picker is down (the default).
	FailClosed FailureMode = "fail_closed"
	// FailOpen keeps serving through the cluster's fallback load balancer.
	FailOpen FailureMode = "fail_open"
)

// Endpoint is one model server in a pool.
type Endpoint struct {
	// Address is the canonical "ip:port" ("[v6]:port" for IPv6) Envoy and the
	// picker use to name this endpoint; it is unique within a pool.
	Address string
	// Source names the provider that contributed the endpoint, e.g.
	// "file" or "consul".
	Source string
	// Models lists model names and LoRA adapters the endpoint advertises
	// (from Consul meta); empty means "whatever the pool serves".
	Models []string
	// MetricsPath overrides the pool's metrics path for this endpoint.
	MetricsPath string
	// Draining endpoints get no new requests and are removed from EDS.
	Draining bool
	// Critical is set by a discovery source on an endpoint that is still
	// registered but fails its health checks (a critical Consul check).
	// The Manager never publishes a Critical endpoint: it leaves it out,
	// or, while the pool's discovery guard holds it, publishes it with
	// Held instead.
	Critical bool
	// Held marks a published endpoint that its source reports Critical
	// but that the pool's discovery guard keeps routable for a grace
	// period (see Guard): too many of the pool's endpoints failed at once
	// for it to be believable (a restarted Consul agent re-registers its
	// services with critical checks until they first pass).
	Held bool
	// ScrapeFailing is set from the health input: the picker's metrics
	// scrapes of this endpoint are failing. xDS leaves such endpoints out
	// of EDS unless every endpoint of the pool fails, and the guard stops
	// holding them.
	ScrapeFailing bool
	// Role is the part of a disaggregated request the endpoint serves
	// (RoleBoth when unset); it matters only in a pool with a
	// Disaggregation policy. A decode endpoint's Address is its sidecar's.
	Role Role
	// KVEvents, when non-nil, overrides the pool's KVEvents for this
	// endpoint (Consul meta kv_events_port, an endpoint block's kv_events).
	KVEvents *KVEvents
}

// KVEvents says a server publishes its KV-cache events (vLLM
// --kv-events-config with the zmq publisher): the picker subscribes to
// them and routes by what each server's cache holds exactly, instead of
// estimating it. Ports are on the endpoint's own IP.
type KVEvents struct {
	// Port is the ZMQ PUB port (vLLM's "endpoint": "tcp://*:PORT").
	Port int
	// ReplayPort is the ZMQ ROUTER replay port ("replay_endpoint"); 0
	// when the server has none (missed events then cannot be recovered).
	ReplayPort int
	// Topic is the subscription prefix ("topic"); "" receives every topic.
	Topic string
}

// EffectiveKVEvents returns the endpoint's KV-events settings in pool p
// (its own, else the pool's), or nil when it publishes none.
func (e *Endpoint) EffectiveKVEvents(p *Pool) *KVEvents {
	if e.KVEvents != nil {
		return e.KVEvents
	}
	return p.KVEvents
}

// Pool is a set of interchangeable model servers behind one Envoy cluster.
type Pool struct {
	Name        string
	Engine      Engine
	Endpoints   []Endpoint // sorted by Address
	FailureMode FailureMode
	// MetricsPath is the HTTP path scraped on every endpoint ("/metrics").
	MetricsPath string
	// Scheduling is the pool's scheduler configuration; nil means defaults.
	Scheduling *Scheduling
	// DeclRange is where the pool was declared ("file:line:column"), for
	// diagnostics ("" if not from a file).
	DeclRange string
	// UpstreamAPIKey, when set, is the API key the picker sends to the
	// pool's servers (Authorization: Bearer), read from the file or
	// environment variable the configuration names. It is a secret: it is
	// never logged, shown or written to the store.
	UpstreamAPIKey string
	// Consul, when non-nil, says the pool's members (also) come from
	// Consul: the instances of this service the consul source finds.
	Consul *ConsulSelector
	// Guard, when non-nil, overrides the discovery guard's defaults.
	Guard *Guard
	// Admission is the pool's admission queue configuration; nil means
	// the defaults (on). The picker owns its meaning (picker/admission).
	Admission *Admission
	// Disaggregation, when non-nil, serves the pool's requests split
	// between prefill and decode servers (see Role); nil: whole requests,
	// endpoint roles ignored.
	Disaggregation *Disaggregation
	// KVEvents, when non-nil, says the pool's servers publish KV-cache
	// events (an endpoint may override it); nil: none do.
	KVEvents *KVEvents
}

// Admission configures a pool's admission queue: when every eligible
// endpoint is saturated, requests wait in the picker, highest priority
// first and fairly between flows, instead of queueing on the servers.
// Zero values mean the picker's defaults.
type Admission struct {
	// Disabled forwards saturated requests at once (sheddable ones get
	// 429), as before admission control.
	Disabled bool
	// MaxQueued and MaxQueuedBytes bound the pool's waiting requests and
	// their bodies; BandMaxQueued bounds each priority band.
	MaxQueued      int
	MaxQueuedBytes int64
	BandMaxQueued  int
	// TTL is the longest a request waits; NoEndpointWait the longest it
	// waits while the pool has no ready endpoint at all.
	TTL            time.Duration
	NoEndpointWait time.Duration
	// Fairness shares a band between flows: "tokens" or "round-robin".
	Fairness string
	// QueueSheddable queues sheddable requests (priority < 0) in the
	// lowest band when the pool is saturated. By default they get 429 at
	// once, as the Endpoint Picker Protocol says.
	QueueSheddable bool
	// FlowHeader names a trusted request header whose value is the
	// request's flow (tenant) for fairness; "" puts all in one flow.
	FlowHeader string
	// PriorityHeader names a request header that may override the model's
	// priority, clamped to [PriorityMin, PriorityMax]; "" ignores it.
	PriorityHeader           string
	PriorityMin, PriorityMax int
}

// Admission limits the registry enforces.
const (
	// MaxAdmissionTTL bounds TTL and NoEndpointWait: Envoy lets the
	// picker extend its message timeout only so far (xds sets the bound).
	MaxAdmissionTTL = 5 * time.Minute
)

// Fairness policies an admission block may name.
var fairnessNames = []string{"tokens", "round-robin"}

// Guard is a pool's discovery guard, Envoy's panic threshold applied to
// discovery: when one update would take more than Threshold of the pool's
// ready endpoints out for failing health checks (Endpoint.Critical), or
// all of them, the Manager keeps them published (Endpoint.Held) for Grace,
// as long as their own metrics scrapes succeed, and logs and reports it.
// Deliberate removals (deregistration, a configuration edit, draining)
// are never held.
type Guard struct {
	// Threshold is the share of ready endpoints (0..1) that may fail at
	// once before the guard holds them; 1 holds only when all fail.
	Threshold float64
	// Grace is how long endpoints are held; 0 disables the guard.
	Grace time.Duration
}

// Guard defaults.
const (
	DefaultGuardThreshold = 0.5
	DefaultGuardGrace     = 30 * time.Second
)

// EffectiveGuard returns the pool's guard settings with defaults filled in.
func (p *Pool) EffectiveGuard() Guard {
	if p.Guard != nil {
		return *p.Guard
	}
	return Guard{Threshold: DefaultGuardThreshold, Grace: DefaultGuardGrace}
}

// Scheduling configures how the picker chooses an endpoint in a pool. The
// picker owns the meaning of profiles and scorer names; the registry only
// carries them.
type Scheduling struct {
	// Profile names a built-in profile ("default", "weighted",
	// "predicted-ttft", "round-robin", "random", "least-queue",
	// "least-request").
	Profile string
	// Scorers overrides scorer weights by scorer name.
	Scorers map[string]float64
	// Picker is "max-score" or "weighted-random".
	Picker string
	// ScrapeIntervalMS is the metrics scrape interval (0 = default).
	ScrapeIntervalMS int
	// IdleScrapeIntervalMS is the scrape interval of an endpoint the
	// picker sends nothing (0 = default, 20x the scrape interval).
	IdleScrapeIntervalMS int
	// Saturation thresholds; zero means the picker's default.
	QueueThreshold int
	KVThreshold    float64
	// Metrics overrides the engine's metric names, keyed by logical name
	// ("waiting", "running", "kv_usage", "lora_info", "cache_config").
	Metrics map[string]string
	// SessionHeader is the request header used for session affinity.
	SessionHeader string
	// AdaptersOnDemand says the pool's servers load LoRA adapters when a
	// request names one (vLLM's runtime LoRA loading): any endpoint may
	// then serve any of the pool's adapters. Otherwise a model or adapter
	// goes only to servers that list it.
	AdaptersOnDemand bool
}

// Target is one weighted rewrite destination of a model.
type Target struct {
	Name   string
	Weight int
}

// Model maps a client-visible model name onto a pool.
type Model struct {
	Name string
	Pool string
	// Priority < 0 marks the model's requests sheddable.
	Priority int
	// Targets, when non-empty, rewrite the request's model to one of these
	// names chosen by weight.
	Targets []Target
	// DeclRange is where the model was declared ("file:line:column"), for
	// diagnostics ("" if not from a file).
	DeclRange string
	// Disaggregation, when non-nil, replaces the pool's policy for this
	// model's requests (its pool must have one).
	Disaggregation *Disaggregation
}

// Sheddable reports whether requests for this model may be shed with 429.
func (m *Model) Sheddable() bool { return m.Priority < 0 }

// Listener is an Envoy listener that serves client traffic.
type Listener struct {
	Name    string
	Address string // "ip:port"
	// DeclRange is where the listener was declared ("file:line:column"),
	// for diagnostics ("" if not from a file).
	DeclRange string
}

// Routing holds settings that apply to every request.
type Routing struct {
	// DefaultPool, when set, receives requests for unknown models instead
	// of a 404, and header-only requests such as GET /v1/models.
	DefaultPool string
}

// State is one immutable, merged view of every source. Version increases by
// one for every change that is published.
type State struct {
	Version   uint64
	Pools     map[string]*Pool
	Models    map[string]*Model
	Listeners []Listener // sorted by Name
	Routing   Routing
	// Replicas are the switchyard processes serving this configuration
	// side by side (sorted by Address): Envoy's picker cluster lists them
	// all, and they share their picks. Empty: one switchyard, which lists
	// itself.
	Replicas []Replica
	// ReplicaDiscovery says how replicas find each other (nil: no
	// replicas block).
	ReplicaDiscovery *ReplicaDiscovery
	// Tenants are the gateway's clients, keyed by name (nil when there
	// are none); when there is any, every request must carry one of their
	// API keys.
	Tenants map[string]*Tenant
	// TenantSettings is the tenants block (zero without one).
	TenantSettings TenantSettings
}

// Replica is one switchyard process of an active-active set.
type Replica struct {
	// ID names the replica (its Consul service ID, or its address).
	ID string
	// Address is the replica's picker (ext_proc gRPC) "ip:port" as Envoys
	// and the other replicas reach it.
	Address string
	// Admin is the replica's admin "ip:port" ("" if unknown).
	Admin string
	// XDS is the replica's ADS "ip:port" ("" if unknown).
	XDS string
	// Source names the provider that contributed it ("file", "consul").
	Source string
}

// ReplicaDiscovery is the configuration's replicas block.
type ReplicaDiscovery struct {
	// ConsulService, when set, is the Consul service every replica
	// registers itself as, and whose passing instances are the replicas.
	ConsulService string
	// DeclRange is where the block was declared ("file:line:column").
	DeclRange string
}

// Empty returns a State with no pools, models or listeners.
func Empty() *State {
	return &State{Pools: map[string]*Pool{}, Models: map[string]*Model{}}
}

// PoolNames returns the pool names in sorted order.
func (s *State) PoolNames() []string {
	names := make([]string, 0, len(s.Pools))
	for n := range s.Pools {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// ModelNames returns the model names in sorted order.
func (s *State) ModelNames() []string {
	names := make([]string, 0, len(s.Models))
	for n := range s.Models {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// ConsulSelector chooses the Consul service instances that become a pool's
// endpoints (see registry/consul for the service-meta convention).
type ConsulSelector struct {
	// Service is the Consul service name (required).
	Service string
	// Tag, when set, keeps only instances carrying this tag.
	Tag string
	// Datacenter, when set, queries that datacenter instead of the agent's.
	Datacenter string
	// PassingOnly keeps only instances whose every health check passes.
	PassingOnly bool
}
