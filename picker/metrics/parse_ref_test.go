package metrics

// The parser this package used before issue 25, on the Prometheus text
// parser (expfmt): the reference the one-pass Parser is held to.

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

// Parser turns one engine's metrics page into Values. It filters the page
// down to the few metric families it needs before handing them to the
// Prometheus text parser, so other series cost one line scan; of a
// histogram it keeps the _sum and _count samples (as untyped series: its
// TYPE line and buckets are dropped). The TTFT histogram is read whole,
// as the page is filtered. A Parser is not safe for concurrent use; it
// reuses its buffers.
type refParser struct {
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
func newRefParser(engine registry.Engine, overrides map[string]string) (*refParser, error) {
	d, ok := builtinDialect(engine)
	if !ok {
		return nil, fmt.Errorf("metrics dialect %q: %w", engine, ErrUnknownEngine)
	}
	d, err := applyOverrides(d, overrides)
	if err != nil {
		return nil, err
	}
	p := &refParser{d: d, wanted: map[string]struct{}{}, tp: expfmt.NewTextParser(model.UTF8Validation)}
	for _, n := range refFamilies(d) {
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
func (p *refParser) Parse(page []byte) (Values, error) {
	p.buf.Reset()
	p.ttft.Bounds, p.ttft.Cumulative, p.ttft.Count, p.ttft.Sum, p.ttftSeen = p.ttft.Bounds[:0], p.ttft.Cumulative[:0], 0, 0, false
	p.filter(page)
	fams, err := p.tp.TextToMetricFamilies(&p.buf)
	if err != nil {
		return Values{}, fmt.Errorf("parse metrics: %w", err)
	}
	var v Values
	d := &p.d
	if f, ok := refPick(fams, d.waiting, refSumValues); ok {
		v.Waiting = refToInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalWaiting)
	}
	if f, ok := refPick(fams, d.running, refSumValues); ok {
		v.Running = refToInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalRunning)
	}
	if f, ok := refPick(fams, d.kvUsage, refMaxValue); ok {
		v.KVUsage = math.Max(0, math.Min(1, f))
	} else {
		v.Missing = append(v.Missing, LogicalKVUsage)
	}
	for k, names := range d.hists {
		for _, n := range names {
			sum, okS := refPick(fams, []selector{{name: n + "_sum"}}, refSumValues)
			count, okC := refPick(fams, []selector{{name: n + "_count"}}, refSumValues)
			if okS && okC {
				v.Hists[k] = Hist{Sum: sum, Count: count}
				break
			}
		}
	}
	v.BlockSize = refReadSource(fams, d.blockSize)
	v.NumBlocks = refReadSource(fams, d.numBlocks)
	refReadLora(fams, d.loraInfo, &v)
	if p.ttftSeen && len(p.ttft.Bounds) > 0 {
		v.TTFT = &Histogram{Bounds: slices.Clone(p.ttft.Bounds), Cumulative: slices.Clone(p.ttft.Cumulative), Count: p.ttft.Count, Sum: p.ttft.Sum}
	}
	return v, nil
}

// readTTFTLine reads one sample line of the engine's TTFT histogram into
// p.ttft, summing series bucket by bucket; it reports whether the line
// was one. Buckets are matched by their bound, in the order first seen.
func (p *refParser) readTTFTLine(l []byte) bool {
	if len(p.ttftBucket) == 0 || len(l) == 0 || l[0] == '#' {
		return false
	}
	name := l[:refNameEnd(l)]
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
func (p *refParser) filter(page []byte) {
	for len(page) > 0 {
		line := page
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i+1], page[i+1:]
		} else {
			page = nil
		}
		if p.readTTFTLine(refSkipBlank(line)) {
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

func (p *refParser) keep(line []byte) bool {
	l := refSkipBlank(line)
	if len(l) == 0 {
		return false
	}
	switch l[0] {
	case '#':
		// "# HELP name ..." or "# TYPE name ...": keep if name is wanted.
		f := refSkipBlank(l[1:])
		if !bytes.HasPrefix(f, []byte("HELP")) && !bytes.HasPrefix(f, []byte("TYPE")) {
			return false
		}
		f = refSkipBlank(f[4:])
		_, ok := p.wanted[string(f[:refNameEnd(f)])]
		return ok
	case '{':
		// A quoted UTF-8 metric name; let the real parser decide.
		return true
	}
	_, ok := p.wanted[string(l[:refNameEnd(l)])]
	return ok
}

func refSkipBlank(b []byte) []byte {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
		i++
	}
	return b[i:]
}

// refNameEnd returns the length of the metric name at the start of b.
func refNameEnd(b []byte) int {
	for i, c := range b {
		switch c {
		case '{', ' ', '\t', '\r', '\n':
			return i
		}
	}
	return len(b)
}

// refSampleValue returns a gauge, counter or untyped sample's value.
func refSampleValue(t dto.MetricType, m *dto.Metric) (float64, bool) {
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

func refMatches(sel selector, m *dto.Metric) bool {
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

type refReducer func(acc float64, v float64, first bool) float64

func refSumValues(acc, v float64, _ bool) float64 { return acc + v }

func refMaxValue(acc, v float64, first bool) float64 {
	if first || v > acc {
		return v
	}
	return acc
}

// refPick reduces the series of the first alternative that has any.
func refPick(fams map[string]*dto.MetricFamily, alts []selector, r refReducer) (float64, bool) {
	for _, sel := range alts {
		mf := fams[sel.name]
		if mf == nil {
			continue
		}
		var acc float64
		n := 0
		for _, m := range mf.GetMetric() {
			if !refMatches(sel, m) {
				continue
			}
			v, ok := refSampleValue(mf.GetType(), m)
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

func refLabel(m *dto.Metric, name string) (string, bool) {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue(), true
		}
	}
	return "", false
}

// refReadSource returns the first positive integer found for a cache setting.
func refReadSource(fams map[string]*dto.MetricFamily, alts []source) int {
	for _, src := range alts {
		if src.fromLabel == "" {
			if f, ok := refPick(fams, []selector{src.sel}, refMaxValue); ok && f > 0 {
				return refToInt(f)
			}
			continue
		}
		mf := fams[src.sel.name]
		if mf == nil {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !refMatches(src.sel, m) {
				continue
			}
			if s, ok := refLabel(m, src.fromLabel); ok {
				if n, err := strconv.ParseFloat(strings.TrimSpace(s), 64); err == nil && n > 0 {
					return refToInt(n)
				}
			}
		}
	}
	return 0
}

// refReadLora fills the LoRA fields from the series with the largest value:
// vLLM keeps old label sets and sets the value to the update's Unix time.
func refReadLora(fams map[string]*dto.MetricFamily, alts []selector, v *Values) {
	for _, sel := range alts {
		mf := fams[sel.name]
		if mf == nil {
			continue
		}
		var best *dto.Metric
		bestV := math.Inf(-1)
		for _, m := range mf.GetMetric() {
			if !refMatches(sel, m) {
				continue
			}
			val, ok := refSampleValue(mf.GetType(), m)
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
		if s, ok := refLabel(best, "max_lora"); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(s)); err == nil {
				v.MaxLoras = n
			}
		}
		r, _ := refLabel(best, "running_lora_adapters")
		w, _ := refLabel(best, "waiting_lora_adapters")
		v.RunningAdapters = refSplitAdapters(r)
		v.WaitingAdapters = refSplitAdapters(w)
		return
	}
}

func refSplitAdapters(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

func refToInt(f float64) int {
	if math.IsNaN(f) || f <= 0 {
		return 0
	}
	if f > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(math.Round(f))
}

// families returns the metric family names the dialect reads.
func refFamilies(d dialect) []string {
	seen := map[string]bool{}
	var out []string
	add := func(s selector) {
		if !seen[s.name] {
			seen[s.name] = true
			out = append(out, s.name)
		}
	}
	for _, list := range [][]selector{d.waiting, d.running, d.kvUsage, d.loraInfo} {
		for _, s := range list {
			add(s)
		}
	}
	for _, list := range [][]source{d.blockSize, d.numBlocks} {
		for _, s := range list {
			add(s.sel)
		}
	}
	for _, names := range d.hists {
		for _, n := range names {
			add(selector{name: n + "_sum"})
			add(selector{name: n + "_count"})
		}
	}
	return out
}
