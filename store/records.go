package store

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/switchyard/switchyard/registry"
)

// recordVersion is the version written in every JSON record's "v" field.
// A record with a different version fails to decode (and so marks the file
// corrupt) unless a schema migration rewrote it first.
const recordVersion = 1

// stateRecord is the on-disk form of a registry.State.
type stateRecord struct {
	V         int              `json:"v"`
	Version   uint64           `json:"version"`
	Pools     []poolRecord     `json:"pools"`
	Models    []modelRecord    `json:"models"`
	Listeners []listenerRecord `json:"listeners,omitempty"`
	Routing   routingRecord    `json:"routing"`
	// Replicas and ReplicaDiscovery are the replica set the state was
	// served with (a static peers list and the replicas Consul had): a
	// restart serves its persisted state before the sources answer, and
	// without them Envoy's picker cluster would list this replica alone.
	// Records written before they existed decode with none.
	Replicas         []replicaRecord         `json:"replicas,omitempty"`
	ReplicaDiscovery *replicaDiscoveryRecord `json:"replica_discovery,omitempty"`
}

type replicaRecord struct {
	ID      string `json:"id"`
	Address string `json:"address"`
	Admin   string `json:"admin,omitempty"`
	XDS     string `json:"xds,omitempty"`
	Source  string `json:"source,omitempty"`
}

type replicaDiscoveryRecord struct {
	ConsulService string `json:"consul_service,omitempty"`
	DeclRange     string `json:"decl_range,omitempty"`
}

type poolRecord struct {
	Name        string            `json:"name"`
	Engine      string            `json:"engine,omitempty"`
	Endpoints   []endpointRecord  `json:"endpoints"`
	FailureMode string            `json:"failure_mode,omitempty"`
	MetricsPath string            `json:"metrics_path,omitempty"`
	Scheduling  *schedulingRecord `json:"scheduling,omitempty"`
	DeclRange   string            `json:"decl_range,omitempty"`
	Consul      *consulRecord     `json:"consul,omitempty"`
	// Disaggregation and endpoint roles are kept so that a warm start
	// never sends a client's request to a prefill-only server.
	Disaggregation *disaggregationRecord `json:"disaggregation,omitempty"`
}

type consulRecord struct {
	Service     string `json:"service"`
	Tag         string `json:"tag,omitempty"`
	Datacenter  string `json:"datacenter,omitempty"`
	PassingOnly bool   `json:"passing_only,omitempty"`
}

type endpointRecord struct {
	Address     string   `json:"address"`
	Source      string   `json:"source,omitempty"`
	Models      []string `json:"models,omitempty"`
	MetricsPath string   `json:"metrics_path,omitempty"`
	Draining    bool     `json:"draining,omitempty"`
	Role        string   `json:"role,omitempty"`
}

type schedulingRecord struct {
	Profile          string             `json:"profile,omitempty"`
	Scorers          map[string]float64 `json:"scorers,omitempty"`
	Picker           string             `json:"picker,omitempty"`
	ScrapeIntervalMS int                `json:"scrape_interval_ms,omitempty"`
	IdleScrapeMS     int                `json:"idle_scrape_interval_ms,omitempty"`
	QueueThreshold   int                `json:"queue_threshold,omitempty"`
	KVThreshold      float64            `json:"kv_threshold,omitempty"`
	Metrics          map[string]string  `json:"metrics,omitempty"`
	SessionHeader    string             `json:"session_header,omitempty"`
}

type modelRecord struct {
	Name      string         `json:"name"`
	Pool      string         `json:"pool"`
	Priority  int            `json:"priority,omitempty"`
	Targets   []targetRecord `json:"targets,omitempty"`
	DeclRange string         `json:"decl_range,omitempty"`
	// Disaggregation is the model's own policy, if any.
	Disaggregation *disaggregationRecord `json:"disaggregation,omitempty"`
}

type disaggregationRecord struct {
	Disabled              bool   `json:"disabled,omitempty"`
	UncachedTokens        int    `json:"uncached_tokens,omitempty"`
	MinPromptTokens       int    `json:"min_prompt_tokens,omitempty"`
	PrefillQueueThreshold int    `json:"prefill_queue_threshold,omitempty"`
	DeclRange             string `json:"decl_range,omitempty"`
}

func fromDisaggregation(d *registry.Disaggregation) *disaggregationRecord {
	if d == nil {
		return nil
	}
	return &disaggregationRecord{Disabled: d.Disabled, UncachedTokens: d.UncachedTokens, MinPromptTokens: d.MinPromptTokens,
		PrefillQueueThreshold: d.PrefillQueueThreshold, DeclRange: d.DeclRange}
}

func (r *disaggregationRecord) toDisaggregation() *registry.Disaggregation {
	if r == nil {
		return nil
	}
	return &registry.Disaggregation{Disabled: r.Disabled, UncachedTokens: r.UncachedTokens, MinPromptTokens: r.MinPromptTokens,
		PrefillQueueThreshold: r.PrefillQueueThreshold, DeclRange: r.DeclRange}
}

type targetRecord struct {
	Name   string `json:"name"`
	Weight int    `json:"weight"`
}

type listenerRecord struct {
	Name      string `json:"name"`
	Address   string `json:"address"`
	DeclRange string `json:"decl_range,omitempty"`
}

type routingRecord struct {
	DefaultPool string `json:"default_pool,omitempty"`
}

// fromState converts s into its record; the record shares no memory with s.
func fromState(s *registry.State) stateRecord {
	r := stateRecord{V: recordVersion, Version: s.Version, Routing: routingRecord{DefaultPool: s.Routing.DefaultPool}}
	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		pr := poolRecord{
			Name:        name,
			Engine:      string(p.Engine),
			Endpoints:   make([]endpointRecord, 0, len(p.Endpoints)),
			FailureMode: string(p.FailureMode),
			MetricsPath: p.MetricsPath,
			DeclRange:   p.DeclRange,
		}
		for _, ep := range p.Endpoints {
			pr.Endpoints = append(pr.Endpoints, endpointRecord{
				Address:     ep.Address,
				Source:      ep.Source,
				Models:      slices.Clone(ep.Models),
				MetricsPath: ep.MetricsPath,
				Draining:    ep.Draining,
				Role:        string(ep.Role),
			})
		}
		pr.Disaggregation = fromDisaggregation(p.Disaggregation)
		if sc := p.Scheduling; sc != nil {
			pr.Scheduling = &schedulingRecord{
				Profile:          sc.Profile,
				Scorers:          maps.Clone(sc.Scorers),
				Picker:           sc.Picker,
				ScrapeIntervalMS: sc.ScrapeIntervalMS,
				IdleScrapeMS:     sc.IdleScrapeIntervalMS,
				QueueThreshold:   sc.QueueThreshold,
				KVThreshold:      sc.KVThreshold,
				Metrics:          maps.Clone(sc.Metrics),
				SessionHeader:    sc.SessionHeader,
			}
		}
		if c := p.Consul; c != nil {
			pr.Consul = &consulRecord{Service: c.Service, Tag: c.Tag, Datacenter: c.Datacenter, PassingOnly: c.PassingOnly}
		}
		r.Pools = append(r.Pools, pr)
	}
	for _, name := range s.ModelNames() {
		m := s.Models[name]
		mr := modelRecord{Name: name, Pool: m.Pool, Priority: m.Priority, DeclRange: m.DeclRange}
		mr.Disaggregation = fromDisaggregation(m.Disaggregation)
		for _, t := range m.Targets {
			mr.Targets = append(mr.Targets, targetRecord{Name: t.Name, Weight: t.Weight})
		}
		r.Models = append(r.Models, mr)
	}
	for _, l := range s.Listeners {
		r.Listeners = append(r.Listeners, listenerRecord{Name: l.Name, Address: l.Address, DeclRange: l.DeclRange})
	}
	for _, rp := range s.Replicas {
		r.Replicas = append(r.Replicas, replicaRecord{ID: rp.ID, Address: rp.Address, Admin: rp.Admin, XDS: rp.XDS, Source: rp.Source})
	}
	if d := s.ReplicaDiscovery; d != nil {
		r.ReplicaDiscovery = &replicaDiscoveryRecord{ConsulService: d.ConsulService, DeclRange: d.DeclRange}
	}
	return r
}

// toState converts a record back into a registry.State.
func (r *stateRecord) toState() *registry.State {
	s := registry.Empty()
	s.Version = r.Version
	s.Routing = registry.Routing{DefaultPool: r.Routing.DefaultPool}
	for _, pr := range r.Pools {
		p := &registry.Pool{
			Name:        pr.Name,
			Engine:      registry.Engine(pr.Engine),
			Endpoints:   make([]registry.Endpoint, 0, len(pr.Endpoints)),
			FailureMode: registry.FailureMode(pr.FailureMode),
			MetricsPath: pr.MetricsPath,
			DeclRange:   pr.DeclRange,
		}
		for _, er := range pr.Endpoints {
			p.Endpoints = append(p.Endpoints, registry.Endpoint{
				Address:     er.Address,
				Source:      er.Source,
				Models:      er.Models,
				MetricsPath: er.MetricsPath,
				Draining:    er.Draining,
				Role:        registry.Role(er.Role),
			})
		}
		p.Disaggregation = pr.Disaggregation.toDisaggregation()
		if sc := pr.Scheduling; sc != nil {
			p.Scheduling = &registry.Scheduling{
				Profile:              sc.Profile,
				Scorers:              sc.Scorers,
				Picker:               sc.Picker,
				ScrapeIntervalMS:     sc.ScrapeIntervalMS,
				IdleScrapeIntervalMS: sc.IdleScrapeMS,
				QueueThreshold:       sc.QueueThreshold,
				KVThreshold:          sc.KVThreshold,
				Metrics:              sc.Metrics,
				SessionHeader:        sc.SessionHeader,
			}
		}
		if c := pr.Consul; c != nil {
			p.Consul = &registry.ConsulSelector{Service: c.Service, Tag: c.Tag, Datacenter: c.Datacenter, PassingOnly: c.PassingOnly}
		}
		s.Pools[pr.Name] = p
	}
	for _, mr := range r.Models {
		m := &registry.Model{Name: mr.Name, Pool: mr.Pool, Priority: mr.Priority, DeclRange: mr.DeclRange, Disaggregation: mr.Disaggregation.toDisaggregation()}
		for _, t := range mr.Targets {
			m.Targets = append(m.Targets, registry.Target{Name: t.Name, Weight: t.Weight})
		}
		s.Models[mr.Name] = m
	}
	for _, lr := range r.Listeners {
		s.Listeners = append(s.Listeners, registry.Listener{Name: lr.Name, Address: lr.Address, DeclRange: lr.DeclRange})
	}
	for _, rr := range r.Replicas {
		s.Replicas = append(s.Replicas, registry.Replica{ID: rr.ID, Address: rr.Address, Admin: rr.Admin, XDS: rr.XDS, Source: rr.Source})
	}
	if d := r.ReplicaDiscovery; d != nil {
		s.ReplicaDiscovery = &registry.ReplicaDiscovery{ConsulService: d.ConsulService, DeclRange: d.DeclRange}
	}
	return s
}

type metricsRecord struct {
	V         int       `json:"v"`
	Waiting   int       `json:"waiting"`
	Running   int       `json:"running"`
	KVUsage   float64   `json:"kv_usage"`
	ScrapedAt time.Time `json:"scraped_at"`
}

type healthRecord struct {
	V        int       `json:"v"`
	Healthy  bool      `json:"healthy"`
	Draining bool      `json:"draining,omitempty"`
	Reason   string    `json:"reason,omitempty"`
	Since    time.Time `json:"since"`
}

type sessionRecord struct {
	V        int       `json:"v"`
	Pool     string    `json:"pool,omitempty"`
	Endpoint string    `json:"endpoint"`
	Expires  time.Time `json:"expires"`
}

// decode unmarshals a JSON record and checks its record version.
func decode(what string, key, data []byte, v any, version func() int) error {
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%s %q: %w", what, key, err)
	}
	if got := version(); got != recordVersion {
		return fmt.Errorf("%s %q: record version %d, want %d", what, key, got, recordVersion)
	}
	return nil
}

// endpointKey encodes a pool/endpoint pair as a bbolt key.
func endpointKey(k EndpointKey) []byte {
	return []byte(k.Pool + "\x00" + k.Address)
}

// parseEndpointKey is the inverse of endpointKey.
func parseEndpointKey(b []byte) (EndpointKey, error) {
	pool, addr, ok := strings.Cut(string(b), "\x00")
	if !ok {
		return EndpointKey{}, fmt.Errorf("malformed endpoint key %q", b)
	}
	return EndpointKey{Pool: pool, Address: addr}, nil
}

func u64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

func parseU64(what string, b []byte) (uint64, error) {
	if len(b) != 8 {
		return 0, fmt.Errorf("%s: want 8 bytes, have %d", what, len(b))
	}
	return binary.BigEndian.Uint64(b), nil
}
