// Package metrics owns reading model-server load metrics: it knows each
// engine's Prometheus dialect (vLLM, SGLang, trtllm-serve, Triton
// TensorRT-LLM), parses one /metrics page into an immutable Snapshot, and
// runs a Manager that scrapes every endpoint on its own interval and
// publishes the latest Snapshot per endpoint for lock-free reads, with
// the endpoint's speed (Perf) as successive pages tell it.
//
// The package knows nothing about scheduling; scorers read Snapshots.
package metrics

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/switchyard/switchyard/registry"
)

// Logical metric names, the keys of per-pool overrides
// (registry.Scheduling.Metrics).
const (
	LogicalWaiting     = "waiting"
	LogicalRunning     = "running"
	LogicalKVUsage     = "kv_usage"
	LogicalLoraInfo    = "lora_info"
	LogicalCacheConfig = "cache_config"
)

// LogicalNames lists every logical metric name an override may use.
func LogicalNames() []string {
	return []string{LogicalWaiting, LogicalRunning, LogicalKVUsage, LogicalLoraInfo, LogicalCacheConfig}
}

// ErrUnknownEngine is returned for an engine with no known dialect.
var ErrUnknownEngine = errors.New("unknown engine")

// selector picks the series of one metric family, optionally only those
// carrying label == value.
type selector struct {
	name  string
	label string
	value string
}

func (s selector) String() string {
	if s.label == "" {
		return s.name
	}
	return fmt.Sprintf("%s{%s=%q}", s.name, s.label, s.value)
}

// source says where an integer cache setting comes from: either a label of
// an info-style series (fromLabel != "") or the sample value itself.
type source struct {
	sel       selector
	fromLabel string
}

// dialect is how one engine names its metrics. Alternatives are tried in
// order; the first that has at least one matching series wins.
type dialect struct {
	waiting   []selector
	running   []selector
	kvUsage   []selector
	loraInfo  []selector // vLLM only
	blockSize []source
	numBlocks []source
	// ttft is the engine's own time-to-first-token histogram (shown next
	// to what the router measures, and the TTFT in Perf); none for the
	// TensorRT-LLM engines.
	ttft []selector
	// hists are the other latency histograms' family names by HistKind,
	// alternatives in order; their _sum and _count samples are read.
	hists [NumHists][]string
}

func builtinDialect(e registry.Engine) (dialect, bool) {
	switch e {
	case registry.EngineVLLM, "":
		info := selector{name: "vllm:cache_config_info"}
		return dialect{
			waiting: []selector{{name: "vllm:num_requests_waiting"}},
			running: []selector{{name: "vllm:num_requests_running"}},
			// vLLM renamed the KV gauge in v0.11; older servers only have
			// the gpu_ name.
			kvUsage:   []selector{{name: "vllm:kv_cache_usage_perc"}, {name: "vllm:gpu_cache_usage_perc"}},
			loraInfo:  []selector{{name: "vllm:lora_requests_info"}},
			blockSize: []source{{sel: info, fromLabel: "block_size"}},
			numBlocks: []source{{sel: info, fromLabel: "num_gpu_blocks"}},
			ttft:      []selector{{name: "vllm:time_to_first_token_seconds"}},
			hists: [NumHists][]string{
				HistQueue:         {"vllm:request_queue_time_seconds"},
				HistPrefill:       {"vllm:request_prefill_time_seconds"},
				HistInference:     {"vllm:request_inference_time_seconds"},
				HistPrefillTokens: {"vllm:request_prefill_kv_computed_tokens"},
			},
		}, true
	case registry.EngineSGLang:
		info := selector{name: "sglang:cache_config_info"}
		return dialect{
			waiting:   []selector{{name: "sglang:num_queue_reqs"}},
			running:   []selector{{name: "sglang:num_running_reqs"}},
			kvUsage:   []selector{{name: "sglang:token_usage"}},
			blockSize: []source{{sel: info, fromLabel: "page_size"}},
			numBlocks: []source{{sel: info, fromLabel: "num_pages"}},
			ttft:      []selector{{name: "sglang:time_to_first_token_seconds"}},
		}, true
	case registry.EngineTRTLLM:
		return dialect{
			waiting:   []selector{{name: "trtllm_num_requests_waiting"}},
			running:   []selector{{name: "trtllm_num_requests_running"}},
			kvUsage:   []selector{{name: "trtllm_kv_cache_utilization"}},
			blockSize: []source{{sel: selector{name: "trtllm_kv_cache_tokens_per_block"}}},
			numBlocks: []source{{sel: selector{name: "trtllm_kv_cache_max_blocks"}}},
		}, true
	case registry.EngineTritonTRT:
		req := "nv_trt_llm_request_metrics"
		kv := "nv_trt_llm_kv_cache_block_metrics"
		return dialect{
			waiting:   []selector{{name: req, label: "request_type", value: "waiting"}},
			running:   []selector{{name: req, label: "request_type", value: "scheduled"}},
			kvUsage:   []selector{{name: kv, label: "kv_cache_block_type", value: "fraction"}},
			blockSize: []source{{sel: selector{name: kv, label: "kv_cache_block_type", value: "tokens_per"}}},
			numBlocks: []source{{sel: selector{name: kv, label: "kv_cache_block_type", value: "max"}}},
		}, true
	}
	return dialect{}, false
}

// parseSelector reads an override value: a metric name, optionally followed
// by one label matcher, e.g. `my_queue` or `my_reqs{kind="waiting"}`.
func parseSelector(s string) (selector, error) {
	s = strings.TrimSpace(s)
	name, rest, hasLabels := strings.Cut(s, "{")
	if name == "" {
		return selector{}, fmt.Errorf("empty metric name in %q", s)
	}
	for i, r := range name {
		ok := r == '_' || r == ':' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (i > 0 && r >= '0' && r <= '9')
		if !ok {
			return selector{}, fmt.Errorf("invalid metric name %q", name)
		}
	}
	if !hasLabels {
		return selector{name: name}, nil
	}
	body, ok := strings.CutSuffix(rest, "}")
	if !ok {
		return selector{}, fmt.Errorf("missing '}' in %q", s)
	}
	label, val, ok := strings.Cut(body, "=")
	label = strings.TrimSpace(label)
	val = strings.TrimSpace(val)
	if !ok || label == "" || len(val) < 2 || val[0] != '"' || val[len(val)-1] != '"' {
		return selector{}, fmt.Errorf("label matcher must look like name{label=\"value\"}, got %q", s)
	}
	return selector{name: name, label: label, value: val[1 : len(val)-1]}, nil
}

// ValidateOverrides checks per-pool metric-name overrides: keys must be
// logical names (see LogicalNames) and values metric selectors such as
// `name` or `name{label="value"}`. It returns every problem joined.
func ValidateOverrides(overrides map[string]string) error {
	_, err := applyOverrides(dialect{}, overrides)
	return err
}

func applyOverrides(d dialect, overrides map[string]string) (dialect, error) {
	keys := make([]string, 0, len(overrides))
	for k := range overrides {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var errs []error
	for _, k := range keys {
		sel, err := parseSelector(overrides[k])
		if err != nil {
			errs = append(errs, fmt.Errorf("metrics override %q: %w", k, err))
			continue
		}
		switch k {
		case LogicalWaiting:
			d.waiting = []selector{sel}
		case LogicalRunning:
			d.running = []selector{sel}
		case LogicalKVUsage:
			d.kvUsage = []selector{sel}
		case LogicalLoraInfo:
			d.loraInfo = []selector{sel}
		case LogicalCacheConfig:
			// An overridden cache config is an info-style series. Keep the
			// engine's label names when it has them, else use vLLM's.
			bl, nl := "block_size", "num_gpu_blocks"
			if len(d.blockSize) > 0 && d.blockSize[0].fromLabel != "" {
				bl = d.blockSize[0].fromLabel
			}
			if len(d.numBlocks) > 0 && d.numBlocks[0].fromLabel != "" {
				nl = d.numBlocks[0].fromLabel
			}
			d.blockSize = []source{{sel: sel, fromLabel: bl}}
			d.numBlocks = []source{{sel: sel, fromLabel: nl}}
		default:
			errs = append(errs, fmt.Errorf("metrics override %q: unknown logical name (want one of %s)", k, strings.Join(LogicalNames(), ", ")))
		}
	}
	return d, errors.Join(errs...)
}
