// Package status owns what a running switchyard reports about itself: one
// model, the Report, read from the components, and every view of it on the
// admin address. /api/status serves the Report as JSON, the status page
// (status.html) renders that JSON, and the Prometheus collector behind
// /metrics exports the same Report, so an endpoint's health or a pool's
// load is computed once for all three. The package also serves the
// liveness and readiness probes, the picker's decision records
// (/api/decisions) and a 15-minute history the page charts (/api/history).
//
// The JSON field names and metric names are a contract: the status page,
// the end-to-end tests and the Grafana dashboard in examples/grafana read
// them. testdata/report.json pins the JSON, and a test checks the
// dashboard against the collector.
package status

import (
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/registry"
)

// Report is everything switchyard knows about itself at one moment. The
// fields tagged json:"-" are exported to Prometheus only.
type Report struct {
	Time    time.Time `json:"time"`
	Version string    `json:"version"`
	// RegistryVersion is the version of the registry state in force.
	RegistryVersion uint64 `json:"registry_version"`
	// Ready is what /readyz answers; NotReady says why not.
	Ready    bool   `json:"ready"`
	NotReady string `json:"not_ready,omitempty"`
	// ConfigError is the latest refresh error of any source, or of the
	// merge (the last good configuration stays in force); "" when none.
	ConfigError string  `json:"config_error,omitempty"`
	Pools       []Pool  `json:"pools"`  // sorted by name
	Models      []Model `json:"models"` // sorted by name
	Picker      Picker  `json:"picker"`
	XDS         XDS     `json:"xds"`
	Envoys      []Envoy `json:"envoys"` // sorted by ID
	// ReplicaID names this switchyard among the replicas.
	ReplicaID string `json:"replica_id"`
	// Replicas are the switchyard replicas of the configuration (empty:
	// one switchyard), with this one's pick sharing to and from each.
	Replicas []Replica `json:"replicas"`
	Store    *Store    `json:"store,omitempty"` // nil without a store
	TLS      *TLS      `json:"tls,omitempty"`   // nil without TLS
	// Tenants are the configured tenants, their budgets and today's
	// usage (absent without tenants).
	Tenants []Tenant `json:"tenants,omitempty"`

	// Peers and Inbound are the pick-sharing streams as the mesh sees
	// them, by peer address and by announced replica ID (Replicas joins
	// them to the configuration's replicas).
	Peers   []peers.PeerStats    `json:"-"`
	Inbound []peers.InboundStats `json:"-"`
	// Consul is each Consul selector's latest query, sorted.
	Consul []ConsulSelector `json:"-"`
	// Objectives, Running and Decision are the picker's per-model counters
	// and decision-latency histogram; nil unless the Report was read with
	// them (see Sources.Read). EndpointLatency is the latency the router
	// measured per endpoint, read with them.
	Objectives      []picker.ObjectiveStats  `json:"-"`
	Running         map[string]int64         `json:"-"`
	Decision        *picker.Histogram        `json:"-"`
	EndpointLatency []picker.EndpointLatency `json:"-"`
	// Decisions describes the decision records (nil without a recorder).
	Decisions *Decisions `json:"decision_records,omitempty"`
}

// Decisions describes the picker's decision records (/api/decisions).
type Decisions struct {
	// Sample is the share of requests recorded; Kept how many records the
	// ring holds, Size how many it can hold (-decisions-buffer); Recorded
	// counts records since start, FileDropped those the JSON-lines file
	// missed.
	Sample      float64 `json:"sample"`
	Kept        int     `json:"kept"`
	Size        int     `json:"size"`
	Recorded    uint64  `json:"recorded"`
	FileDropped uint64  `json:"file_dropped"`
}

// Pool is one pool of the registry state in force.
type Pool struct {
	Name        string `json:"name"`
	Engine      string `json:"engine"`
	FailureMode string `json:"failure_mode"`
	// Saturated: every eligible endpoint is over its queue or KV threshold
	// (requests wait in the admission queue).
	Saturated bool `json:"saturated"`
	// Guard is set while the pool's discovery guard holds endpoints that
	// their source reports failing (too many failed at once).
	Guard *Guard `json:"guard,omitempty"`
	// Endpoints are the picker's endpoints of the pool, sorted by address.
	Endpoints []Endpoint `json:"endpoints"`

	// GuardActivations counts the holds the discovery guard started.
	GuardActivations uint64 `json:"-"`
	// Prefix is the pool's prefix-cache index; nil unless the Report was
	// read with the picker's observations.
	Prefix *Prefix `json:"-"`

	// Admission is the pool's admission queue (nil: admission off, or the
	// picker not running).
	Admission *Admission `json:"admission,omitempty"`
	// Queue is the admission queue's raw counters and wait histograms,
	// also of a queue that is off (nil: no queue).
	Queue *admission.Stats `json:"-"`
	// SaturatedShare is the share of ready endpoints over a threshold;
	// set only when the Report was read with the picker's observations.
	SaturatedShare *float64 `json:"-"`
	// KVTokenize is the pool's tokenization for the exact prefix index
	// (nil when none of its servers publishes KV events).
	KVTokenize *KVTokenize `json:"kv_tokenize,omitempty"`
	// PDDecisions counts a disaggregated pool's prefill/decode decisions
	// by decision ("split", or why a request went whole); nil for other
	// pools, and unless the Report was read with the picker's
	// observations.
	PDDecisions map[string]int64 `json:"pd_decisions,omitempty"`
}

// Admission is one pool's admission queue: its bounds, what waits now
// (by band and flow) and its counters.
type Admission struct {
	MaxQueued      int               `json:"max_queued"`
	MaxQueuedBytes int64             `json:"max_queued_bytes"`
	TTLMS          int64             `json:"ttl_ms"`
	Fairness       string            `json:"fairness"`
	Queued         int               `json:"queued"`
	QueuedBytes    int64             `json:"queued_bytes"`
	Waiting        []AdmissionFlow   `json:"waiting"`
	Enqueued       uint64            `json:"enqueued"`
	Dispatched     uint64            `json:"dispatched"`
	Cancelled      uint64            `json:"cancelled"`
	Rejected       map[string]uint64 `json:"rejected"`
	// WaitP90MS is the 90th percentile wait of dispatched requests (a
	// bucket bound; 0 when none waited).
	WaitP90MS float64 `json:"wait_p90_ms"`
}

// AdmissionFlow is one band and flow's waiting requests.
type AdmissionFlow struct {
	Priority int    `json:"priority"`
	Flow     string `json:"flow"`
	Requests int    `json:"requests"`
	Bytes    int64  `json:"bytes"`
}

// Guard is a pool's active discovery-guard hold.
type Guard struct {
	Held  []string  `json:"held"`
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
}

// Prefix describes a pool's prefix-cache index and its hits.
type Prefix struct {
	Entries int
	Bytes   int64
	// PromptBlocks are the KV blocks of the prompts routed in the pool,
	// MatchedBlocks those the chosen endpoint was believed to hold.
	PromptBlocks, MatchedBlocks int64
}

// Endpoint is one endpoint of a pool as the picker sees it.
type Endpoint struct {
	Address  string `json:"address"`
	Draining bool   `json:"draining"`
	// Held: its discovery source reports it failing, but the pool's
	// discovery guard keeps it routable for now.
	Held bool `json:"held,omitempty"`
	// NodeUnreachable: its discovery source cannot reach the agent that
	// checks it (Consul: the node's serfHealth is critical) while its own
	// checks last passed; it stays routable while its scrapes succeed.
	NodeUnreachable  bool  `json:"node_unreachable,omitempty"`
	InFlightRequests int64 `json:"in_flight_requests"`
	InFlightTokens   int64 `json:"in_flight_tokens"`
	Picked           int64 `json:"picked"`
	Served           int64 `json:"served"`
	// Healthy is false while the endpoint's metrics scrapes fail (it is
	// then withheld from Envoy if its pool has healthy endpoints), and
	// UnhealthyReason then says why. RoutedReason, set when such an
	// endpoint is not withheld, says why Envoy and the picker still
	// route to it.
	Healthy         bool   `json:"healthy"`
	UnhealthyReason string `json:"unhealthy_reason,omitempty"`
	RoutedReason    string `json:"routed_reason,omitempty"`
	// Scraped load; absent until the first successful scrape.
	Waiting      *int     `json:"waiting,omitempty"`
	Running      *int     `json:"running,omitempty"`
	KVCacheUsage *float64 `json:"kv_cache_usage,omitempty"`
	// KV-cache geometry and LoRA state as the server reports them (vLLM's
	// cache_config_info and lora_requests_info); absent when it does not.
	BlockSize       int      `json:"block_size,omitempty"`
	NumBlocks       int      `json:"num_blocks,omitempty"`
	MaxLoras        int      `json:"max_loras,omitempty"`
	RunningAdapters []string `json:"running_adapters,omitempty"`
	WaitingAdapters []string `json:"waiting_adapters,omitempty"`
	// Models the endpoint serves as the picker sees them, and where that
	// came from: "config" (a models list) or "server" (its /v1/models).
	// Absent while unknown: the endpoint then gets every model of its pool.
	Models     []string `json:"models,omitempty"`
	ModelsFrom string   `json:"models_from,omitempty"`
	// TTFT is the learned time-to-first-token model, for pools on the
	// predicted-ttft profile once a pick has been accounted there.
	TTFT *TTFT `json:"ttft,omitempty"`
	// KVEvents is the endpoint's KV-cache event stream, when its pool
	// declares one.
	KVEvents *KVEvents `json:"kv_events,omitempty"`
	// Scrape says how fresh the picker's view of the endpoint is and how
	// it is read; absent before the first scrape attempt.
	Scrape *Scrape `json:"scrape,omitempty"`

	// ScrapedAt is when the latest successful scrape finished (zero if
	// none yet).
	ScrapedAt time.Time `json:"-"`
}

// Scrape is how the picker reads an endpoint's metrics page and how old
// what it knows is.
type Scrape struct {
	// AgeMS is the age of the latest successful scrape (absent if none).
	AgeMS *float64 `json:"age_ms,omitempty"`
	// Stale: older than max_age_ms (scrapes failing or late, or never
	// succeeded); the picker then counts the endpoint's load as unknown.
	Stale    bool    `json:"stale"`
	MaxAgeMS float64 `json:"max_age_ms"`
	// IntervalMS is the time planned until the next scrape: the pool's
	// scrape_interval while the endpoint gets traffic, its
	// idle_scrape_interval while not, longer when the engine budget or
	// failures say so.
	IntervalMS float64 `json:"interval_ms"`
	// CostMS is how long the endpoint takes to answer a scrape (what the
	// engine budget is reckoned from); absent until measured.
	CostMS float64 `json:"cost_ms,omitempty"`
	// PageBytes is the size of the latest page read.
	PageBytes int `json:"page_bytes,omitempty"`
	// NameFilter says whether the server honours the name[] filter
	// (honoured, ignored, rejected; absent while unknown).
	NameFilter string `json:"name_filter,omitempty"`
	// From names the replica whose scrape this is (absent: this one's).
	From string `json:"from,omitempty"`
}

// Ready reports whether the endpoint can take requests: healthy and not
// draining.
func (e *Endpoint) Ready() bool { return e.Healthy && !e.Draining }

// TTFT is an endpoint's learned time-to-first-token model (milliseconds):
// the fixed part and the prefill per 1,000 uncached prompt tokens, the
// observations behind them, the prefill work in flight, and how far the
// predictions were from the first tokens observed.
type TTFT struct {
	BaseMS            float64 `json:"base_ms"`
	PrefillPer1kMS    float64 `json:"prefill_per_1k_tokens_ms"`
	Observations      float64 `json:"observations"`
	PrefillRequests   int64   `json:"prefill_requests"`
	PrefillTokens     int64   `json:"prefill_tokens"`
	Compared          int64   `json:"compared"`
	MeanErrorMS       float64 `json:"mean_error_ms"`
	MeanAbsoluteError float64 `json:"mean_absolute_error_ms"`
}

// KVEvents is an endpoint's KV-cache event stream: whether its view is
// exact (the picker routes by the server's own cache; otherwise the
// estimating prefix index stands in) and what the stream did.
type KVEvents struct {
	// State: "connecting", "synced" (exact), "partial" (the view began
	// after the server had cached blocks, or lost events beyond replay)
	// or "disconnected".
	State     string `json:"state"`
	Exact     bool   `json:"exact"`
	Connected bool   `json:"connected"`
	LastSeq   int64  `json:"last_seq"`
	// Blocks in the server's GPU cache; Media counts other media.
	Blocks int            `json:"blocks"`
	Media  map[string]int `json:"media,omitempty"`
	// Counters since start.
	Batches      int64 `json:"batches"`
	Gaps         int64 `json:"gaps"`
	Replayed     int64 `json:"replayed"`
	Lost         int64 `json:"lost"`
	Restarts     int64 `json:"restarts"`
	DecodeErrors int64 `json:"decode_errors"`
	Orphans      int64 `json:"orphans"`
	// Predictions checked against the cached tokens the server reported:
	// exact ones equal, over, under; lower bounds (a stable prefix the
	// server held in full) met.
	PredictionsAgreed  int64      `json:"predictions_agreed"`
	PredictionsOver    int64      `json:"predictions_over"`
	PredictionsUnder   int64      `json:"predictions_under"`
	PredictionsBounded int64      `json:"predictions_bounded"`
	LastMessage        *time.Time `json:"last_message,omitempty"`
	LastError          string     `json:"last_error,omitempty"`
}

// KVTokenize is a pool's request tokenization for the exact prefix index
// (the servers' /tokenize, cached, called in the background): how
// requests were keyed (their whole prompt, a stable prefix, neither yet,
// no stable prefix), the calls, the prefixes checked against whole
// prompts and the models whose prefixes are not used.
type KVTokenize struct {
	Hits         int64    `json:"cache_hits"`
	PrefixHits   int64    `json:"prefix_hits"`
	Misses       int64    `json:"misses"`
	Unkeyed      int64    `json:"unkeyed"`
	Calls        int64    `json:"calls"`
	Failures     int64    `json:"failures"`
	Dropped      int64    `json:"dropped"`
	CallSeconds  float64  `json:"call_seconds"`
	Verified     int64    `json:"verified"`
	Mismatches   int64    `json:"mismatches"`
	Unstable     []string `json:"unstable_models,omitempty"`
	CachedTokens int      `json:"cached_tokens"`
}

// Model is one model name a request may use.
type Model struct {
	Name     string `json:"name"`
	Pool     string `json:"pool"`
	Priority int    `json:"priority"`
	// Targets are the models it is rewritten to, if any, and
	// TargetWeights each one's weight (its share is weight / sum).
	Targets       []string       `json:"targets,omitempty"`
	TargetWeights []TargetWeight `json:"target_weights,omitempty"`
}

// TargetWeight is one rewrite target of a model and its weight.
type TargetWeight struct {
	Target string `json:"target"`
	Weight int    `json:"weight"`
}

// Picker holds the picker's process-wide request counters.
type Picker struct {
	Requests       int64 `json:"requests"`
	Picked         int64 `json:"picked"`
	Rewritten      int64 `json:"rewritten"`
	FallbackServed int64 `json:"fallback_served"`
	ResponseBodies int64 `json:"response_body_messages"`
	// PeerPicks counts the picks the other replicas shared with this one.
	PeerPicks int64 `json:"peer_picks"`
	// PeerReadings counts the scrape readings the other replicas shared
	// that this one published.
	PeerReadings int64 `json:"peer_readings"`
	// Rejected counts the picker's local replies by HTTP status.
	Rejected map[int]int64 `json:"rejected"`
}

// XDS describes the snapshot the xDS server serves.
type XDS struct {
	Version string `json:"version"`
	// Versions are the served version of each resource type: content
	// addresses, equal on every replica serving the same configuration.
	Versions        map[string]string `json:"versions"`
	RegistryVersion uint64            `json:"registry_version"`
	Snapshots       uint64            `json:"snapshots"`
	Failures        uint64            `json:"failures"`
	LastError       string            `json:"last_error,omitempty"`
	ACKs            uint64            `json:"acks"`
	NACKs           uint64            `json:"nacks"`
	Warnings        []string          `json:"warnings,omitempty"`
}

// Envoy is one Envoy node seen since start.
type Envoy struct {
	ID        string            `json:"id"`
	Cluster   string            `json:"cluster"`
	Streams   int               `json:"streams"` // 0: disconnected
	FirstSeen time.Time         `json:"first_seen"`
	LastSeen  time.Time         `json:"last_seen"`
	Acked     map[string]string `json:"acked"`
	ACKs      uint64            `json:"acks"`
	NACKs     uint64            `json:"nacks"`
	LastNACK  string            `json:"last_nack,omitempty"`
}

// Replica is one switchyard replica of the configuration.
type Replica struct {
	ID      string `json:"id"`
	Address string `json:"address"`
	Admin   string `json:"admin,omitempty"`
	XDS     string `json:"xds,omitempty"`
	Source  string `json:"source"`
	Self    bool   `json:"self"`
	// Sharing is true while this replica's picks stream to it; Sent and
	// Dropped count those events.
	Sharing bool   `json:"sharing"`
	Sent    uint64 `json:"events_sent"`
	Dropped uint64 `json:"events_dropped"`
	// From is the replica ID its stream to this one announced, and LagMS
	// the age of its latest batch on arrival (clocks of both hosts).
	From  string  `json:"from,omitempty"`
	LagMS float64 `json:"lag_ms,omitempty"`
	// Envoys are the node IDs of the Envoys whose ADS stream the replica
	// holds: this one's own, another's as its report said when last read
	// (EnvoysKnown false: not read, e.g. a static peer without an admin
	// address, or it did not answer).
	Envoys      []string `json:"envoys"`
	EnvoysKnown bool     `json:"envoys_known"`
	EnvoysError string   `json:"envoys_error,omitempty"`
}

// Store describes the store: where it is, what the start restored from
// it, and the picker-memory saves since.
type Store struct {
	Path      string    `json:"path"`
	LastError string    `json:"last_error,omitempty"`
	Restored  WarmCount `json:"restored"`
	// WarmSaves counts durable saves of the picker's memory; LastWarmSave
	// is when the latest finished.
	WarmSaves    int64     `json:"warm_saves"`
	LastWarmSave time.Time `json:"last_warm_save,omitzero"`
}

// WarmCount is what a start restored of the picker's memory.
type WarmCount struct {
	PrefixEndpoints int `json:"prefix_endpoints"`
	PrefixBlocks    int `json:"prefix_blocks"`
	Sessions        int `json:"sessions"`
	FailingEps      int `json:"failing_endpoints"`
}

// TLS describes the transport security of ADS and ext_proc.
type TLS struct {
	Origin      string    `json:"origin"`
	Subject     string    `json:"subject"`
	NotAfter    time.Time `json:"not_after"`
	Reloads     uint64    `json:"reloads"`
	AllowedSANs []string  `json:"allowed_sans,omitempty"`
	// Rejected counts refused handshakes by "server/reason".
	Rejected map[string]uint64 `json:"rejected"`
}

// ConsulSelector is the latest Consul query of one selector.
type ConsulSelector struct {
	Selector registry.ConsulSelector
	Up       bool
	// Instances is how many instances Consul's latest answer listed.
	Instances int
	// LastSuccess is when Consul last answered (zero if never).
	LastSuccess time.Time
}
