package status

import (
	"fmt"
	"math"
	"time"

	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/internal/persist"
	tenantusage "github.com/switchyard/switchyard/internal/usage"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/store"
	"github.com/switchyard/switchyard/xds"
)

// Sources are the components a Report is read from. View, Registry,
// Picker and XDS are required; the others are nil when switchyard runs
// without them.
type Sources struct {
	// Version names the build.
	Version string
	// ReplicaID names this switchyard among the replicas; PickerAddr is
	// the picker address it advertises (which replica is Self).
	ReplicaID, PickerAddr string

	View     registry.View
	Registry *registry.Manager
	Picker   *picker.Server
	XDS      *xds.Server
	Consul   *consul.Source
	Mesh     *peers.Mesh

	// TLS serves the ADS and ext_proc certificates, AllowedSANs the
	// client SANs it admits (empty: any).
	TLS         *mtls.Server
	AllowedSANs []string

	// Store, at StorePath, persists state; Warm restored the picker's
	// memory from it and saves it back.
	Store     store.Store
	StorePath string
	Warm      *persist.Warm

	// Draining reports that shutdown began (readiness turns false).
	Draining func() bool
	// Ready reports whether the process serves what it should yet, and
	// why not (internal/ready); nil: ready once a state is published.
	Ready func() (bool, string)

	// Usage is the tenants' usage ledger (nil: no tenants possible).
	Usage *tenantusage.Ledger
	// Peers reads the other replicas' reports (nil: one switchyard).
	Peers *Peers
	// Decisions are the picker's decision records (/api/decisions), and
	// History the samples behind the status page's charts
	// (/api/history); nil without them.
	Decisions *decisions.Recorder
	History   *History
}

// readiness is what /readyz answers: ready, or why not.
func (s *Sources) readiness() (bool, string) {
	if st, _ := s.View.Current(); st.Version == 0 {
		return false, "no configuration published yet"
	}
	if s.Draining != nil && s.Draining() {
		return false, "draining before shutdown"
	}
	if s.Ready != nil {
		if ok, why := s.Ready(); !ok {
			return false, why
		}
	}
	return true, ""
}

// Read returns the Report at now. It leaves out the picker's per-model
// counters, decision histogram and prefix-index figures (Objectives,
// Running, Decision, Pool.Prefix): reading the prefix index takes each
// endpoint's lock that requests take too, so only the Prometheus
// collector, scraped every few seconds, asks for them. A status page
// polled every second, or a test polling faster, costs requests nothing.
func (s *Sources) Read(now time.Time) *Report { return build(s.gather(now, false)) }

// inputs are what a Report is built from: the components' own snapshots.
type inputs struct {
	now                            time.Time
	version, replicaID, pickerAddr string
	ready                          bool
	notReady                       string
	state                          *registry.State
	configErr                      error
	registry                       registry.Status
	picker                         picker.Stats
	unhealthy                      map[metrics.Key]bool
	saturated                      map[string]bool
	queues                         []admission.Stats
	tenants                        []Tenant
	peers                          map[string]PeerView
	observed                       *picker.Observability // nil unless asked for
	endpointLatency                []picker.EndpointLatency
	decisions                      *decisions.Stats
	xds                            xds.Stats
	nodes                          []xds.NodeStatus
	mesh                           peers.Stats
	consul                         []consul.SelectorStatus
	kvEvents                       map[metrics.Key]kvevents.Status
	kvTokenize                     map[string]kvevents.TokenizerStats
	tls                            *mtls.Stats // nil without TLS
	allowedSANs                    []string
	store                          *storeInputs // nil without a store
}

type storeInputs struct {
	path     string
	lastErr  error
	restored picker.WarmStats
	saves    int64
	lastSave time.Time
}

// gather reads every component once; observe adds the picker's
// observations.
func (s *Sources) gather(now time.Time, observe bool) *inputs {
	st, _ := s.View.Current()
	in := &inputs{
		now: now, version: s.Version, replicaID: s.ReplicaID, pickerAddr: s.PickerAddr,
		state:     st,
		configErr: s.Registry.LastError(),
		registry:  s.Registry.Status(),
		picker:    s.Picker.Stats(),
		unhealthy: map[metrics.Key]bool{},
		saturated: s.Picker.Saturated(now),
		queues:    s.Picker.AdmissionStats(),
		xds:       s.XDS.Stats(),
		nodes:     s.XDS.Nodes(),
	}
	in.ready, in.notReady = s.readiness()
	for _, k := range s.Picker.EndpointHealth().UnhealthyEndpoints() {
		in.unhealthy[k] = true
	}
	if kv := s.Picker.KVEvents(); kv != nil {
		in.kvEvents, in.kvTokenize = map[metrics.Key]kvevents.Status{}, map[string]kvevents.TokenizerStats{}
		for _, ks := range kv.Status() {
			in.kvEvents[metrics.Key{Pool: ks.Pool, Address: ks.Address}] = ks
			if tok := kv.Tokenizer(ks.Pool); tok != nil {
				in.kvTokenize[ks.Pool] = tok.Stats()
			}
		}
	}
	if observe {
		obs := s.Picker.Observe(now)
		in.observed = &obs
		in.endpointLatency = s.Picker.EndpointLatency()
	}
	if s.Decisions != nil {
		ds := s.Decisions.Stats()
		in.decisions = &ds
	}
	if s.Mesh != nil {
		in.mesh = s.Mesh.Stats()
	}
	if s.Peers != nil {
		in.peers = s.Peers.Views()
	}
	if ts := s.Picker.Tenants(now); ts != nil {
		var today []tenantusage.Total
		if s.Usage != nil {
			today, _ = s.Usage.Today() // an unreadable store shows no usage, not an error page
		}
		in.tenants = tenants(ts, today)
	}
	if s.Consul != nil {
		in.consul = s.Consul.Status()
	}
	if s.TLS != nil {
		ts := s.TLS.Stats()
		in.tls, in.allowedSANs = &ts, s.AllowedSANs
	}
	if s.Store != nil {
		si := &storeInputs{path: s.StorePath, lastErr: s.Store.LastError()}
		if s.Warm != nil {
			si.restored = s.Warm.Restored()
			si.saves, si.lastSave = s.Warm.Saves()
		}
		in.store = si
	}
	return in
}

// build computes the Report from in. It is the one place where an
// endpoint's health and load, a pool's guard and a replica's sharing are
// derived; every view reads the result.
func build(in *inputs) *Report {
	st, ps := in.state, in.picker
	r := &Report{
		Time:            in.now.UTC(),
		Version:         in.version,
		RegistryVersion: st.Version,
		Ready:           in.ready,
		NotReady:        in.notReady,
		Picker: Picker{Requests: ps.Requests, Picked: ps.Picked, Rewritten: ps.Rewritten,
			FallbackServed: ps.FallbackServed, ResponseBodies: ps.ResponseBodies, PeerPicks: ps.PeerPicks, PeerReadings: ps.PeerReadings, Rejected: ps.Rejected},
		ReplicaID: in.replicaID,
		Replicas:  replicas(st.Replicas, in.replicaID, in.pickerAddr, in.mesh, in.nodes, in.peers),
		Envoys:    []Envoy{},
		Peers:     in.mesh.Peers,
		Inbound:   in.mesh.Inbound,
	}
	if in.configErr != nil {
		r.ConfigError = in.configErr.Error()
	}
	xs := in.xds
	r.XDS = XDS{Version: xs.Version, Versions: xs.Versions, RegistryVersion: xs.RegistryVersion, Snapshots: xs.Snapshots,
		Failures: xs.Failures, LastError: xs.LastError, ACKs: xs.ACKs, NACKs: xs.NACKs, Warnings: xs.Warnings}
	for _, n := range in.nodes {
		r.Envoys = append(r.Envoys, Envoy{ID: n.ID, Cluster: n.Cluster, Streams: n.Streams,
			FirstSeen: n.FirstSeen, LastSeen: n.LastSeen, Acked: n.Acked, ACKs: n.ACKs, NACKs: n.NACKs, LastNACK: n.LastNACK})
	}
	r.Pools = pools(in)
	r.Tenants = in.tenants
	for _, name := range st.ModelNames() {
		m := st.Models[name]
		ms := Model{Name: name, Pool: m.Pool, Priority: m.Priority}
		for _, t := range m.Targets {
			ms.Targets = append(ms.Targets, t.Name)
			ms.TargetWeights = append(ms.TargetWeights, TargetWeight{Target: t.Name, Weight: t.Weight})
		}
		r.Models = append(r.Models, ms)
	}
	if obs := in.observed; obs != nil {
		r.Objectives, r.Running, r.Decision = obs.Objectives, obs.Running, &obs.Decision
		r.EndpointLatency = in.endpointLatency
	}
	if d := in.decisions; d != nil {
		r.Decisions = decisionsOf(*d)
	}
	for _, c := range in.consul {
		r.Consul = append(r.Consul, ConsulSelector{Selector: c.Selector, Up: c.Up, Instances: c.Instances, LastSuccess: c.LastSuccess})
	}
	if ts := in.tls; ts != nil {
		r.TLS = &TLS{Origin: ts.Origin, Subject: ts.Subject, NotAfter: ts.NotAfter.UTC(), Reloads: ts.Reloads,
			AllowedSANs: in.allowedSANs, Rejected: map[string]uint64{}}
		for k, v := range ts.Rejected {
			r.TLS.Rejected[k.Server+"/"+k.Reason] = v
		}
	}
	if si := in.store; si != nil {
		rs := si.restored
		r.Store = &Store{Path: si.path, WarmSaves: si.saves,
			Restored: WarmCount{PrefixEndpoints: rs.PrefixEndpoints, PrefixBlocks: rs.PrefixBlocks, Sessions: rs.Sessions, FailingEps: rs.Failing}}
		if si.lastErr != nil {
			r.Store.LastError = si.lastErr.Error()
		}
		if !si.lastSave.IsZero() {
			r.Store.LastWarmSave = si.lastSave.UTC()
		}
	}
	return r
}

// pools lists the state's pools with the picker's endpoints of each. An
// endpoint is healthy unless the picker withholds it (its scrapes fail
// while others of its pool answer) or its own latest scrapes fail; one
// whose scrapes fail but that is not withheld (no endpoint of its pool
// answers, or none has yet) is still routed to, and says so.
func pools(in *inputs) []Pool {
	st := in.state
	byPool := map[string][]Endpoint{}
	for _, e := range in.picker.Endpoints {
		withheld := in.unhealthy[metrics.Key{Pool: e.Pool, Address: e.Address}]
		es := Endpoint{Address: e.Address, Draining: e.Draining,
			InFlightRequests: e.InFlightRequests, InFlightTokens: e.InFlightTokens, Picked: e.Picked, Served: e.Served,
			Healthy: !withheld}
		switch {
		case len(e.Models) > 0:
			es.Models, es.ModelsFrom = e.Models, "config"
		case e.Metrics != nil && e.Metrics.ServedModels != nil:
			es.Models, es.ModelsFrom = e.Metrics.ServedModels, "server"
		}
		if m := e.Metrics; m != nil && !m.LastSuccess.IsZero() {
			v := m.Values
			es.Waiting, es.Running, es.KVCacheUsage = &v.Waiting, &v.Running, &v.KVUsage
			es.BlockSize, es.NumBlocks = v.BlockSize, v.NumBlocks
			es.MaxLoras, es.RunningAdapters, es.WaitingAdapters = v.MaxLoras, v.RunningAdapters, v.WaitingAdapters
			es.ScrapedAt = m.LastSuccess
		}
		if m := e.Metrics; m != nil && m.Failing {
			es.Healthy = false
		}
		if !es.Healthy {
			es.UnhealthyReason = unhealthyReason(e.Metrics, in.now)
			if !withheld {
				es.RoutedReason = stillRouted
			}
		}
		if ks, ok := in.kvEvents[metrics.Key{Pool: e.Pool, Address: e.Address}]; ok {
			es.KVEvents = kvEventsOf(ks)
		}
		es.Scrape = scrapeOf(e.Metrics, in.now)
		if m := e.TTFT; m.Compared > 0 || e.PrefillRequests > 0 {
			ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
			es.TTFT = &TTFT{BaseMS: ms(m.Base), PrefillPer1kMS: ms(m.PerToken), Observations: m.Observed,
				PrefillRequests: e.PrefillRequests, PrefillTokens: e.PrefillTokens,
				Compared: m.Compared, MeanErrorMS: ms(m.MeanError), MeanAbsoluteError: ms(m.MeanAbs)}
		}
		byPool[e.Pool] = append(byPool[e.Pool], es)
	}
	guards := map[string]*Guard{}
	for _, g := range in.registry.Guards {
		guards[g.Pool] = &Guard{Held: g.Held, Since: g.Since.UTC(), Until: g.Until.UTC()}
	}
	prefix := map[string]*Prefix{}
	share := map[string]*float64{}
	pd := map[string]map[string]int64{}
	if in.observed != nil {
		for _, p := range in.observed.Pools {
			prefix[p.Name] = &Prefix{Entries: p.PrefixEntries, Bytes: p.PrefixBytes, PromptBlocks: p.PromptBlocks, MatchedBlocks: p.MatchedBlocks}
			share[p.Name] = &p.SaturatedShare
			pd[p.Name] = p.PDDecisions
		}
	}
	queues := map[string]*admission.Stats{}
	for i := range in.queues {
		queues[in.queues[i].Pool] = &in.queues[i]
	}
	var out []Pool
	for _, name := range st.PoolNames() {
		p := st.Pools[name]
		eps := byPool[name]
		if eps == nil {
			eps = []Endpoint{}
		}
		byAddr := map[string]registry.Endpoint{}
		for _, e := range p.Endpoints {
			byAddr[e.Address] = e
		}
		for i := range eps {
			e := byAddr[eps[i].Address]
			eps[i].Held, eps[i].NodeUnreachable = e.Held, e.NodeUnreachable
		}
		var tok *KVTokenize
		if ts, ok := in.kvTokenize[name]; ok {
			tok = &KVTokenize{Hits: ts.Hits, PrefixHits: ts.PrefixHits, Misses: ts.Misses, Unkeyed: ts.Unkeyed, Calls: ts.Calls,
				Failures: ts.Failures, Dropped: ts.Dropped, CallSeconds: ts.CallSeconds, Verified: ts.Verified, Mismatches: ts.Mismatches,
				Unstable: ts.Unstable, CachedTokens: ts.CachedTokens}
		}
		pool := Pool{Name: name, Engine: string(p.Engine), FailureMode: string(p.FailureMode), KVTokenize: tok,
			Saturated: in.saturated[name], Guard: guards[name], Endpoints: eps,
			GuardActivations: in.registry.GuardActivations[name], Prefix: prefix[name],
			Queue: queues[name], SaturatedShare: share[name], PDDecisions: pd[name]}
		if q := queues[name]; q != nil && !q.Config.Disabled {
			pool.Admission = admissionOf(q)
		}
		out = append(out, pool)
	}
	return out
}

// decisionsOf describes the decision records from the recorder's stats.
func decisionsOf(d decisions.Stats) *Decisions {
	return &Decisions{Sample: d.Sample, Kept: d.Kept, Size: d.Size, Recorded: d.Recorded, FileDropped: d.FileDropped}
}

// kvEventsOf describes an endpoint's KV-events stream.
func kvEventsOf(ks kvevents.Status) *KVEvents {
	out := &KVEvents{State: ks.State.String(), Exact: ks.State == kvevents.Synced, Connected: ks.Connected, LastSeq: ks.LastSeq,
		Blocks: ks.Server.Blocks, Media: ks.Server.Media, Batches: ks.Server.Batches, Gaps: ks.Gaps, Replayed: ks.Replayed,
		Lost: ks.Lost, Restarts: ks.Restarts, DecodeErrors: ks.DecodeErrors, Orphans: ks.Server.Orphans, LastError: ks.LastError,
		PredictionsAgreed: ks.Server.Agreed, PredictionsOver: ks.Server.Over, PredictionsUnder: ks.Server.Under,
		PredictionsBounded: ks.Server.Bounded}
	if !ks.LastMessage.IsZero() {
		t := ks.LastMessage.UTC()
		out.LastMessage = &t
	}
	return out
}

// admissionOf summarises a pool's admission queue for the status page.
func admissionOf(q *admission.Stats) *Admission {
	a := &Admission{MaxQueued: q.Config.MaxQueued, MaxQueuedBytes: q.Config.MaxQueuedBytes,
		TTLMS: q.Config.TTL.Milliseconds(), Fairness: string(q.Config.Fairness), Waiting: []AdmissionFlow{},
		Enqueued: q.Enqueued, Dispatched: q.Dispatched, Cancelled: q.Cancelled, Rejected: q.Rejected}
	for _, w := range q.Waiting {
		a.Queued += w.Requests
		a.QueuedBytes += w.Bytes
		a.Waiting = append(a.Waiting, AdmissionFlow{Priority: w.Priority, Flow: w.Flow, Requests: w.Requests, Bytes: w.Bytes})
	}
	// p90 over every band's dispatched waits: the merged histogram.
	bounds := admission.WaitBounds()
	cum := make([]uint64, len(bounds))
	var count uint64
	for k, h := range q.Wait {
		if k.Outcome != admission.OutcomeDispatched {
			continue
		}
		count += h.Count
		for i := range cum {
			cum[i] += h.Cumulative[i]
		}
	}
	if count > 0 {
		a.WaitP90MS = 1000 * bounds[len(bounds)-1]
		for i, c := range cum {
			if float64(c) >= 0.9*float64(count) {
				a.WaitP90MS = 1000 * bounds[i]
				break
			}
		}
	}
	return a
}

// replicas joins the configuration's replicas with the mesh's streams
// (by picker address; an inbound stream from a replica that does not send
// its address, by the replica ID it announced) and with the Envoys whose
// ADS stream each holds (this replica's own nodes; the others' as Peers
// last read them). A replica is named by the ID it gives itself
// (-replica-id): this one's own, another's as its streams announced it;
// until it has been heard from, by the configuration's ID (a static
// peer's is its address).
func replicas(rs []registry.Replica, selfID, self string, mesh peers.Stats, nodes []xds.NodeStatus, seen map[string]PeerView) []Replica {
	out := make([]Replica, 0, len(rs))
	for _, r := range rs {
		rep := Replica{ID: r.ID, Address: r.Address, Admin: r.Admin, XDS: r.XDS, Source: r.Source, Self: r.Address == self,
			Envoys: []string{}}
		if rep.Self && selfID != "" {
			rep.ID = selfID
		}
		switch v, ok := seen[r.Address]; {
		case rep.Self:
			for _, n := range nodes {
				if n.Streams > 0 {
					rep.Envoys = append(rep.Envoys, n.ID)
				}
			}
			rep.EnvoysKnown = true
		case ok && v.Err == "":
			rep.Envoys, rep.EnvoysKnown = v.Envoys, true
		case ok:
			rep.EnvoysError = v.Err
		}
		learned := ""
		for _, p := range mesh.Peers {
			if p.Address == r.Address {
				rep.Sharing, rep.Sent, rep.Dropped = p.Connected, p.Sent, p.Dropped
				learned = p.ID
			}
		}
		for _, in := range mesh.Inbound {
			if inboundFrom(in, r) {
				rep.From, rep.LagMS = in.From, float64(in.Lag)/float64(time.Millisecond)
				if learned == "" {
					learned = in.From
				}
			}
		}
		if learned != "" && !rep.Self {
			rep.ID = learned
		}
		out = append(out, rep)
	}
	return out
}

// inboundFrom reports whether in is the stream from replica r.
func inboundFrom(in peers.InboundStats, r registry.Replica) bool {
	if in.Address != "" {
		return in.Address == r.Address
	}
	return in.From == r.ID
}

// peerName is the metric label of a mesh stream: the ID of the replica
// row it joins (address, or announced ID for an inbound stream without
// one), else what the stream itself says.
func peerName(rows []Replica, address, from string) string {
	for _, r := range rows {
		if address != "" && r.Address == address || address == "" && from != "" && r.From == from {
			return r.ID
		}
	}
	if from != "" {
		return from
	}
	return address
}

// stillRouted is the RoutedReason of an endpoint whose scrapes fail but
// that is not withheld: the rule of picker.EndpointHealth, which xDS and
// the picker's health filter follow.
const stillRouted = "still routed: no other endpoint of its pool answers its metrics scrapes, and a pool is never emptied for failing scrapes alone (a broken metrics path must not take it down)"

// scrapeOf describes how fresh snapshot m is at now (nil: never
// attempted).
func scrapeOf(m *metrics.Snapshot, now time.Time) *Scrape {
	if m == nil {
		return nil
	}
	ms := func(d time.Duration) float64 { return math.Round(float64(d)/1e4) / 100 }
	s := &Scrape{Stale: !m.Fresh(now) || m.Failing, MaxAgeMS: ms(m.MaxAge), IntervalMS: ms(m.Interval),
		CostMS: ms(m.Cost), PageBytes: m.PageBytes, From: m.From}
	if age := m.Age(now); age >= 0 {
		a := ms(age)
		s.AgeMS = &a
	}
	if m.Filter != metrics.FilterUnknown {
		s.NameFilter = m.Filter.String()
	}
	return s
}

// unhealthyReason says why an endpoint is unhealthy, from its latest
// scrape (m may be nil: never scraped).
func unhealthyReason(m *metrics.Snapshot, now time.Time) string {
	switch {
	case m == nil:
		return "no successful metrics scrape yet; withheld while others of its pool answer"
	case m.Err != nil && m.LastSuccess.IsZero():
		return fmt.Sprintf("metrics scrapes failing (%d in a row, none succeeded yet): %v", m.ConsecutiveFailures, m.Err)
	case m.Err != nil:
		return fmt.Sprintf("metrics scrapes failing (%d in a row, last success %s ago): %v", m.ConsecutiveFailures,
			now.Sub(m.LastSuccess).Round(time.Second), m.Err)
	case m.Failing:
		return "metrics scrapes failing"
	}
	return "metrics scrapes failing; withheld while others of its pool answer"
}
