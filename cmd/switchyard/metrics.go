package main

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metricsHandler serves /metrics. Everything is read from the components'
// own counters when Prometheus scrapes, so metrics cost the request path
// nothing. Names follow the upstream inference extension where one exists
// (inference_pool_*), the rest are switchyard_*; README documents each.
func (a *app) metricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&appCollector{a: a},
		tlsCollector{a: a},
		a.usage.Collector(),
	)
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

type appCollector struct{ a *app }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

var (
	mBuild          = desc("switchyard_build_info", "Always 1; the version label names the build.", "version")
	mRegVersion     = desc("switchyard_registry_version", "Version of the registry state in force.")
	mConfigError    = desc("switchyard_config_error", "1 while the latest configuration refresh failed (the last good configuration stays in force).")
	mPoolReady      = desc("inference_pool_ready_pods", "Endpoints of the pool that can take requests (not draining, metrics not failing).", "name")
	mPoolQueue      = desc("inference_pool_average_queue_size", "Average scraped queue length over the pool's endpoints.", "name")
	mPoolKV         = desc("inference_pool_average_kv_cache_utilization", "Average scraped KV-cache utilisation (0..1) over the pool's endpoints.", "name")
	mPodQueue       = desc("inference_pool_per_pod_queue_size", "Scraped queue length of each endpoint.", "name", "model_server_pod")
	mEpRunning      = desc("switchyard_endpoint_running_requests", "Scraped running requests of each endpoint.", "pool", "endpoint")
	mEpKV           = desc("switchyard_endpoint_kv_cache_utilization", "Scraped KV-cache utilisation (0..1) of each endpoint.", "pool", "endpoint")
	mEpHealthy      = desc("switchyard_endpoint_healthy", "1 when the endpoint's metrics scrapes succeed, 0 when they fail.", "pool", "endpoint")
	mEpScrapeAge    = desc("switchyard_endpoint_metrics_age_seconds", "Age of the endpoint's latest successful metrics scrape.", "pool", "endpoint")
	mEpInFlight     = desc("switchyard_endpoint_in_flight_requests", "Requests the picker sent to the endpoint that have not finished.", "pool", "endpoint")
	mEpInFlightTok  = desc("switchyard_endpoint_in_flight_tokens", "Estimated prompt tokens of the endpoint's in-flight requests.", "pool", "endpoint")
	mEpPicked       = desc("switchyard_endpoint_picked_total", "Times the endpoint was the picker's primary choice.", "pool", "endpoint")
	mEpServed       = desc("switchyard_endpoint_served_total", "Responses Envoy reported as served by the endpoint.", "pool", "endpoint")
	mRequests       = desc("switchyard_picker_requests_total", "Requests the picker processed.")
	mRewrites       = desc("switchyard_picker_model_rewrites_total", "Requests whose model was rewritten to a weighted target.")
	mFallback       = desc("switchyard_picker_fallback_served_total", "Requests served by a fallback endpoint instead of the primary.")
	mLocalReplies   = desc("switchyard_picker_local_replies_total", "Requests the picker answered itself, by HTTP status (404 unknown model, 429 shed, 503 no endpoint, ...).", "code")
	mXDSSnapshots   = desc("switchyard_xds_snapshots_total", "Snapshots pushed to the xDS cache.")
	mXDSFailures    = desc("switchyard_xds_translation_failures_total", "Translations that failed validation; the previous snapshot stayed in force.")
	mXDSAcks        = desc("switchyard_xds_acks_total", "ACKs received from the Envoy node.", "node")
	mXDSNacks       = desc("switchyard_xds_nacks_total", "NACKs (rejected configuration) received from the Envoy node.", "node")
	mXDSStreams     = desc("switchyard_xds_streams", "Open xDS streams of the Envoy node (0 = disconnected).", "node")
	mConsulUp       = desc("switchyard_consul_up", "1 when the latest Consul query for the selector succeeded.", "service", "tag", "datacenter", "passing_only")
	mConsulInst     = desc("switchyard_consul_instances", "Instances in Consul's latest answer for the selector.", "service", "tag", "datacenter", "passing_only")
	mConsulLastSync = desc("switchyard_consul_last_success_timestamp_seconds", "When Consul last answered for the selector.", "service", "tag", "datacenter", "passing_only")
	mObjRequests    = desc("inference_objective_request_total", "Requests for each declared model, by the target it was sent as.", "model_name", "target_model_name")
	mObjErrors      = desc("inference_objective_request_error_total", "Requests for each declared model the picker answered with an error, by HTTP status.", "model_name", "target_model_name", "error_code")
	mObjRunning     = desc("inference_objective_running_requests", "Requests for each declared model picked and not finished yet.", "model_name")
	mDecision       = desc("inference_extension_scheduler_e2e_duration_seconds", "Time the picker took to decide a request (parse, filter, score, pick), rejections included.")
	mPrefixSize     = desc("inference_extension_prefix_indexer_size", "Entries in the pool's prefix-cache index (per-endpoint LRU entries).", "name")
	mPrefixBytes    = desc("switchyard_prefix_index_bytes", "Memory held by the pool's prefix-cache index.", "name")
	mPrefixPrompt   = desc("switchyard_prefix_prompt_blocks_total", "KV blocks of the prompts the picker routed in the pool.", "name")
	mPrefixMatched  = desc("switchyard_prefix_matched_blocks_total", "Of those, blocks the chosen endpoint was believed to hold; matched/prompt is the prefix hit ratio.", "name")
	mGuardHeld      = desc("switchyard_discovery_guard_held_endpoints", "Endpoints the pool's discovery guard keeps routable although their source reports them failing (too many failed at once).", "pool")
	mGuardStarts    = desc("switchyard_discovery_guard_activations_total", "Times the pool's discovery guard started holding endpoints.", "pool")
	mReplicas       = desc("switchyard_replicas", "Replicas of the configuration (this one included).")
	mPeerSharing    = desc("switchyard_replica_sharing", "1 while this replica's picks stream to the peer replica.", "peer")
	mPeerDropped    = desc("switchyard_replica_events_dropped_total", "Pick events the peer replica's full queue dropped (its stream is then reset).", "peer")
	mPeerLag        = desc("switchyard_replica_lag_seconds", "Age of the latest batch of picks from the peer replica on arrival (replication lag; clocks of both hosts).", "peer")
	mPeerPicks      = desc("switchyard_replica_peer_picks_total", "Picks the other replicas shared with this one.")
	mPoolSaturated  = desc("switchyard_pool_saturated", "1 while every eligible endpoint of the pool is over queue_threshold or kv_threshold (sheddable requests get 429).", "name")
)

func (c *appCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{mBuild, mRegVersion, mConfigError, mPoolReady, mPoolQueue, mPoolKV, mPodQueue,
		mEpRunning, mEpKV, mEpHealthy, mEpScrapeAge, mEpInFlight, mEpInFlightTok, mEpPicked, mEpServed,
		mRequests, mRewrites, mFallback, mLocalReplies, mXDSSnapshots, mXDSFailures, mXDSAcks, mXDSNacks, mXDSStreams,
		mConsulUp, mConsulInst, mConsulLastSync, mObjRequests, mObjErrors, mObjRunning, mDecision,
		mPrefixSize, mPrefixBytes, mPrefixPrompt, mPrefixMatched, mPoolSaturated, mGuardHeld, mGuardStarts,
		mReplicas, mPeerSharing, mPeerDropped, mPeerLag, mPeerPicks} {
		ch <- d
	}
}

func (c *appCollector) Collect(ch chan<- prometheus.Metric) {
	a := c.a
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	st, _ := a.view.Current()
	gauge(mBuild, 1, versionString())
	gauge(mRegVersion, float64(st.Version))
	gauge(mConfigError, boolf(a.manager.LastError() != nil))

	now := time.Now()
	ps := a.picker.Stats()
	type poolAgg struct {
		ready, scraped  int
		queueSum, kvSum float64
	}
	pools := map[string]*poolAgg{}
	for _, name := range st.PoolNames() {
		pools[name] = &poolAgg{}
	}
	eh := a.picker.EndpointHealth()
	for _, e := range ps.Endpoints {
		agg := pools[e.Pool]
		if agg == nil {
			agg = &poolAgg{}
			pools[e.Pool] = agg
		}
		healthy := !eh.Unhealthy(e.Pool, e.Address)
		if m := e.Metrics; m != nil && !m.LastSuccess.IsZero() {
			v := m.Values
			agg.scraped++
			agg.queueSum += float64(v.Waiting)
			agg.kvSum += v.KVUsage
			gauge(mPodQueue, float64(v.Waiting), e.Pool, e.Address)
			gauge(mEpRunning, float64(v.Running), e.Pool, e.Address)
			gauge(mEpKV, v.KVUsage, e.Pool, e.Address)
			gauge(mEpScrapeAge, now.Sub(m.LastSuccess).Seconds(), e.Pool, e.Address)
			healthy = healthy && !m.Failing
		}
		gauge(mEpHealthy, boolf(healthy), e.Pool, e.Address)
		if healthy && !e.Draining {
			agg.ready++
		}
		gauge(mEpInFlight, float64(e.InFlightRequests), e.Pool, e.Address)
		gauge(mEpInFlightTok, float64(e.InFlightTokens), e.Pool, e.Address)
		counter(mEpPicked, float64(e.Picked), e.Pool, e.Address)
		counter(mEpServed, float64(e.Served), e.Pool, e.Address)
	}
	for name, agg := range pools {
		gauge(mPoolReady, float64(agg.ready), name)
		if agg.scraped > 0 {
			gauge(mPoolQueue, agg.queueSum/float64(agg.scraped), name)
			gauge(mPoolKV, agg.kvSum/float64(agg.scraped), name)
		}
	}
	counter(mRequests, float64(ps.Requests))
	counter(mRewrites, float64(ps.Rewritten))
	counter(mFallback, float64(ps.FallbackServed))
	for code, n := range ps.Rejected {
		counter(mLocalReplies, float64(n), strconv.Itoa(code))
	}
	obs := a.picker.Observe(now)
	for _, o := range obs.Objectives {
		counter(mObjRequests, float64(o.Requests), o.Model, o.Target)
		for code, n := range o.Errors {
			counter(mObjErrors, float64(n), o.Model, o.Target, strconv.Itoa(code))
		}
	}
	for m, n := range obs.Running {
		gauge(mObjRunning, float64(n), m)
	}
	h := obs.Decision
	buckets := make(map[float64]uint64, len(h.Bounds))
	for i, b := range h.Bounds {
		buckets[b] = h.Cumulative[i]
	}
	ch <- prometheus.MustNewConstHistogram(mDecision, h.Count, h.SumSeconds, buckets)
	for _, p := range obs.Pools {
		gauge(mPrefixSize, float64(p.PrefixEntries), p.Name)
		gauge(mPrefixBytes, float64(p.PrefixBytes), p.Name)
		counter(mPrefixPrompt, float64(p.PromptBlocks), p.Name)
		counter(mPrefixMatched, float64(p.MatchedBlocks), p.Name)
		gauge(mPoolSaturated, boolf(p.Saturated), p.Name)
	}

	gauge(mReplicas, float64(max(len(st.Replicas), 1)))
	counter(mPeerPicks, float64(ps.PeerPicks))
	if a.mesh != nil {
		ms := a.mesh.Stats()
		for _, p := range ms.Peers {
			gauge(mPeerSharing, boolf(p.Connected), p.Address)
			counter(mPeerDropped, float64(p.Dropped), p.Address)
		}
		for _, in := range ms.Inbound {
			gauge(mPeerLag, in.Lag.Seconds(), in.From)
		}
	}
	rs := a.manager.Status()
	held := map[string]int{}
	for _, g := range rs.Guards {
		held[g.Pool] = len(g.Held)
	}
	for _, name := range st.PoolNames() {
		gauge(mGuardHeld, float64(held[name]), name)
		counter(mGuardStarts, float64(rs.GuardActivations[name]), name)
	}

	xs := a.xds.Stats()
	counter(mXDSSnapshots, float64(xs.Snapshots))
	counter(mXDSFailures, float64(xs.Failures))
	for _, n := range a.xds.Nodes() {
		counter(mXDSAcks, float64(n.ACKs), n.ID)
		counter(mXDSNacks, float64(n.NACKs), n.ID)
		gauge(mXDSStreams, float64(n.Streams), n.ID)
	}
	for _, s := range a.consul.Status() {
		l := []string{s.Selector.Service, s.Selector.Tag, s.Selector.Datacenter, strconv.FormatBool(s.Selector.PassingOnly)}
		gauge(mConsulUp, boolf(s.Up), l...)
		gauge(mConsulInst, float64(s.Instances), l...)
		if !s.LastSuccess.IsZero() {
			gauge(mConsulLastSync, float64(s.LastSuccess.UnixNano())/1e9, l...)
		}
	}
}

func boolf(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
