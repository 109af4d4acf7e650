package status

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/xds"
)

var update = flag.Bool("update", false, "rewrite testdata/report.json and testdata/metrics.txt from the sample inputs")

var t0 = time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)

// sample returns inputs covering every case the Report derives: a pool
// with an endpoint of each health and models origin, a held endpoint, a
// guard, an empty pool, a picker endpoint of a pool the state no longer
// has, replicas joined with the mesh, Consul, TLS and the store.
func sample() *inputs {
	st := registry.Empty()
	st.Version = 7
	st.Pools["llama"] = &registry.Pool{Name: "llama", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed,
		Endpoints: []registry.Endpoint{
			{Address: "10.0.0.1:8000"}, {Address: "10.0.0.2:8000"}, {Address: "10.0.0.3:8000", Held: true},
			{Address: "10.0.0.4:8000", Draining: true}, {Address: "10.0.0.5:8000", NodeUnreachable: true},
		}}
	st.Pools["empty"] = &registry.Pool{Name: "empty", Engine: registry.EngineSGLang, FailureMode: registry.FailOpen}
	st.Pools["solo"] = &registry.Pool{Name: "solo", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed,
		Endpoints: []registry.Endpoint{{Address: "10.0.2.1:8000"}}}
	st.Models["m"] = &registry.Model{Name: "m", Pool: "llama"}
	st.Models["chat"] = &registry.Model{Name: "chat", Pool: "llama", Priority: -1,
		Targets: []registry.Target{{Name: "m", Weight: 9}, {Name: "m-v2", Weight: 1}}}
	st.Replicas = []registry.Replica{
		{ID: "sy-1", Address: "10.0.1.1:9002", Admin: "10.0.1.1:9090", XDS: "10.0.1.1:18000", Source: "consul"},
		{ID: "sy-2", Address: "10.0.1.2:9002", Source: "consul"},
		{ID: "10.0.1.3:9002", Address: "10.0.1.3:9002", Source: "file"},
	}

	scraped := func(addr string, v metrics.Values, failing bool, served []string) *metrics.Snapshot {
		return &metrics.Snapshot{Key: metrics.Key{Pool: "llama", Address: addr}, Values: v,
			ScrapedAt: t0.Add(-time.Second), LastSuccess: t0.Add(-2 * time.Second), Failing: failing, ServedModels: served,
			Interval: time.Second, MaxAge: 3 * time.Second, Cost: 3300 * time.Microsecond, PageBytes: 48380, Filter: metrics.FilterIgnored}
	}
	ps := picker.Stats{
		Version: 7, Requests: 100, Picked: 90, Rewritten: 5, FallbackServed: 2, ResponseBodies: 40, PeerPicks: 30, PeerReadings: 12,
		Rejected: map[int]int64{404: 3, 503: 1},
		Endpoints: []picker.EndpointStats{
			// Healthy, scraped, models from its server, LoRA state.
			{Pool: "llama", Address: "10.0.0.1:8000", InFlightRequests: 2, InFlightTokens: 300, Picked: 50, Served: 48,
				Metrics: scraped("10.0.0.1:8000", metrics.Values{Waiting: 1, Running: 2, KVUsage: 0.5, BlockSize: 16, NumBlocks: 1000,
					MaxLoras: 2, RunningAdapters: []string{"sql-lora"}, WaitingAdapters: []string{"fr-lora"}}, false, []string{"m", "sql-lora"})},
			// Scraped once, now failing its scrapes; models from the configuration.
			{Pool: "llama", Address: "10.0.0.2:8000", Picked: 10, Served: 10, Models: []string{"m"},
				Metrics: scraped("10.0.0.2:8000", metrics.Values{Waiting: 3, Running: 0, KVUsage: 0.1}, true, nil)},
			// Held by the guard; the picker withholds it (never scraped).
			{Pool: "llama", Address: "10.0.0.3:8000"},
			// Draining, healthy.
			{Pool: "llama", Address: "10.0.0.4:8000", Draining: true,
				Metrics: scraped("10.0.0.4:8000", metrics.Values{Waiting: 5, Running: 4, KVUsage: 0.9}, false, nil)},
			// Not scraped yet: healthy, no load.
			{Pool: "llama", Address: "10.0.0.5:8000"},
			// Alone in its pool and refusing every connection: never
			// scraped, failing, not withheld (no endpoint of its pool
			// answers), so still routed to.
			{Pool: "solo", Address: "10.0.2.1:8000", Metrics: &metrics.Snapshot{Key: metrics.Key{Pool: "solo", Address: "10.0.2.1:8000"},
				ScrapedAt: t0.Add(-time.Second), ConsecutiveFailures: 4, Failing: true, Interval: time.Second, MaxAge: 3 * time.Second,
				Err: errors.New(`Get "http://10.0.2.1:8000/metrics": dial tcp 10.0.2.1:8000: connect: connection refused`)}},
			// A pool the state no longer has (the picker applies it next).
			{Pool: "gone", Address: "10.0.9.9:8000"},
		},
	}
	hist := picker.Histogram{Bounds: []float64{0.0001, 0.001}, Cumulative: []uint64{80, 99}, Count: 100, SumSeconds: 0.02}
	lat := picker.Latency{
		TTFT:     picker.Histogram{Bounds: []float64{0.05, 0.1}, Cumulative: []uint64{30, 40}, Count: 40, SumSeconds: 2},
		TPOT:     picker.Histogram{Bounds: []float64{0.01, 0.02}, Cumulative: []uint64{10, 20}, Count: 20, SumSeconds: 0.3},
		Duration: picker.Histogram{Bounds: []float64{1, 2}, Cumulative: []uint64{35, 40}, Count: 40, SumSeconds: 45},
		NTPOT:    picker.Histogram{Bounds: []float64{0.01, 0.02}, Cumulative: []uint64{25, 40}, Count: 40, SumSeconds: 0.5},
	}
	return &inputs{
		now: t0, version: "v1.2.3", replicaID: "sy-1", pickerAddr: "10.0.1.1:9002", ready: true,
		state:     st,
		configErr: errors.New(`source "file": switchyard.hcl:4:10: error: Unknown pool`),
		registry: registry.Status{
			Guards:           []registry.GuardStatus{{Pool: "llama", Held: []string{"10.0.0.3:8000"}, Since: t0.Add(-time.Minute), Until: t0.Add(time.Minute)}},
			GuardActivations: map[string]uint64{"llama": 2},
		},
		picker: ps,
		// The picker withholds 10.0.0.2 (failing while 10.0.0.1 answers)
		// and 10.0.0.3; not 10.0.2.1, alone in its pool.
		unhealthy: map[metrics.Key]bool{{Pool: "llama", Address: "10.0.0.2:8000"}: true, {Pool: "llama", Address: "10.0.0.3:8000"}: true},
		saturated: map[string]bool{"llama": true},
		queues: []admission.Stats{{Pool: "llama", Config: admission.Config{}.WithDefaults(),
			Enqueued: 30, Dispatched: 25, Cancelled: 1, Rejected: map[string]uint64{admission.ReasonTTL: 2, admission.ReasonOverflow: 1},
			Waiting: []admission.Waiting{{Priority: 1, Flow: "team-a", Requests: 1, Bytes: 900}, {Priority: 0, Flow: "", Requests: 1, Bytes: 1200}},
			Wait: map[admission.WaitKey]admission.Histogram{
				{Priority: 0, Outcome: admission.OutcomeDispatched}: {Count: 25, SumSeconds: 2.5,
					Cumulative: []uint64{0, 0, 5, 10, 20, 23, 25, 25, 25, 25, 25, 25, 25, 25}},
				{Priority: 0, Outcome: admission.OutcomeTTL}: {Count: 2, SumSeconds: 60,
					Cumulative: []uint64{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2}},
			}}},
		observed: &picker.Observability{
			Decision:   hist,
			Objectives: []picker.ObjectiveStats{{Model: "chat", Target: "m", Requests: 9, Errors: map[int]int64{429: 1}}, {Model: "m", Target: "m", Requests: 80, Errors: map[int]int64{}, Latency: &lat}},
			Running:    map[string]int64{"m": 2},
			Pools: []picker.PoolStats{{Name: "llama", Saturated: true, SaturatedShare: 1, PrefixEntries: 12, PrefixBlocks: 10, PrefixBytes: 4096, PromptBlocks: 200, MatchedBlocks: 150},
				{Name: "gone", PrefixEntries: 1}},
		},
		endpointLatency: []picker.EndpointLatency{{Pool: "llama", Address: "10.0.0.1:8000", Latency: lat}},
		decisions:       &decisions.Stats{Recorded: 120, FileDropped: 3, Kept: 120, Size: 1000, Sample: 0.5},
		xds: xds.Stats{Version: "c1-e2-l3-r4", Versions: map[string]string{"Cluster": "c1", "ClusterLoadAssignment": "e2", "Listener": "l3", "RouteConfiguration": "r4"},
			RegistryVersion: 7, Snapshots: 4, Failures: 1, LastError: "", ACKs: 8, NACKs: 1, Warnings: []string{"a warning"}},
		nodes: []xds.NodeStatus{{ID: "envoy-1", Cluster: "edge", Streams: 1, FirstSeen: t0.Add(-time.Hour), LastSeen: t0,
			Acked: map[string]string{"Cluster": "c1"}, ACKs: 8, NACKs: 1, LastNACK: "bad cluster"}},
		mesh: peers.Stats{
			// 10.0.1.3 is a static peer that calls itself sy-3; sy-2 is
			// an older replica that sends no address; sy-9 is in no list.
			Peers: []peers.PeerStats{{Address: "10.0.1.2:9002", Connected: true, Sent: 40, Dropped: 1}, {Address: "10.0.1.3:9002", ID: "sy-3", Sent: 3}},
			Inbound: []peers.InboundStats{{From: "sy-2", Received: 20, Lag: 1500 * time.Microsecond},
				{From: "sy-3", Address: "10.0.1.3:9002", Lag: 2 * time.Millisecond}, {From: "sy-9", Address: "10.0.1.9:9002", Lag: 3 * time.Millisecond}},
		},
		consul: []consul.SelectorStatus{
			{Selector: registry.ConsulSelector{Service: "vllm", Tag: "llama", PassingOnly: true}, Up: true, Instances: 2, LastSuccess: t0.Add(-time.Second)},
			{Selector: registry.ConsulSelector{Service: "switchyard"}, Up: false},
		},
		tls: &mtls.Stats{Origin: "files", Subject: "CN=switchyard", NotAfter: t0.Add(24 * time.Hour), Reloads: 1,
			Rejected: map[mtls.RejectKey]uint64{{Server: "xds", Reason: mtls.ReasonExpired}: 2, {Server: "extproc", Reason: mtls.ReasonNotTLS}: 1}},
		allowedSANs: []string{"envoy.internal"},
		kvEvents: map[metrics.Key]kvevents.Status{
			{Pool: "llama", Address: "10.0.0.1:8000"}: {State: kvevents.Synced, Connected: true, LastSeq: 41, Gaps: 2, Replayed: 3, Restarts: 1,
				Server: kvevents.ServerStats{Blocks: 120, Batches: 42, Media: map[string]int{"CPU": 7}, Agreed: 95, Over: 3, Under: 2, Bounded: 40}, LastMessage: t0.Add(-time.Second)},
			{Pool: "llama", Address: "10.0.0.2:8000"}: {State: kvevents.Partial, Connected: true, LastSeq: 9, Lost: 1, LastError: "batches 3-5 are no longer in the engine's replay buffer"},
		},
		kvTokenize: map[string]kvevents.TokenizerStats{"llama": {Hits: 30, PrefixHits: 120, Misses: 14, Unkeyed: 3, Calls: 12, Failures: 2, Dropped: 1,
			CallSeconds: 0.06, Verified: 9, Mismatches: 1, Unstable: []string{"mistral (chat)"}, CachedTokens: 5000}},
		store: &storeInputs{path: "/var/lib/switchyard/switchyard.db", lastErr: errors.New("disk full"),
			restored: picker.WarmStats{PrefixEndpoints: 2, PrefixBlocks: 30, Sessions: 4, Failing: 1}, saves: 12, lastSave: t0.Add(-time.Second)},
	}
}

func endpoint(t *testing.T, r *Report, pool, addr string) Endpoint {
	t.Helper()
	for _, p := range r.Pools {
		if p.Name != pool {
			continue
		}
		for _, e := range p.Endpoints {
			if e.Address == addr {
				return e
			}
		}
	}
	t.Fatalf("no endpoint %s/%s in the report", pool, addr)
	return Endpoint{}
}

// TestBuildEndpointHealthAndLoad pins the one rule for an endpoint's
// health that the JSON, the page and the metrics share.
func TestBuildEndpointHealthAndLoad(t *testing.T) {
	t.Parallel()
	r := build(sample())
	cases := []struct {
		desc, addr             string
		healthy, ready, loaded bool
		held, unreachable      bool
		models                 []string
		from                   string
	}{
		{desc: "scraped and answering", addr: "10.0.0.1:8000", healthy: true, ready: true, loaded: true, models: []string{"m", "sql-lora"}, from: "server"},
		{desc: "its own scrapes failing", addr: "10.0.0.2:8000", loaded: true, models: []string{"m"}, from: "config"},
		{desc: "withheld by the picker, held by the guard", addr: "10.0.0.3:8000", held: true},
		{desc: "draining", addr: "10.0.0.4:8000", healthy: true, loaded: true},
		{desc: "not scraped yet, its Consul agent unreachable", addr: "10.0.0.5:8000", healthy: true, ready: true, unreachable: true},
	}
	for _, tc := range cases {
		e := endpoint(t, r, "llama", tc.addr)
		if e.Healthy != tc.healthy || e.Ready() != tc.ready || e.Held != tc.held || e.NodeUnreachable != tc.unreachable {
			t.Errorf("%s: healthy %v ready %v held %v node unreachable %v, want %v %v %v %v", tc.desc, e.Healthy, e.Ready(), e.Held, e.NodeUnreachable, tc.healthy, tc.ready, tc.held, tc.unreachable)
		}
		if (e.Waiting != nil) != tc.loaded || (e.Running != nil) != tc.loaded || (e.KVCacheUsage != nil) != tc.loaded || e.ScrapedAt.IsZero() == tc.loaded {
			t.Errorf("%s: load waiting=%v running=%v kv=%v scraped at %v, want present %v", tc.desc, e.Waiting, e.Running, e.KVCacheUsage, e.ScrapedAt, tc.loaded)
		}
		if !slices.Equal(e.Models, tc.models) || e.ModelsFrom != tc.from {
			t.Errorf("%s: models %v from %q, want %v from %q", tc.desc, e.Models, e.ModelsFrom, tc.models, tc.from)
		}
	}
	for _, addr := range []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000"} {
		if e := endpoint(t, r, "llama", addr); e.RoutedReason != "" {
			t.Errorf("%s: routed reason %q, want none (healthy, or withheld)", addr, e.RoutedReason)
		}
	}
	if e := endpoint(t, r, "llama", "10.0.0.1:8000"); *e.Waiting != 1 || *e.Running != 2 || *e.KVCacheUsage != 0.5 ||
		e.BlockSize != 16 || e.NumBlocks != 1000 || e.MaxLoras != 2 || !slices.Equal(e.RunningAdapters, []string{"sql-lora"}) {
		t.Errorf("scraped values of 10.0.0.1:8000: %+v", e)
	}
}

// An endpoint that refuses every connection, alone in its pool, is not
// withheld (a pool whose scrapes all fail keeps its endpoints): it shows
// as unhealthy, with its scrapes' error, and says why it is still routed
// to, not as ready with no reason.
func TestBuildEndpointFailingButRouted(t *testing.T) {
	t.Parallel()
	r := build(sample())
	e := endpoint(t, r, "solo", "10.0.2.1:8000")
	if e.Healthy || e.Ready() {
		t.Errorf("healthy %v ready %v, want neither: its scrapes fail", e.Healthy, e.Ready())
	}
	if want := "metrics scrapes failing (4 in a row, none succeeded yet): " + `Get "http://10.0.2.1:8000/metrics": dial tcp 10.0.2.1:8000: connect: connection refused`; e.UnhealthyReason != want {
		t.Errorf("unhealthy reason %q, want %q", e.UnhealthyReason, want)
	}
	if !strings.HasPrefix(e.RoutedReason, "still routed: no other endpoint of its pool answers its metrics scrapes") {
		t.Errorf("routed reason %q", e.RoutedReason)
	}
	if e.Waiting != nil || !e.ScrapedAt.IsZero() {
		t.Errorf("never scraped, but shows load: waiting %v scraped at %v", e.Waiting, e.ScrapedAt)
	}
	// Once another endpoint of its pool answers, the picker withholds it:
	// unhealthy, no longer routed to.
	in := sample()
	in.unhealthy[metrics.Key{Pool: "solo", Address: "10.0.2.1:8000"}] = true
	if e := endpoint(t, build(in), "solo", "10.0.2.1:8000"); e.Healthy || e.RoutedReason != "" || e.UnhealthyReason == "" {
		t.Errorf("withheld: healthy %v, unhealthy reason %q, routed reason %q", e.Healthy, e.UnhealthyReason, e.RoutedReason)
	}
	// Failed scrapes below the failure threshold are not failing yet.
	in = sample()
	in.picker.Endpoints[5].Metrics.Failing = false
	if e := endpoint(t, build(in), "solo", "10.0.2.1:8000"); !e.Healthy || e.RoutedReason != "" {
		t.Errorf("below the threshold: healthy %v, routed reason %q", e.Healthy, e.RoutedReason)
	}
}

// An endpoint of a predicted-ttft pool shows its learned TTFT model in
// milliseconds; one with nothing learned or counted shows none.
func TestBuildEndpointTTFT(t *testing.T) {
	t.Parallel()
	in := sample()
	in.picker.Endpoints[0].PrefillRequests, in.picker.Endpoints[0].PrefillTokens = 2, 3000
	in.picker.Endpoints[0].TTFT = sched.TTFTModel{Base: 25 * time.Millisecond, PerToken: 80 * time.Millisecond, Observed: 12.5,
		Compared: 40, MeanError: -3 * time.Millisecond, MeanAbs: 7500 * time.Microsecond}
	r := build(in)
	got := endpoint(t, r, "llama", "10.0.0.1:8000").TTFT
	want := &TTFT{BaseMS: 25, PrefillPer1kMS: 80, Observations: 12.5, PrefillRequests: 2, PrefillTokens: 3000,
		Compared: 40, MeanErrorMS: -3, MeanAbsoluteError: 7.5}
	if got == nil || *got != *want {
		t.Errorf("TTFT %+v, want %+v", got, want)
	}
	if e := endpoint(t, r, "llama", "10.0.0.2:8000"); e.TTFT != nil {
		t.Errorf("an endpoint with nothing learned shows %+v", e.TTFT)
	}
}

func TestBuildPoolsFollowTheState(t *testing.T) {
	t.Parallel()
	r := build(sample())
	var names []string
	for _, p := range r.Pools {
		names = append(names, p.Name)
	}
	if !slices.Equal(names, []string{"empty", "llama", "solo"}) {
		t.Fatalf("pools %v, want the state's [empty llama solo] (not the picker's stale \"gone\")", names)
	}
	empty, llama := r.Pools[0], r.Pools[1]
	if empty.Endpoints == nil || len(empty.Endpoints) != 0 || empty.Saturated || empty.Guard != nil || empty.Prefix != nil {
		t.Errorf("empty pool %+v", empty)
	}
	if empty.Engine != "sglang" || empty.FailureMode != "fail_open" {
		t.Errorf("empty pool engine %q failure mode %q", empty.Engine, empty.FailureMode)
	}
	if !llama.Saturated || llama.GuardActivations != 2 || llama.Guard == nil || !slices.Equal(llama.Guard.Held, []string{"10.0.0.3:8000"}) {
		t.Errorf("llama: saturated %v, guard %+v, activations %d", llama.Saturated, llama.Guard, llama.GuardActivations)
	}
	if p := llama.Prefix; p == nil || *p != (Prefix{Entries: 12, Bytes: 4096, PromptBlocks: 200, MatchedBlocks: 150}) {
		t.Errorf("llama prefix %+v", p)
	}
	if len(llama.Endpoints) != 5 {
		t.Errorf("llama has %d endpoints, want the picker's 5", len(llama.Endpoints))
	}

	in := sample()
	in.observed = nil
	r = build(in)
	if r.Pools[1].Prefix != nil || r.Decision != nil || r.Objectives != nil || r.Running != nil {
		t.Errorf("a Report read without the picker's observations has them: %+v %+v", r.Pools[1].Prefix, r.Decision)
	}
}

// TestBuildReplicas joins the configuration's replicas with the mesh by
// picker address (by announced ID for an inbound stream that carries no
// address), and names each replica as it names itself: a static peer
// configured by address shows the ID its streams announced, with its lag.
func TestBuildReplicas(t *testing.T) {
	t.Parallel()
	in := sample()
	in.peers = map[string]PeerView{
		"10.0.1.2:9002": {Envoys: []string{"envoy-2", "envoy-3"}},
		"10.0.1.3:9002": {Err: "read replica status: connection refused"},
	}
	r := build(in)
	want := []Replica{
		{ID: "sy-1", Address: "10.0.1.1:9002", Admin: "10.0.1.1:9090", XDS: "10.0.1.1:18000", Source: "consul", Self: true,
			Envoys: []string{"envoy-1"}, EnvoysKnown: true},
		{ID: "sy-2", Address: "10.0.1.2:9002", Source: "consul", Sharing: true, Sent: 40, Dropped: 1, From: "sy-2", LagMS: 1.5,
			Envoys: []string{"envoy-2", "envoy-3"}, EnvoysKnown: true},
		{ID: "sy-3", Address: "10.0.1.3:9002", Source: "file", Sent: 3, From: "sy-3", LagMS: 2, Envoys: []string{},
			EnvoysError: "read replica status: connection refused"},
	}
	if !reflect.DeepEqual(r.Replicas, want) {
		t.Errorf("replicas\n%+v\nwant\n%+v", r.Replicas, want)
	}
	if len(r.Inbound) != 3 || len(r.Peers) != 2 {
		t.Errorf("mesh streams: %d inbound, %d peers, want the mesh's 3 and 2", len(r.Inbound), len(r.Peers))
	}
	// This replica is named by its own ID even where the configuration
	// has its address.
	in = sample()
	in.state.Replicas[0] = registry.Replica{ID: "10.0.1.1:9002", Address: "10.0.1.1:9002", Source: "file"}
	if got := build(in).Replicas[0]; !got.Self || got.ID != "sy-1" {
		t.Errorf("self listed as %+v, want ID sy-1", got)
	}

	in = sample()
	in.state.Replicas, in.mesh = nil, peers.Stats{}
	if r := build(in); r.Replicas == nil || len(r.Replicas) != 0 {
		t.Errorf("one switchyard: replicas %#v, want empty (not null)", r.Replicas)
	}
}

func TestBuildOptionalSections(t *testing.T) {
	t.Parallel()
	in := sample()
	in.tls, in.store, in.configErr, in.nodes = nil, nil, nil, nil
	r := build(in)
	if r.TLS != nil || r.Store != nil || r.ConfigError != "" {
		t.Errorf("without TLS, store and errors: tls %+v store %+v config error %q", r.TLS, r.Store, r.ConfigError)
	}
	if r.Envoys == nil {
		t.Error("no Envoy: envoys is null, want empty")
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"tls", "store", "config_error"} {
		if _, ok := doc[k]; ok {
			t.Errorf("JSON has %q without it", k)
		}
	}
}

// TestReportJSON pins every /api/status field name and shape: the status
// page and the end-to-end tests read them. Regenerate with -update only
// for a deliberate change.
func TestReportJSON(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(build(sample())); err != nil {
		t.Fatal(err)
	}
	golden(t, filepath.Join("testdata", "report.json"), buf.Bytes())
}

func golden(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (generate it with -update)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the output; if the change is deliberate, run go test -update ./internal/status/\ngot:\n%s", path, got)
	}
}

// The status says how old each endpoint's metrics are and whether they are
// stale: older than their max age (scrapes late or failing), as the
// picker then judges them.
func TestReportShowsStaleness(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name      string
		snap      *metrics.Snapshot
		wantStale bool
		wantAge   float64 // ms; -1: none
	}{
		{"fresh", &metrics.Snapshot{LastSuccess: now.Add(-40 * time.Millisecond), Interval: 50 * time.Millisecond, MaxAge: 250 * time.Millisecond}, false, 40},
		{"older than its max age", &metrics.Snapshot{LastSuccess: now.Add(-4 * time.Second), Interval: time.Second, MaxAge: 3 * time.Second}, true, 4000},
		{"failing, young values", &metrics.Snapshot{LastSuccess: now.Add(-100 * time.Millisecond), MaxAge: time.Second, Failing: true}, true, 100},
		{"never answered", &metrics.Snapshot{ScrapedAt: now, MaxAge: time.Second, Err: errors.New("refused")}, true, -1},
		{"read by another replica", &metrics.Snapshot{LastSuccess: now.Add(-time.Second), MaxAge: 3 * time.Second, From: "sy-2"}, false, 1000},
	} {
		got := scrapeOf(tc.snap, now)
		if got.Stale != tc.wantStale {
			t.Errorf("%s: stale %v, want %v", tc.name, got.Stale, tc.wantStale)
		}
		switch {
		case tc.wantAge < 0 && got.AgeMS != nil:
			t.Errorf("%s: age %v, want none", tc.name, *got.AgeMS)
		case tc.wantAge >= 0 && (got.AgeMS == nil || *got.AgeMS != tc.wantAge):
			t.Errorf("%s: age %v, want %v ms", tc.name, got.AgeMS, tc.wantAge)
		}
		if got.From != tc.snap.From || got.MaxAgeMS != float64(tc.snap.MaxAge.Milliseconds()) {
			t.Errorf("%s: %+v", tc.name, got)
		}
	}
	if scrapeOf(nil, now) != nil {
		t.Error("an endpoint never scraped has no scrape section")
	}
}
