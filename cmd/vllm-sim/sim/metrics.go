package sim

import (
	"bufio"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Histogram bucket bounds as vLLM 0.11 declares them.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	requestLatencyBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
		30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
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
	loraInfo         map[string]loraInfo
}

func newCounters(maxModelLen int) counters {
	return counters{
		success:         map[string]uint64{"stop": 0, "length": 0, "abort": 0},
		ttft:            newHistogram(ttftBuckets),
		itl:             newHistogram(itlBuckets),
		e2e:             newHistogram(requestLatencyBuckets),
		queueTime:       newHistogram(requestLatencyBuckets),
		prefillTime:     newHistogram(requestLatencyBuckets),
		inferenceTime:   newHistogram(requestLatencyBuckets),
		prefillComputed: newHistogram(buckets125(maxModelLen)),
		reqPrompt:       newHistogram(buckets125(maxModelLen)),
		reqGeneration:   newHistogram(buckets125(maxModelLen)),
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

// WriteMetrics writes the engine's metrics in the Prometheus text format
// with vLLM 0.11's names, types and labels.
func (e *Engine) WriteMetrics(w io.Writer) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expireHeld(e.clock.Now())
	bw := bufio.NewWriter(w)
	mw := &metricWriter{w: bw, labels: `model_name="` + escapeLabel(e.cfg.Model) + `",engine="0"`}
	st := &e.stats

	mw.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float64(len(e.running)))
	mw.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(len(e.waiting)))
	if e.cfg.LegacyKVMetric {
		mw.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", e.kv.usage())
	} else {
		mw.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv.usage())
	}
	mw.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", st.prefixQueries)
	mw.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", st.prefixHits)
	if e.cfg.KVConnector {
		mw.counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", st.externalQueries)
		mw.counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", st.externalHits)
	}
	mw.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
	mw.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.promptTokens)
	mw.counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generationTokens)

	fmt.Fprintf(bw, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n")
	for _, reason := range []string{"abort", "length", "stop"} {
		fmt.Fprintf(bw, "vllm:request_success_total{%s,finished_reason=%q} %s\n", mw.labels, reason, formatFloat(float64(st.success[reason])))
	}

	mw.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", &st.reqPrompt)
	mw.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", &st.reqGeneration)
	mw.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &st.ttft)
	mw.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &st.itl)
	mw.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &st.e2e)
	mw.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", &st.queueTime)
	mw.histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", &st.inferenceTime)
	mw.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", &st.prefillTime)
	mw.histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", &st.prefillComputed)

	if e.cfg.EnableLoRA {
		fmt.Fprintf(bw, "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n")
		infos := make([]loraInfo, 0, len(st.loraInfo))
		for _, v := range st.loraInfo {
			infos = append(infos, v)
		}
		sort.Slice(infos, func(i, j int) bool { return infos[i].ts < infos[j].ts })
		for _, v := range infos {
			fmt.Fprintf(bw, "vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=\"%s\",waiting_lora_adapters=\"%s\"} %s\n",
				e.cfg.MaxLoRAs, escapeLabel(v.running), escapeLabel(v.waiting), formatFloat(v.ts))
		}
	}

	fmt.Fprintf(bw, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n")
	// The label set vLLM 0.32 publishes (recorded in cmd/vllm-sim/testdata);
	// routers read block_size and num_gpu_blocks.
	fmt.Fprintf(bw, "vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"%d\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"%d\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"%s\",engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"%s\",kv_cache_memory_bytes=\"None\",kv_cache_size_tokens=\"%d\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"float32\",num_cpu_blocks=\"None\",num_gpu_blocks=\"%d\",num_gpu_blocks_override=\"%d\",prefix_cache_retention_interval=\"0\",prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"True\"} 1.0\n",
		e.cfg.BlockSize, e.cfg.BlockSize, pyBool(e.cfg.EnablePrefixCaching),
		formatFloat(float64(e.cfg.NumGPUBlocks*e.cfg.BlockSize)/float64(max(1, e.cfg.MaxModelLen))),
		e.cfg.NumGPUBlocks*e.cfg.BlockSize, e.cfg.NumGPUBlocks, e.cfg.NumGPUBlocks)
	return bw.Flush()
}

type metricWriter struct {
	w      *bufio.Writer
	labels string
}

func (m *metricWriter) header(name, help, typ string) {
	fmt.Fprintf(m.w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}

func (m *metricWriter) gauge(name, help string, v float64) {
	m.header(name, help, "gauge")
	fmt.Fprintf(m.w, "%s{%s} %s\n", name, m.labels, formatFloat(v))
}

func (m *metricWriter) counter(base, help string, v uint64) {
	name := base + "_total"
	m.header(name, help, "counter")
	fmt.Fprintf(m.w, "%s{%s} %s\n", name, m.labels, formatFloat(float64(v)))
}

func (m *metricWriter) histogram(name, help string, h *histogram) {
	m.header(name, help, "histogram")
	var cum uint64
	for i, b := range h.bounds {
		cum += h.counts[i]
		fmt.Fprintf(m.w, "%s_bucket{%s,le=\"%s\"} %s\n", name, m.labels, formatFloat(b), formatFloat(float64(cum)))
	}
	fmt.Fprintf(m.w, "%s_bucket{%s,le=\"+Inf\"} %s\n", name, m.labels, formatFloat(float64(h.count)))
	fmt.Fprintf(m.w, "%s_sum{%s} %s\n", name, m.labels, formatFloat(h.sum))
	fmt.Fprintf(m.w, "%s_count{%s} %s\n", name, m.labels, formatFloat(float64(h.count)))
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
