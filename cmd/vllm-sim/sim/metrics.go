package sim

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Histogram bucket bounds as vLLM 0.32 declares them.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	requestLatencyBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
		30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	iterationTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
	paramsNBuckets        = []float64{1, 2, 5, 10, 20}
	preemptionBuckets     = []float64{1, 2, 3, 4, 5, 10, 20}
)

// buckets125 returns 1, 2, 5, 10, 20, 50, ... up to max.
func buckets125(max int) []float64 {
	var out []float64
	for p := 1; ; p *= 10 {
		for _, m := range []int{1, 2, 5} {
			if m*p > max {
				return out
			}
			out = append(out, float64(m*p))
		}
	}
}

type histogram struct {
	bounds []float64
	counts []uint64 // per bucket, not cumulative
	sum    float64
	count  uint64
}

func newHistogram(bounds []float64) histogram {
	return histogram{bounds: bounds, counts: make([]uint64, len(bounds))}
}

func (h *histogram) observe(v float64) {
	h.sum += v
	h.count++
	i := sort.SearchFloat64s(h.bounds, v) // first bound >= v
	if i < len(h.bounds) {
		h.counts[i]++
	}
}

type loraInfo struct {
	running, waiting string
	ts               float64
}

// counters holds the engine's cumulative metrics; guarded by Engine.mu.
type counters struct {
	preemptions   uint64
	prefixQueries uint64
	prefixHits    uint64
	// Tokens asked of and found by the KV connector (remote prefills).
	externalQueries  uint64
	externalHits     uint64
	promptTokens     uint64
	generationTokens uint64
	steps            uint64
	success          map[string]uint64
	ttft             histogram
	itl              histogram
	e2e              histogram
	queueTime        histogram
	prefillTime      histogram // first scheduled to first token
	inferenceTime    histogram // first scheduled to the last token
	prefillComputed  histogram // prompt tokens computed, cached ones excluded
	reqPrompt        histogram
	reqGeneration    histogram
	iterTokens       histogram // tokens per engine step
	reqMaxGen        histogram // max_tokens of each finished request
	paramsN          histogram
	paramsMaxTokens  histogram
	tpot             histogram // per request: decode time per output token after the first
	decodeTime       histogram // first token to the last
	numPreempt       histogram // times each request was preempted
	loraInfo         map[string]loraInfo
}

func newCounters(maxModelLen int) counters {
	return counters{
		success:         map[string]uint64{"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0},
		ttft:            newHistogram(ttftBuckets),
		itl:             newHistogram(itlBuckets),
		e2e:             newHistogram(requestLatencyBuckets),
		queueTime:       newHistogram(requestLatencyBuckets),
		prefillTime:     newHistogram(requestLatencyBuckets),
		inferenceTime:   newHistogram(requestLatencyBuckets),
		prefillComputed: newHistogram(buckets125(maxModelLen)),
		reqPrompt:       newHistogram(buckets125(maxModelLen)),
		reqGeneration:   newHistogram(buckets125(maxModelLen)),
		iterTokens:      newHistogram(iterationTokenBuckets),
		reqMaxGen:       newHistogram(buckets125(maxModelLen)),
		paramsN:         newHistogram(paramsNBuckets),
		paramsMaxTokens: newHistogram(buckets125(maxModelLen)),
		tpot:            newHistogram(itlBuckets),
		decodeTime:      newHistogram(requestLatencyBuckets),
		numPreempt:      newHistogram(preemptionBuckets),
		loraInfo:        map[string]loraInfo{},
	}
}

// maxLoRAInfoSeries bounds how many old vllm:lora_requests_info label sets
// are kept (vLLM keeps all; readers take the newest value).
const maxLoRAInfoSeries = 64

// touchLoRAInfo stamps the current adapter sets with now. Called with e.mu held.
func (e *Engine) touchLoRAInfo(now time.Time) {
	if !e.cfg.EnableLoRA {
		return
	}
	run, wait := e.loraSets()
	info := loraInfo{running: strings.Join(run, ","), waiting: strings.Join(wait, ","),
		ts: float64(now.UnixNano()) / 1e9}
	m := e.stats.loraInfo
	m[info.running+"\x00"+info.waiting] = info
	if len(m) > maxLoRAInfoSeries {
		oldest, oldestTS := "", 0.0
		for k, v := range m {
			if oldest == "" || v.ts < oldestTS {
				oldest, oldestTS = k, v.ts
			}
		}
		delete(m, oldest)
	}
}

// WriteMetrics writes the engine's metrics page (see MetricsPage).
func (e *Engine) WriteMetrics(w io.Writer) error {
	_, err := w.Write(e.MetricsPage())
	return err
}

// MetricsPage returns the engine's metrics in the Prometheus text format
// as vLLM 0.32 serves them: its process and Python families, then every
// vllm: family it exports, in its order, with its label names (sorted, as
// prometheus_client writes them) and _created series. The page is
// rendered again only after the engine's state changed: an idle engine
// answers every scrape with the same bytes. The caller must not modify
// them.
func (e *Engine) MetricsPage() []byte {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expireHeld(e.clock.Now()) // a lease that ran out changes the page
	if e.page != nil && e.pageVersion == e.version {
		return e.page
	}
	e.page = e.renderMetrics(make([]byte, 0, max(len(e.page), 16<<10)))
	e.pageVersion = e.version
	return e.page
}

// renderMetrics appends the page to b. Called with e.mu held.
func (e *Engine) renderMetrics(b []byte) []byte {
	mw := &metricWriter{b: b, model: escapeLabel(e.cfg.Model), created: formatFloat(float64(e.created.UnixNano()) / 1e9)}
	st := &e.stats

	mw.processFamilies(e.created)
	mw.counter("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).", "", 0)
	mw.counter("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).", "", 0)
	mw.counter("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).", "", 0)
	mw.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float64(len(e.running)))
	mw.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(len(e.waiting)))
	mw.header("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.", "gauge")
	mw.sample("vllm:num_requests_waiting_by_reason", `reason="capacity"`, float64(len(e.waiting)))
	mw.sample("vllm:num_requests_waiting_by_reason", `reason="deferred"`, 0)
	mw.header("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", "gauge")
	mw.sample("vllm:engine_sleep_state", `sleep_state="awake"`, 1)
	mw.sample("vllm:engine_sleep_state", `sleep_state="weights_offloaded"`, 0)
	mw.sample("vllm:engine_sleep_state", `sleep_state="discard_all"`, 0)
	if e.cfg.LegacyKVMetric {
		mw.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", e.kv.usage())
	} else {
		mw.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv.usage())
	}
	mw.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "", float64(st.prefixQueries))
	mw.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "", float64(st.prefixHits))
	// Real vLLM exports the external counters with or without a KV
	// connector; only a remote prefill's pull makes them count.
	mw.counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", "", float64(st.externalQueries))
	mw.counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", "", float64(st.externalHits))
	mw.counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", "", 0)
	mw.counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", "", 0)
	mw.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "", float64(st.preemptions))
	mw.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", "", float64(st.promptTokens))
	computed := float64(st.promptTokens) - float64(st.prefixHits) - float64(st.externalHits)
	mw.counters("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", []string{`source="local_compute"`, `source="local_cache_hit"`, `source="external_kv_transfer"`},
		[]float64{max(0, computed), float64(st.prefixHits), float64(st.externalHits)})
	mw.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", "", float64(st.prefixHits+st.externalHits))
	// Tokens pulled from a remote prefill count under external_unspecified:
	// the NIXL connector names no tier.
	mw.counters("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
		[]string{`source="device"`, `source="host"`, `source="p2p"`, `source="disk"`, `source="external_unspecified"`}, []float64{float64(st.prefixHits), 0, 0, 0, float64(st.externalHits)})
	mw.counter("vllm:generation_tokens", "Number of generation tokens processed.", "", float64(st.generationTokens))
	reasons := []string{"stop", "length", "abort", "error", "repetition"}
	var labels []string
	var values []float64
	for _, r := range reasons {
		labels = append(labels, `finished_reason="`+r+`"`)
		values = append(values, float64(st.success[r]))
	}
	mw.counters("vllm:request_success", "Count of successfully processed requests.", labels, values)
	mw.noEngine = true // vLLM counts admission per model, not per engine
	mw.counters("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
		[]string{`reason="max_num_queued_reqs"`, `reason="max_num_queued_tokens"`}, []float64{0, 0})
	mw.noEngine = false

	mw.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", &st.reqPrompt)
	mw.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", &st.reqGeneration)
	mw.histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", &st.iterTokens)
	mw.histogram("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", &st.reqMaxGen)
	mw.histogram("vllm:request_params_n", "Histogram of the n request parameter.", &st.paramsN)
	mw.histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", &st.paramsMaxTokens)
	mw.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &st.ttft)
	mw.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &st.itl)
	mw.histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", &st.tpot)
	mw.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &st.e2e)
	mw.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", &st.queueTime)
	mw.histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", &st.inferenceTime)
	mw.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", &st.prefillTime)
	mw.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", &st.decodeTime)
	mw.histogram("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.", &st.numPreempt)
	mw.histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", &st.prefillComputed)

	if e.cfg.EnableLoRA {
		mw.header("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
		infos := make([]loraInfo, 0, len(st.loraInfo))
		for _, v := range st.loraInfo {
			infos = append(infos, v)
		}
		sort.Slice(infos, func(i, j int) bool { return infos[i].ts < infos[j].ts })
		for _, v := range infos {
			mw.line(fmt.Sprintf("vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=\"%s\",waiting_lora_adapters=\"%s\"} %s",
				e.cfg.MaxLoRAs, escapeLabel(v.running), escapeLabel(v.waiting), formatFloat(v.ts)))
		}
	}

	mw.header("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
	// The label set vLLM 0.32 publishes (recorded in cmd/vllm-sim/testdata);
	// routers read block_size and num_gpu_blocks.
	mw.line(fmt.Sprintf("vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"%d\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"%d\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"%s\",engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"%s\",kv_cache_memory_bytes=\"None\",kv_cache_size_tokens=\"%d\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"float32\",num_cpu_blocks=\"None\",num_gpu_blocks=\"%d\",num_gpu_blocks_override=\"%d\",prefix_cache_retention_interval=\"0\",prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"True\"} 1.0",
		e.cfg.BlockSize, e.cfg.BlockSize, pyBool(e.cfg.EnablePrefixCaching),
		formatFloat(float64(e.cfg.NumGPUBlocks*e.cfg.BlockSize)/float64(max(1, e.cfg.MaxModelLen))),
		e.cfg.NumGPUBlocks*e.cfg.BlockSize, e.cfg.NumGPUBlocks, e.cfg.NumGPUBlocks))
	return mw.b
}

// metricWriter appends families in the text format. Series carry the
// labels engine="0" and model_name, with a family's own label between
// or after them as sorting puts it.
type metricWriter struct {
	b        []byte
	model    string // escaped
	created  string // the engine's start, for _created series
	noEngine bool   // leave out engine="0"
}

func (m *metricWriter) line(s string) {
	m.b = append(m.b, s...)
	m.b = append(m.b, '\n')
}

func (m *metricWriter) header(name, help, typ string) {
	m.b = append(m.b, "# HELP "...)
	m.b = append(m.b, name...)
	m.b = append(m.b, ' ')
	m.b = append(m.b, help...)
	m.b = append(m.b, "\n# TYPE "...)
	m.b = append(m.b, name...)
	m.b = append(m.b, ' ')
	m.b = append(m.b, typ...)
	m.b = append(m.b, '\n')
}

// sample writes name{labels} v, extra being one `key="value"` pair or "".
func (m *metricWriter) sample(name, extra string, v float64) {
	m.b = append(m.b, name...)
	m.b = append(m.b, '{')
	key, _, _ := strings.Cut(extra, "=")
	first := true
	put := func(s string) {
		if !first {
			m.b = append(m.b, ',')
		}
		first = false
		m.b = append(m.b, s...)
	}
	if !m.noEngine {
		put(`engine="0"`)
	}
	if extra != "" && key < "model_name" {
		put(extra)
	}
	put(`model_name="`)
	m.b = append(m.b, m.model...)
	m.b = append(m.b, '"')
	if extra != "" && key > "model_name" {
		put(extra)
	}
	m.b = append(m.b, "} "...)
	m.b = appendFloat(m.b, v)
	m.b = append(m.b, '\n')
}

func (m *metricWriter) gauge(name, help string, v float64) {
	m.header(name, help, "gauge")
	m.sample(name, "", v)
}

// counter writes a counter family base_total and its base_created gauge.
func (m *metricWriter) counter(base, help, extra string, v float64) {
	m.counters(base, help, []string{extra}, []float64{v})
}

// counters is counter with one series per label pair.
func (m *metricWriter) counters(base, help string, extras []string, vs []float64) {
	m.header(base+"_total", help, "counter")
	for i, x := range extras {
		m.sample(base+"_total", x, vs[i])
	}
	m.header(base+"_created", help, "gauge")
	for _, x := range extras {
		m.createdSample(base+"_created", x)
	}
}

func (m *metricWriter) createdSample(name, extra string) {
	m.sample(name, extra, 0)
	// Replace the 0.0 just written with the creation time.
	m.b = append(m.b[:len(m.b)-len("0.0\n")], m.created...)
	m.b = append(m.b, '\n')
}

func (m *metricWriter) histogram(name, help string, h *histogram) {
	m.header(name, help, "histogram")
	var cum uint64
	bucket := name + "_bucket"
	for i, b := range h.bounds {
		cum += h.counts[i]
		m.sample(bucket, `le="`+formatFloat(b)+`"`, float64(cum))
	}
	m.sample(bucket, `le="+Inf"`, float64(h.count))
	m.sample(name+"_count", "", float64(h.count))
	m.sample(name+"_sum", "", h.sum)
	m.header(name+"_created", help, "gauge")
	m.createdSample(name+"_created", "")
}

// processFamilies writes the Python client's process and interpreter
// families that head a vLLM page (values of a plausible API server).
func (m *metricWriter) processFamilies(start time.Time) {
	for _, f := range []struct{ name, help, v string }{
		{"python_gc_objects_collected_total", "Objects collected during gc", "1000.0"},
		{"python_gc_objects_uncollectable_total", "Uncollectable objects found during GC", "0.0"},
		{"python_gc_collections_total", "Number of times this generation was collected", "100.0"},
	} {
		m.header(f.name, f.help, "counter")
		for _, g := range []string{"0", "1", "2"} {
			m.line(f.name + `{generation="` + g + `"} ` + f.v)
		}
	}
	m.header("python_info", "Python platform information", "gauge")
	m.line(`python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0`)
	for _, f := range []struct{ name, help, typ, v string }{
		{"process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", "4.649873408e+09"},
		{"process_resident_memory_bytes", "Resident memory size in bytes.", "gauge", "1.036918784e+09"},
		{"process_start_time_seconds", "Start time of the process since unix epoch in seconds.", "gauge", formatFloat(float64(start.Unix()))},
		{"process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter", "6.51"},
		{"process_open_fds", "Number of open file descriptors.", "gauge", "34.0"},
		{"process_max_fds", "Maximum number of open file descriptors.", "gauge", "1.048576e+06"},
	} {
		m.header(f.name, f.help, f.typ)
		m.line(f.name + " " + f.v)
	}
}

func appendFloat(b []byte, v float64) []byte {
	n := len(b)
	b = strconv.AppendFloat(b, v, 'g', -1, 64)
	for _, c := range b[n:] {
		if c == '.' || c == 'e' || c == 'E' || c == 'n' || c == 'N' {
			return b
		}
	}
	return append(b, ".0"...) // the Python client's look: 1.0, not 1
}

func formatFloat(v float64) string {
	s := strconv.FormatFloat(v, 'g', -1, 64)
	if !strings.ContainsAny(s, ".eEn") { // keep the Python client's look: 1.0, not 1
		s += ".0"
	}
	return s
}

func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

func escapeLabel(s string) string {
	if !strings.ContainsAny(s, "\\\"\n") {
		return s
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
	return r.Replace(s)
}
