package metrics

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/switchyard/switchyard/registry"
)

// Values are the load figures read from one metrics page.
type Values struct {
	// Waiting and Running are request counts, summed over every matching
	// series (e.g. one per model_name label).
	Waiting int
	Running int
	// KVUsage is the KV-cache utilisation in [0,1], the maximum over the
	// matching series.
	KVUsage float64
	// BlockSize is the KV-cache block size in tokens and NumBlocks the
	// number of KV blocks; 0 means the server does not report them.
	BlockSize int
	NumBlocks int
	// MaxLoras, RunningAdapters and WaitingAdapters come from vLLM's
	// lora_requests_info (only with --enable-lora); zero without it.
	MaxLoras        int
	RunningAdapters []string
	WaitingAdapters []string
	// Missing lists the required logical metrics (waiting, running,
	// kv_usage) the page did not have; their fields are zero.
	Missing []string
	// TTFT is the engine's own time-to-first-token histogram, summed over
	// its series (nil when the engine exports none).
	TTFT *Histogram
	// Hists are the cumulative sums and counts of the engine's other
	// latency histograms, by HistKind (vLLM's names; zero where the page
	// lacks one). Successive pages give Perf.
	Hists [NumHists]Hist
}

// Histogram is a cumulative Prometheus histogram: Cumulative[i] counts
// observations <= Bounds[i] (seconds); the +Inf bucket is Count, and Sum
// is the sum of the observations.
type Histogram struct {
	Bounds     []float64
	Cumulative []float64
	Count, Sum float64
}

// HistKind names one latency histogram the parser reads besides TTFT.
type HistKind int

// The histograms read (vLLM 0.11+ names in brackets).
const (
	// HistQueue: time waiting for admission (vllm:request_queue_time_seconds).
	HistQueue HistKind = iota
	// HistPrefill: time from admission to the first token
	// (vllm:request_prefill_time_seconds).
	HistPrefill
	// HistInference: time running, prefill and decode
	// (vllm:request_inference_time_seconds).
	HistInference
	// HistPrefillTokens: prompt tokens computed in prefill, cached ones
	// excluded (vllm:request_prefill_kv_computed_tokens).
	HistPrefillTokens
	// NumHists counts the kinds.
	NumHists
)

// Hist is a histogram's cumulative sum and count, summed over its series.
type Hist struct {
	Sum, Count float64
}

// Parser turns one engine's metrics page into Values. It filters the page
// down to the few metric families it needs before handing them to the
// Prometheus text parser, so other series cost one line scan; of a
// histogram it keeps the _sum and _count samples (as untyped series: its
// TYPE line and buckets are dropped). The TTFT histogram is read whole,
// as the page is filtered. A Parser is not safe for concurrent use; it
// reuses its buffers.
type Parser struct {
	d      dialect
	wanted map[string]struct{}
	tp     expfmt.TextParser
	buf    bytes.Buffer
	// The engine's TTFT histogram's sample names, and what this page had
	// of it (bounds in page order, summed over series).
	ttftBucket, ttftCount, ttftSum []byte
	ttft                           Histogram
	ttftSeen                       bool
}

// NewParser returns a parser for engine ("" means vLLM) with per-pool
// metric-name overrides keyed by logical name (see LogicalNames).
func NewParser(engine registry.Engine, overrides map[string]string) (*Parser, error) {
	d, ok := builtinDialect(engine)
	if !ok {
		return nil, fmt.Errorf("metrics dialect %q: %w", engine, ErrUnknownEngine)
	}
	d, err := applyOverrides(d, overrides)
	if err != nil {
		return nil, err
	}
	p := &Parser{d: d, wanted: map[string]struct{}{}, tp: expfmt.NewTextParser(model.UTF8Validation)}
	for _, n := range d.families() {
		p.wanted[n] = struct{}{}
	}
	if len(d.ttft) > 0 {
		// Read by readTTFTLine as the page is filtered: the text parser
		// would cost more than every other family together.
		p.ttftBucket, p.ttftCount, p.ttftSum = []byte(d.ttft[0].name+"_bucket"), []byte(d.ttft[0].name+"_count"), []byte(d.ttft[0].name+"_sum")
	}
	return p, nil
}

// Parse reads a Prometheus text-format page. A malformed page is an error;
// a page lacking some metrics is not (see Values.Missing).
func (p *Parser) Parse(page []byte) (Values, error) {
	p.buf.Reset()
	p.ttft.Bounds, p.ttft.Cumulative, p.ttft.Count, p.ttft.Sum, p.ttftSeen = p.ttft.Bounds[:0], p.ttft.Cumulative[:0], 0, 0, false
	p.filter(page)
	fams, err := p.tp.TextToMetricFamilies(&p.buf)
	if err != nil {
		return Values{}, fmt.Errorf("parse metrics: %w", err)
	}
	var v Values
	d := &p.d
	if f, ok := pick(fams, d.waiting, sumValues); ok {
		v.Waiting = toInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalWaiting)
	}
	if f, ok := pick(fams, d.running, sumValues); ok {
		v.Running = toInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalRunning)
	}
	if f, ok := pick(fams, d.kvUsage, maxValue); ok {
		v.KVUsage = math.Max(0, math.Min(1, f))
	} else {
		v.Missing = append(v.Missing, LogicalKVUsage)
	}
	for k, names := range d.hists {
		for _, n := range names {
			sum, okS := pick(fams, []selector{{name: n + "_sum"}}, sumValues)
			count, okC := pick(fams, []selector{{name: n + "_count"}}, sumValues)
			if okS && okC {
				v.Hists[k] = Hist{Sum: sum, Count: count}
				break
			}
		}
	}
	v.BlockSize = readSource(fams, d.blockSize)
	v.NumBlocks = readSource(fams, d.numBlocks)
	readLora(fams, d.loraInfo, &v)
	if p.ttftSeen && len(p.ttft.Bounds) > 0 {
		v.TTFT = &Histogram{Bounds: slices.Clone(p.ttft.Bounds), Cumulative: slices.Clone(p.ttft.Cumulative), Count: p.ttft.Count, Sum: p.ttft.Sum}
	}
	return v, nil
}

// readTTFTLine reads one sample line of the engine's TTFT histogram into
// p.ttft, summing series bucket by bucket; it reports whether the line
// was one. Buckets are matched by their bound, in the order first seen.
func (p *Parser) readTTFTLine(l []byte) bool {
	if len(p.ttftBucket) == 0 || len(l) == 0 || l[0] == '#' {
		return false
	}
	name := l[:nameEnd(l)]
	isBucket, isCount, isSum := bytes.Equal(name, p.ttftBucket), bytes.Equal(name, p.ttftCount), bytes.Equal(name, p.ttftSum)
	if !isBucket && !isCount && !isSum {
		return false
	}
	end := bytes.LastIndexByte(l, '}')
	rest := l
	if end >= 0 {
		rest = l[end+1:]
	} else {
		rest = l[bytes.IndexByte(l, ' ')+1:]
	}
	rest = bytes.TrimLeft(rest, " \t")
	if k := bytes.IndexAny(rest, " \t\r\n"); k >= 0 {
		rest = rest[:k]
	}
	val, err := strconv.ParseFloat(string(rest), 64)
	if err != nil {
		return true
	}
	p.ttftSeen = true
	switch {
	case isCount:
		p.ttft.Count += val
		return true
	case isSum:
		p.ttft.Sum += val
		return true
	}
	i := bytes.Index(l, []byte(`le="`))
	if i < 0 {
		return true
	}
	le := l[i+4:]
	j := bytes.IndexByte(le, '"')
	if j < 0 {
		return true
	}
	bound, err := strconv.ParseFloat(string(le[:j]), 64)
	if err != nil || math.IsInf(bound, 1) {
		return true
	}
	for k, b := range p.ttft.Bounds {
		if b == bound {
			p.ttft.Cumulative[k] += val
			return true
		}
	}
	p.ttft.Bounds = append(p.ttft.Bounds, bound)
	p.ttft.Cumulative = append(p.ttft.Cumulative, val)
	return true
}

// filter copies into p.buf only the lines (samples, HELP and TYPE) of the
// wanted metric families.
func (p *Parser) filter(page []byte) {
	for len(page) > 0 {
		line := page
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i+1], page[i+1:]
		} else {
			page = nil
		}
		if p.readTTFTLine(skipBlank(line)) {
			continue
		}
		if p.keep(line) {
			p.buf.Write(line)
			if line[len(line)-1] != '\n' {
				p.buf.WriteByte('\n')
			}
		}
	}
}

func (p *Parser) keep(line []byte) bool {
	l := skipBlank(line)
	if len(l) == 0 {
		return false
	}
	switch l[0] {
	case '#':
		// "# HELP name ..." or "# TYPE name ...": keep if name is wanted.
		f := skipBlank(l[1:])
		if !bytes.HasPrefix(f, []byte("HELP")) && !bytes.HasPrefix(f, []byte("TYPE")) {
			return false
		}
		f = skipBlank(f[4:])
		_, ok := p.wanted[string(f[:nameEnd(f)])]
		return ok
	case '{':
		// A quoted UTF-8 metric name; let the real parser decide.
		return true
	}
	_, ok := p.wanted[string(l[:nameEnd(l)])]
	return ok
}

func skipBlank(b []byte) []byte {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
		i++
	}
	return b[i:]
}

// nameEnd returns the length of the metric name at the start of b.
func nameEnd(b []byte) int {
	for i, c := range b {
		switch c {
		case '{', ' ', '\t', '\r', '\n':
			return i
		}
	}
	return len(b)
}

// sampleValue returns a gauge, counter or untyped sample's value.
func sampleValue(t dto.MetricType, m *dto.Metric) (float64, bool) {
	switch t {
	case dto.MetricType_GAUGE:
		return m.GetGauge().GetValue(), m.GetGauge() != nil
	case dto.MetricType_COUNTER:
		return m.GetCounter().GetValue(), m.GetCounter() != nil
	case dto.MetricType_UNTYPED:
		return m.GetUntyped().GetValue(), m.GetUntyped() != nil
	}
	return 0, false
}

func matches(sel selector, m *dto.Metric) bool {
	if sel.label == "" {
		return true
	}
	for _, lp := range m.GetLabel() {
		if lp.GetName() == sel.label {
			return lp.GetValue() == sel.value
		}
	}
	return false
}

type reducer func(acc float64, v float64, first bool) float64

func sumValues(acc, v float64, _ bool) float64 { return acc + v }

func maxValue(acc, v float64, first bool) float64 {
	if first || v > acc {
		return v
	}
	return acc
}

// pick reduces the series of the first alternative that has any.
func pick(fams map[string]*dto.MetricFamily, alts []selector, r reducer) (float64, bool) {
	for _, sel := range alts {
		mf := fams[sel.name]
		if mf == nil {
			continue
		}
		var acc float64
		n := 0
		for _, m := range mf.GetMetric() {
			if !matches(sel, m) {
				continue
			}
			v, ok := sampleValue(mf.GetType(), m)
			if !ok || math.IsNaN(v) {
				continue
			}
			acc = r(acc, v, n == 0)
			n++
		}
		if n > 0 {
			return acc, true
		}
	}
	return 0, false
}

func label(m *dto.Metric, name string) (string, bool) {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue(), true
		}
	}
	return "", false
}

// readSource returns the first positive integer found for a cache setting.
func readSource(fams map[string]*dto.MetricFamily, alts []source) int {
	for _, src := range alts {
		if src.fromLabel == "" {
			if f, ok := pick(fams, []selector{src.sel}, maxValue); ok && f > 0 {
				return toInt(f)
			}
			continue
		}
		mf := fams[src.sel.name]
		if mf == nil {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !matches(src.sel, m) {
				continue
			}
			if s, ok := label(m, src.fromLabel); ok {
				if n, err := strconv.ParseFloat(strings.TrimSpace(s), 64); err == nil && n > 0 {
					return toInt(n)
				}
			}
		}
	}
	return 0
}

// readLora fills the LoRA fields from the series with the largest value:
// vLLM keeps old label sets and sets the value to the update's Unix time.
func readLora(fams map[string]*dto.MetricFamily, alts []selector, v *Values) {
	for _, sel := range alts {
		mf := fams[sel.name]
		if mf == nil {
			continue
		}
		var best *dto.Metric
		bestV := math.Inf(-1)
		for _, m := range mf.GetMetric() {
			if !matches(sel, m) {
				continue
			}
			val, ok := sampleValue(mf.GetType(), m)
			if !ok || math.IsNaN(val) {
				continue
			}
			if best == nil || val > bestV {
				best, bestV = m, val
			}
		}
		if best == nil {
			continue
		}
		if s, ok := label(best, "max_lora"); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(s)); err == nil {
				v.MaxLoras = n
			}
		}
		r, _ := label(best, "running_lora_adapters")
		w, _ := label(best, "waiting_lora_adapters")
		v.RunningAdapters = splitAdapters(r)
		v.WaitingAdapters = splitAdapters(w)
		return
	}
}

func splitAdapters(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

func toInt(f float64) int {
	if math.IsNaN(f) || f <= 0 {
		return 0
	}
	if f > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(math.Round(f))
}
