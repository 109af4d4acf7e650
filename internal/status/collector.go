package status

import (
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/admission"
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

// The metrics. Names follow the upstream inference extension where one
// exists (inference_*), the rest are switchyard_*; README documents each,
// and the Grafana dashboard in examples/grafana queries them.
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
	mNodeUnreach    = desc("switchyard_discovery_node_unreachable_endpoints", "Endpoints whose own health checks last passed but whose Consul agent is unreachable (the node's serfHealth check is critical); they stay members, judged by their metrics scrapes.", "pool")
	mReplicas       = desc("switchyard_replicas", "Replicas of the configuration (this one included).")
	mPeerSharing    = desc("switchyard_replica_sharing", "1 while this replica's picks stream to the peer replica.", "peer")
	mPeerDropped    = desc("switchyard_replica_events_dropped_total", "Pick events the peer replica's full queue dropped (its stream is then reset).", "peer")
	mPeerLag        = desc("switchyard_replica_lag_seconds", "Age of the latest batch of picks from the peer replica on arrival (replication lag; clocks of both hosts).", "peer")
	mPeerPicks      = desc("switchyard_replica_peer_picks_total", "Picks the other replicas shared with this one.")
	mPeerReadings   = desc("switchyard_replica_peer_readings_total", "Scrape readings the other replicas shared that this one published.")
	mPoolSaturated  = desc("switchyard_pool_saturated", "1 while every eligible endpoint of the pool is over queue_threshold or kv_threshold (requests wait in the admission queue).", "name")
	mFCSaturation   = desc("inference_extension_flow_control_pool_saturation", "Share (0..1) of the pool's ready endpoints over queue_threshold or kv_threshold.", "inference_pool")
	mFCQueueSize    = desc("inference_extension_flow_control_queue_size", "Requests waiting in the pool's admission queue, by flow and priority band.", "fairness_id", "priority", "inference_pool")
	mFCQueueBytes   = desc("inference_extension_flow_control_queue_bytes", "Body bytes of the requests waiting in the pool's admission queue, by flow and priority band.", "fairness_id", "priority", "inference_pool")
	mFCQueueWait    = desc("inference_extension_flow_control_request_queue_duration_seconds", "Time requests spent in the admission queue, by priority band and outcome (dispatched, rejected_ttl, rejected_overflow, rejected_no_endpoint, evicted, cancelled).", "priority", "outcome", "inference_pool")
	mAdmDispatched  = desc("switchyard_admission_dispatched_total", "Requests the pool's admission queue held and then let go.", "pool")
	mAdmRejected    = desc("switchyard_admission_rejected_total", "Requests the pool's admission queue turned away, by reason (ttl, overflow, no-endpoint).", "pool", "reason")
	mAdmCancelled   = desc("switchyard_admission_cancelled_total", "Requests whose client gave up while they waited in the pool's admission queue.", "pool")
	mTLSRejected    = desc("switchyard_tls_rejected_connections_total", "TLS handshakes refused, by server (xds, extproc) and reason (no_certificate, unknown_ca, expired, not_yet_valid, san_not_allowed, bad_certificate, not_tls, aborted, other).", "server", "reason")
	mTLSExpiry      = desc("switchyard_tls_certificate_expiry_timestamp_seconds", "When the serving certificate expires (Unix time).")
	mTLSReloads     = desc("switchyard_tls_certificate_reloads_total", "Serving certificate or client CA replacements since start (file rotation, Consul renewal).")
	// Latency the router measures from the response stream (2xx responses).
	mObjTTFT      = desc("inference_objective_request_ttft_seconds", "Time from the request reaching the picker to the first response body bytes, per declared model and target, as the router measures it.", "model_name", "target_model_name")
	mObjTPOT      = desc("inference_objective_request_tpot_seconds", "Time per output token after the first, of streamed responses, per declared model and target, as the router measures it.", "model_name", "target_model_name")
	mObjDuration  = desc("inference_objective_request_duration_seconds", "Time from the request reaching the picker to the end of its response, per declared model and target.", "model_name", "target_model_name")
	mObjNTPOT     = desc("inference_objective_normalized_time_per_output_token_seconds", "Whole request time divided by its output tokens, per declared model and target.", "model_name", "target_model_name")
	mEpTTFT       = desc("switchyard_endpoint_ttft_seconds", "Time to first token of the responses the endpoint served, as the router measures it.", "pool", "endpoint")
	mEpTPOT       = desc("switchyard_endpoint_tpot_seconds", "Time per output token of the streamed responses the endpoint served, as the router measures it.", "pool", "endpoint")
	mEpDuration   = desc("switchyard_endpoint_request_duration_seconds", "Whole request time of the responses the endpoint served, as the router measures it.", "pool", "endpoint")
	mDecisionRecs = desc("switchyard_decision_records_total", "Decision records made (sampled requests).")
	// KV-cache events (pools that declare kv_events).
	mKVExact       = desc("switchyard_kv_events_exact", "1 while the endpoint's KV-cache events are synced and the picker routes by its exact cache; 0 while the estimating prefix index stands in (connecting, partial, disconnected).", "pool", "endpoint")
	mKVConnected   = desc("switchyard_kv_events_connected", "1 while the endpoint's KV-event stream is connected.", "pool", "endpoint")
	mKVBlocks      = desc("switchyard_kv_events_blocks", "Blocks the endpoint's events say its cache holds, by medium.", "pool", "endpoint", "medium")
	mKVBatches     = desc("switchyard_kv_events_batches_total", "Event batches applied.", "pool", "endpoint")
	mKVGaps        = desc("switchyard_kv_events_gaps_total", "Sequence gaps seen (missed batches), recovered through the replay socket unless counted as lost.", "pool", "endpoint")
	mKVReplayed    = desc("switchyard_kv_events_replayed_batches_total", "Batches received from the replay socket.", "pool", "endpoint")
	mKVLost        = desc("switchyard_kv_events_lost_total", "Times batches were lost beyond replay (the view was dropped and turned partial).", "pool", "endpoint")
	mKVRestarts    = desc("switchyard_kv_events_engine_restarts_total", "Engine restarts noticed (the old engine's blocks dropped).", "pool", "endpoint")
	mKVPredicted   = desc("switchyard_kv_events_predictions_total", "Predictions of a request's cached tokens checked against what the server reported, by result: agree, over (predicted more), under (exact predictions); bound (a lower bound met).", "pool", "endpoint", "result")
	mKVTokenize    = desc("switchyard_kv_tokenize_requests_total", "Requests of the pools with KV events, by how their prompt was keyed: hit (its whole prompt's tokens), prefix (a stable prefix's), miss (neither yet: the estimate routed it), unkeyed (no stable prefix).", "pool", "result")
	mKVTokCalls    = desc("switchyard_kv_tokenize_calls_total", "Background /tokenize calls, by result: ok, failure; dropped: no server had room in its budget.", "pool", "result")
	mKVTokVerified = desc("switchyard_kv_tokenize_verified_total", "Stable prefixes checked against their whole prompt's tokens, by result: agree, mismatch (the model is matched by whole prompts only from then on).", "pool", "result")
	mKVTokSecs     = desc("switchyard_kv_tokenize_seconds_total", "Time spent in /tokenize calls.", "pool")
	mPDDecisions   = desc("switchyard_pd_decisions_total", "Prefill/decode decisions of a disaggregated pool's completions and chat requests, by decision: split, or why the request went whole to its decode server (short-prompt, below-threshold, no-prefill-server, prefill-saturated, decode-role, off).", "pool", "decision")
	mDecisionDrops = desc("switchyard_decision_records_file_dropped_total", "Decision records the JSON-lines file missed because its writer fell behind.")
)

var allDescs = []*prometheus.Desc{mBuild, mRegVersion, mConfigError, mPoolReady, mPoolQueue, mPoolKV, mPodQueue,
	mEpRunning, mEpKV, mEpHealthy, mEpScrapeAge, mEpInFlight, mEpInFlightTok, mEpPicked, mEpServed,
	mRequests, mRewrites, mFallback, mLocalReplies, mXDSSnapshots, mXDSFailures, mXDSAcks, mXDSNacks, mXDSStreams,
	mConsulUp, mConsulInst, mConsulLastSync, mObjRequests, mObjErrors, mObjRunning, mDecision,
	mPrefixSize, mPrefixBytes, mPrefixPrompt, mPrefixMatched, mPoolSaturated, mGuardHeld, mGuardStarts, mNodeUnreach,
	mReplicas, mPeerSharing, mPeerDropped, mPeerLag, mPeerPicks, mPeerReadings, mTLSRejected, mTLSExpiry, mTLSReloads,
	mFCSaturation, mFCQueueSize, mFCQueueBytes, mFCQueueWait, mAdmDispatched, mAdmRejected, mAdmCancelled,
	mObjTTFT, mObjTPOT, mObjDuration, mObjNTPOT, mEpTTFT, mEpTPOT, mEpDuration, mDecisionRecs, mDecisionDrops,
	mKVExact, mKVConnected, mKVBlocks, mKVBatches, mKVGaps, mKVReplayed, mKVLost, mKVRestarts, mKVPredicted, mKVTokenize, mKVTokCalls, mKVTokVerified, mKVTokSecs, mPDDecisions}

// tlsZeroReasons are the rejection reasons exported as 0 before any
// happens, so alerts on rate() see the counter from the start.
var tlsZeroReasons = []string{mtls.ReasonNoCertificate, mtls.ReasonUnknownCA, mtls.ReasonExpired, mtls.ReasonSANNotAllowed}

// collector exports a Report read when Prometheus scrapes, so metrics
// cost the request path nothing between scrapes.
type collector struct {
	read func(now time.Time) *Report
}

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range allDescs {
		ch <- d
	}
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	collect(c.read(now), now, ch)
}

// collect sends r's metrics to ch.
func collect(r *Report, now time.Time, ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(mBuild, 1, r.Version)
	gauge(mRegVersion, float64(r.RegistryVersion))
	gauge(mConfigError, boolf(r.ConfigError != ""))

	for _, p := range r.Pools {
		ready, scraped := 0, 0
		var queueSum, kvSum float64
		for _, e := range p.Endpoints {
			if e.Waiting != nil {
				scraped++
				queueSum += float64(*e.Waiting)
				kvSum += *e.KVCacheUsage
				gauge(mPodQueue, float64(*e.Waiting), p.Name, e.Address)
				gauge(mEpRunning, float64(*e.Running), p.Name, e.Address)
				gauge(mEpKV, *e.KVCacheUsage, p.Name, e.Address)
				gauge(mEpScrapeAge, now.Sub(e.ScrapedAt).Seconds(), p.Name, e.Address)
			}
			gauge(mEpHealthy, boolf(e.Healthy), p.Name, e.Address)
			if e.Ready() {
				ready++
			}
			gauge(mEpInFlight, float64(e.InFlightRequests), p.Name, e.Address)
			gauge(mEpInFlightTok, float64(e.InFlightTokens), p.Name, e.Address)
			counter(mEpPicked, float64(e.Picked), p.Name, e.Address)
			counter(mEpServed, float64(e.Served), p.Name, e.Address)
			if kv := e.KVEvents; kv != nil {
				gauge(mKVExact, boolf(kv.Exact), p.Name, e.Address)
				gauge(mKVConnected, boolf(kv.Connected), p.Name, e.Address)
				gauge(mKVBlocks, float64(kv.Blocks), p.Name, e.Address, "GPU")
				for m, n := range kv.Media {
					gauge(mKVBlocks, float64(n), p.Name, e.Address, m)
				}
				counter(mKVBatches, float64(kv.Batches), p.Name, e.Address)
				counter(mKVGaps, float64(kv.Gaps), p.Name, e.Address)
				counter(mKVReplayed, float64(kv.Replayed), p.Name, e.Address)
				counter(mKVLost, float64(kv.Lost), p.Name, e.Address)
				counter(mKVRestarts, float64(kv.Restarts), p.Name, e.Address)
				counter(mKVPredicted, float64(kv.PredictionsAgreed), p.Name, e.Address, "agree")
				counter(mKVPredicted, float64(kv.PredictionsOver), p.Name, e.Address, "over")
				counter(mKVPredicted, float64(kv.PredictionsUnder), p.Name, e.Address, "under")
				counter(mKVPredicted, float64(kv.PredictionsBounded), p.Name, e.Address, "bound")
			}
		}
		if tok := p.KVTokenize; tok != nil {
			counter(mKVTokenize, float64(tok.Hits), p.Name, "hit")
			counter(mKVTokenize, float64(tok.PrefixHits), p.Name, "prefix")
			counter(mKVTokenize, float64(tok.Misses), p.Name, "miss")
			counter(mKVTokenize, float64(tok.Unkeyed), p.Name, "unkeyed")
			counter(mKVTokCalls, float64(tok.Calls-tok.Failures), p.Name, "ok")
			counter(mKVTokCalls, float64(tok.Failures), p.Name, "failure")
			counter(mKVTokCalls, float64(tok.Dropped), p.Name, "dropped")
			counter(mKVTokVerified, float64(tok.Verified-tok.Mismatches), p.Name, "agree")
			counter(mKVTokVerified, float64(tok.Mismatches), p.Name, "mismatch")
			counter(mKVTokSecs, tok.CallSeconds, p.Name)
		}
		gauge(mPoolReady, float64(ready), p.Name)
		if scraped > 0 {
			gauge(mPoolQueue, queueSum/float64(scraped), p.Name)
			gauge(mPoolKV, kvSum/float64(scraped), p.Name)
		}
		gauge(mPoolSaturated, boolf(p.Saturated), p.Name)
		held := 0
		if p.Guard != nil {
			held = len(p.Guard.Held)
		}
		gauge(mGuardHeld, float64(held), p.Name)
		counter(mGuardStarts, float64(p.GuardActivations), p.Name)
		unreachable := 0
		for _, e := range p.Endpoints {
			if e.NodeUnreachable {
				unreachable++
			}
		}
		gauge(mNodeUnreach, float64(unreachable), p.Name)
		if x := p.Prefix; x != nil {
			gauge(mPrefixSize, float64(x.Entries), p.Name)
			gauge(mPrefixBytes, float64(x.Bytes), p.Name)
			counter(mPrefixPrompt, float64(x.PromptBlocks), p.Name)
			counter(mPrefixMatched, float64(x.MatchedBlocks), p.Name)
		}
		if x := p.SaturatedShare; x != nil {
			gauge(mFCSaturation, *x, p.Name)
		}
		if q := p.Queue; q != nil {
			collectQueue(q, gauge, counter, ch)
		}
		for d, n := range p.PDDecisions {
			counter(mPDDecisions, float64(n), p.Name, d)
		}
	}

	pk := r.Picker
	counter(mRequests, float64(pk.Requests))
	counter(mRewrites, float64(pk.Rewritten))
	counter(mFallback, float64(pk.FallbackServed))
	for code, n := range pk.Rejected {
		counter(mLocalReplies, float64(n), strconv.Itoa(code))
	}
	for _, o := range r.Objectives {
		counter(mObjRequests, float64(o.Requests), o.Model, o.Target)
		for code, n := range o.Errors {
			counter(mObjErrors, float64(n), o.Model, o.Target, strconv.Itoa(code))
		}
	}
	for m, n := range r.Running {
		gauge(mObjRunning, float64(n), m)
	}
	hist := func(d *prometheus.Desc, h picker.Histogram, labels ...string) {
		buckets := make(map[float64]uint64, len(h.Bounds))
		for i, b := range h.Bounds {
			buckets[b] = h.Cumulative[i]
		}
		ch <- prometheus.MustNewConstHistogram(d, h.Count, h.SumSeconds, buckets, labels...)
	}
	for _, o := range r.Objectives {
		if l := o.Latency; l != nil {
			hist(mObjTTFT, l.TTFT, o.Model, o.Target)
			hist(mObjTPOT, l.TPOT, o.Model, o.Target)
			hist(mObjDuration, l.Duration, o.Model, o.Target)
			hist(mObjNTPOT, l.NTPOT, o.Model, o.Target)
		}
	}
	for _, e := range r.EndpointLatency {
		hist(mEpTTFT, e.TTFT, e.Pool, e.Address)
		hist(mEpTPOT, e.TPOT, e.Pool, e.Address)
		hist(mEpDuration, e.Duration, e.Pool, e.Address)
	}
	if d := r.Decisions; d != nil {
		counter(mDecisionRecs, float64(d.Recorded))
		counter(mDecisionDrops, float64(d.FileDropped))
	}
	if h := r.Decision; h != nil {
		buckets := make(map[float64]uint64, len(h.Bounds))
		for i, b := range h.Bounds {
			buckets[b] = h.Cumulative[i]
		}
		ch <- prometheus.MustNewConstHistogram(mDecision, h.Count, h.SumSeconds, buckets)
	}

	gauge(mReplicas, float64(max(len(r.Replicas), 1)))
	counter(mPeerPicks, float64(pk.PeerPicks))
	counter(mPeerReadings, float64(pk.PeerReadings))
	// Every peer label is the replica's one name (Report.Replicas' ID).
	for _, p := range r.Peers {
		name := peerName(r.Replicas, p.Address, p.ID)
		gauge(mPeerSharing, boolf(p.Connected), name)
		counter(mPeerDropped, float64(p.Dropped), name)
	}
	for _, in := range r.Inbound {
		gauge(mPeerLag, in.Lag.Seconds(), peerName(r.Replicas, in.Address, in.From))
	}

	counter(mXDSSnapshots, float64(r.XDS.Snapshots))
	counter(mXDSFailures, float64(r.XDS.Failures))
	for _, n := range r.Envoys {
		counter(mXDSAcks, float64(n.ACKs), n.ID)
		counter(mXDSNacks, float64(n.NACKs), n.ID)
		gauge(mXDSStreams, float64(n.Streams), n.ID)
	}
	for _, s := range r.Consul {
		l := []string{s.Selector.Service, s.Selector.Tag, s.Selector.Datacenter, strconv.FormatBool(s.Selector.PassingOnly)}
		gauge(mConsulUp, boolf(s.Up), l...)
		gauge(mConsulInst, float64(s.Instances), l...)
		if !s.LastSuccess.IsZero() {
			gauge(mConsulLastSync, float64(s.LastSuccess.UnixNano())/1e9, l...)
		}
	}

	if t := r.TLS; t != nil {
		rejected := map[[2]string]uint64{}
		for _, server := range []string{"xds", "extproc"} {
			for _, reason := range tlsZeroReasons {
				rejected[[2]string{server, reason}] = 0
			}
		}
		for k, v := range t.Rejected {
			server, reason := splitRejectKey(k)
			rejected[[2]string{server, reason}] = v
		}
		for k, v := range rejected {
			counter(mTLSRejected, float64(v), k[0], k[1])
		}
		gauge(mTLSExpiry, float64(t.NotAfter.Unix()))
		counter(mTLSReloads, float64(t.Reloads))
	}
}

// splitRejectKey splits TLS.Rejected's "server/reason" key.
func splitRejectKey(k string) (server, reason string) {
	server, reason, _ = strings.Cut(k, "/")
	return server, reason
}

func boolf(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// collectQueue exports one pool's admission queue.
func collectQueue(q *admission.Stats, gauge, counter func(*prometheus.Desc, float64, ...string), ch chan<- prometheus.Metric) {
	for _, w := range q.Waiting {
		prio := strconv.Itoa(w.Priority)
		gauge(mFCQueueSize, float64(w.Requests), w.Flow, prio, q.Pool)
		gauge(mFCQueueBytes, float64(w.Bytes), w.Flow, prio, q.Pool)
	}
	bounds := admission.WaitBounds()
	for k, h := range q.Wait {
		buckets := make(map[float64]uint64, len(bounds))
		for i, b := range bounds {
			buckets[b] = h.Cumulative[i]
		}
		ch <- prometheus.MustNewConstHistogram(mFCQueueWait, h.Count, h.SumSeconds, buckets, strconv.Itoa(k.Priority), k.Outcome, q.Pool)
	}
	counter(mAdmDispatched, float64(q.Dispatched), q.Pool)
	counter(mAdmCancelled, float64(q.Cancelled), q.Pool)
	for reason, n := range q.Rejected {
		counter(mAdmRejected, float64(n), q.Pool, reason)
	}
}
