package metrics

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

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

// Parser turns one engine's metrics page into Values in one pass over the
// bytes. It reads only the samples of the few metric families the engine's
// dialect names (a table lookup per line, skipped at once when a line
// continues the previous line's family); every other line costs a scan
// for its end. Only the lines it reads are checked: a malformed one is an
// error, except in the engine's TTFT histogram (shown, not routed on),
// whose malformed lines are ignored. HELP and TYPE comments are not
// needed and not read. It does not
// allocate per line; a Parser is not safe for concurrent use (it reuses
// its buffers).
type Parser struct {
	*schema
	// acc holds one accumulator per slot (see action.slot).
	acc []accum
	// The engine's TTFT histogram of this page (bounds in page order,
	// summed over series); bounds is shared with the Values published
	// while the page's bounds do not change.
	ttft     Histogram
	ttftSeen bool
	bounds   []float64
	les      []leText
	// loraLabels holds the winning lora_requests_info series' labels
	// (the page's bytes are only valid during Parse).
	loraLabels []byte
	// skipped counts the page's sample lines of families not read.
	skipped int
}

// schema is what a Parser reads of one engine's pages (with given
// overrides): immutable, shared by the parsers of every endpoint alike.
type schema struct {
	d dialect
	// names maps each sample name read to its actions; lens has bit n set
	// when one of them is n bytes long (most lines are ruled out by it).
	names map[string][]action
	lens  [4]uint64
	// slots counts the accumulators a page fills (see action.slot).
	slots int
	// waiting, running, kvUsage, blockSize, numBlocks, lora: each
	// alternative's slot, in the dialect's order; hists the slot of each
	// alternative's _sum (its _count is the next slot).
	waiting, running, kvUsage, blockSize, numBlocks, lora []int
	hists                                                 [NumHists][]int
}

// actKind says what a sample line contributes.
type actKind uint8

const (
	actSum        actKind = iota // add the value (waiting, running, histogram sums and counts)
	actMax                       // keep the largest value (KV usage, cache settings read from the value)
	actLabel                     // keep the first positive number found in a label (cache settings of an info series)
	actLora                      // keep the labels of the series with the largest value
	actTTFTBucket                // a bucket of the engine's TTFT histogram
	actTTFTSum
	actTTFTCount
)

type action struct {
	kind actKind
	slot int
	// label and value: the series must carry label=value ("" for any).
	label, value string
	// fromLabel: the label read by actLabel.
	fromLabel string
}

// leText is a bucket bound as written on a page and its value.
type leText struct {
	raw   string
	bound float64
}

// accum is what the page said for one slot.
type accum struct {
	v float64
	n int
}

// NewParser returns a parser for engine ("" means vLLM) with per-pool
// metric-name overrides keyed by logical name (see LogicalNames).
func NewParser(engine registry.Engine, overrides map[string]string) (*Parser, error) {
	s, err := newSchema(engine, overrides)
	if err != nil {
		return nil, err
	}
	return s.parser(), nil
}

// parser returns a new Parser of s's pages.
func (s *schema) parser() *Parser {
	return &Parser{schema: s, acc: make([]accum, s.slots)}
}

func newSchema(engine registry.Engine, overrides map[string]string) (*schema, error) {
	d, ok := builtinDialect(engine)
	if !ok {
		return nil, fmt.Errorf("metrics dialect %q: %w", engine, ErrUnknownEngine)
	}
	d, err := applyOverrides(d, overrides)
	if err != nil {
		return nil, err
	}
	p := &schema{d: d, names: map[string][]action{}}
	add := func(name string, a action) int {
		if n := len(name); n < len(p.lens)*64 {
			p.lens[n/64] |= 1 << (n % 64)
		}
		a.slot = p.slots
		p.slots++
		p.names[name] = append(p.names[name], a)
		return a.slot
	}
	sels := func(list []selector, kind actKind) []int {
		var slots []int
		for _, s := range list {
			slots = append(slots, add(s.name, action{kind: kind, label: s.label, value: s.value}))
		}
		return slots
	}
	srcs := func(list []source) []int {
		var slots []int
		for _, s := range list {
			a := action{kind: actMax, label: s.sel.label, value: s.sel.value}
			if s.fromLabel != "" {
				a.kind, a.fromLabel = actLabel, s.fromLabel
			}
			slots = append(slots, add(s.sel.name, a))
		}
		return slots
	}
	p.waiting = sels(d.waiting, actSum)
	p.running = sels(d.running, actSum)
	p.kvUsage = sels(d.kvUsage, actMax)
	p.lora = sels(d.loraInfo, actLora)
	p.blockSize = srcs(d.blockSize)
	p.numBlocks = srcs(d.numBlocks)
	for k, names := range d.hists {
		for _, n := range names {
			p.hists[k] = append(p.hists[k], add(n+"_sum", action{kind: actSum}))
			add(n+"_count", action{kind: actSum})
		}
	}
	if len(d.ttft) > 0 {
		n := d.ttft[0].name
		add(n+"_bucket", action{kind: actTTFTBucket})
		add(n+"_sum", action{kind: actTTFTSum})
		add(n+"_count", action{kind: actTTFTCount})
	}
	return p, nil
}

// SampleNames lists the sample names the parser reads, sorted: what a
// server that honours Prometheus' name[] filter needs to send.
func (p *schema) SampleNames() []string {
	out := make([]string, 0, len(p.names))
	for n := range p.names {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Skipped returns how many sample lines of the last page belonged to
// families the parser does not read (0 when a name[] filter took).
func (p *Parser) Skipped() int { return p.skipped }

var errParse = errors.New("parse metrics")

// Parse reads a Prometheus text-format page. A malformed line of a family
// it reads is an error; a page lacking some metrics is not (see
// Values.Missing).
func (p *Parser) Parse(page []byte) (Values, error) {
	clear(p.acc)
	p.ttft.Bounds, p.ttft.Cumulative, p.ttft.Count, p.ttft.Sum, p.ttftSeen = p.ttft.Bounds[:0], p.ttft.Cumulative[:0], 0, 0, false
	p.loraLabels = p.loraLabels[:0]
	p.skipped = 0
	var (
		lastName []byte // the previous sample line's name
		lastActs []action
		lineNo   int
	)
	for len(page) > 0 {
		lineNo++
		var line []byte
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i], page[i+1:]
		} else {
			line, page = page, nil
		}
		// Fast path: a run of lines of one family (histogram buckets,
		// one series per label set) shares the previous line's verdict.
		if n := len(lastName); n > 0 && len(line) > n && line[n] == '{' && bytes.Equal(line[:n], lastName) {
			if lastActs == nil {
				p.skipped++
				continue
			}
			if err := p.sample(lastActs, line[n:]); err != nil && lastActs[0].kind < actTTFTBucket {
				return Values{}, fmt.Errorf("%w: line %d: %w", errParse, lineNo, err)
			}
			continue
		}
		l := line
		for len(l) > 0 && (l[0] == ' ' || l[0] == '\t') {
			l = l[1:]
		}
		if len(l) == 0 || l[0] == '#' || l[0] == '\r' {
			continue
		}
		var name, rest []byte
		if l[0] == '{' {
			// A quoted (UTF-8) metric name inside the braces.
			var err error
			if name, rest, err = quotedName(l); err != nil {
				return Values{}, fmt.Errorf("%w: line %d: %w", errParse, lineNo, err)
			}
		} else {
			n := nameEnd(l)
			name, rest = l[:n], l[n:]
		}
		var acts []action
		ok := len(name) < len(p.lens)*64 && p.lens[len(name)/64]&(1<<(len(name)%64)) != 0
		if ok {
			acts, ok = p.names[string(name)]
		}
		if l[0] != '{' && len(l) == len(line) {
			lastName, lastActs = name, acts
		} else {
			lastName = nil
		}
		if !ok {
			p.skipped++
			continue
		}
		if err := p.sample(acts, rest); err != nil && acts[0].kind < actTTFTBucket {
			return Values{}, fmt.Errorf("%w: line %d: %w", errParse, lineNo, err)
		}
	}
	return p.values(), nil
}

// quotedName splits `{"name",labels...} value` or `{"name"} value` into
// the name and what follows it, whose first byte stands for the opening
// brace of the rest of the label set (see sample).
func quotedName(l []byte) (name, rest []byte, err error) {
	if len(l) < 2 || l[1] != '"' {
		return nil, nil, errors.New("label set without a metric name")
	}
	end := bytes.IndexByte(l[2:], '"')
	if end < 0 || bytes.IndexByte(l[2:2+end], '\\') >= 0 {
		return nil, nil, errors.New("bad quoted metric name")
	}
	name, rest = l[2:2+end], l[3+end:]
	if len(rest) == 0 || (rest[0] != ',' && rest[0] != '}') {
		return nil, nil, errors.New("bad quoted metric name")
	}
	if rest[0] == '}' {
		rest = rest[1:] // no labels: the value follows
	}
	return name, rest, nil
}

// sample applies one sample line's labels-and-value part (rest: an
// optional `{...}` label set, then the value and an optional timestamp; a
// leading ',' instead of '{' continues a label set after a quoted name).
func (p *Parser) sample(acts []action, rest []byte) error {
	var labels []byte
	if len(rest) > 0 && (rest[0] == '{' || rest[0] == ',') {
		end, err := labelSetEnd(rest)
		if err != nil {
			return err
		}
		labels, rest = rest[1:end], rest[end+1:]
	}
	v, err := sampleValue(rest)
	if err != nil {
		return err
	}
	nan := math.IsNaN(v)
	for i := range acts {
		a := &acts[i]
		if nan && a.kind <= actMax || nan && a.kind == actLora {
			continue // NaN is no reading; a label still is
		}
		if a.label != "" {
			lv, ok := labelValue(labels, a.label)
			if !ok || !labelEquals(lv, a.value) {
				continue
			}
		}
		acc := &p.acc[a.slot]
		switch a.kind {
		case actSum:
			acc.v += v
			acc.n++
		case actMax:
			if acc.n == 0 || v > acc.v {
				acc.v = v
			}
			acc.n++
		case actLabel:
			if acc.n > 0 {
				continue
			}
			if lv, ok := labelValue(labels, a.fromLabel); ok {
				if f, err := strconv.ParseFloat(string(bytes.TrimSpace(lv)), 64); err == nil && f > 0 {
					acc.v, acc.n = f, 1
				}
			}
		case actLora:
			if acc.n == 0 || v > acc.v {
				acc.v = v
				p.loraLabels = append(p.loraLabels[:0], labels...)
			}
			acc.n++
		case actTTFTSum:
			p.ttft.Sum += v
			p.ttftSeen = true
		case actTTFTCount:
			p.ttft.Count += v
			p.ttftSeen = true
		case actTTFTBucket:
			p.ttftSeen = true
			le, ok := labelValue(labels, "le")
			if !ok {
				continue
			}
			bound, ok := p.leBound(le)
			if !ok || math.IsInf(bound, 1) {
				continue
			}
			p.ttftBucket(bound, v)
		}
	}
	return nil
}

// leBound reads a bucket's le label, remembering the texts seen so that
// the next pages' (the same) cost a comparison.
func (p *Parser) leBound(le []byte) (float64, bool) {
	for i := range p.les {
		if p.les[i].raw == string(le) {
			return p.les[i].bound, true
		}
	}
	b, err := strconv.ParseFloat(string(le), 64)
	if err != nil {
		return 0, false
	}
	if len(p.les) < 64 {
		p.les = append(p.les, leText{raw: string(le), bound: b})
	}
	return b, true
}

// ttftBucket adds v to the bucket of bound: bounds are matched in the
// order first seen, so series summed bucket by bucket.
func (p *Parser) ttftBucket(bound, v float64) {
	for k, b := range p.ttft.Bounds {
		if b == bound {
			p.ttft.Cumulative[k] += v
			return
		}
	}
	p.ttft.Bounds = append(p.ttft.Bounds, bound)
	p.ttft.Cumulative = append(p.ttft.Cumulative, v)
}

// values turns the accumulated page into Values.
func (p *Parser) values() Values {
	var v Values
	first := func(slots []int) (float64, bool) {
		for _, s := range slots {
			if a := p.acc[s]; a.n > 0 {
				return a.v, true
			}
		}
		return 0, false
	}
	if f, ok := first(p.waiting); ok {
		v.Waiting = toInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalWaiting)
	}
	if f, ok := first(p.running); ok {
		v.Running = toInt(f)
	} else {
		v.Missing = append(v.Missing, LogicalRunning)
	}
	if f, ok := first(p.kvUsage); ok {
		v.KVUsage = math.Max(0, math.Min(1, f))
	} else {
		v.Missing = append(v.Missing, LogicalKVUsage)
	}
	for k, slots := range p.hists {
		for _, s := range slots {
			if sum, count := p.acc[s], p.acc[s+1]; sum.n > 0 && count.n > 0 {
				v.Hists[k] = Hist{Sum: sum.v, Count: count.v}
				break
			}
		}
	}
	positive := func(slots []int) int {
		for _, s := range slots {
			if a := p.acc[s]; a.n > 0 && a.v > 0 {
				return toInt(a.v)
			}
		}
		return 0
	}
	v.BlockSize = positive(p.blockSize)
	v.NumBlocks = positive(p.numBlocks)
	if _, ok := first(p.lora); ok {
		if s, ok := labelValue(p.loraLabels, "max_lora"); ok {
			if n, err := strconv.Atoi(string(bytes.TrimSpace(s))); err == nil {
				v.MaxLoras = n
			}
		}
		r, _ := labelValue(p.loraLabels, "running_lora_adapters")
		w, _ := labelValue(p.loraLabels, "waiting_lora_adapters")
		v.RunningAdapters = splitAdapters(r)
		v.WaitingAdapters = splitAdapters(w)
	}
	if p.ttftSeen && len(p.ttft.Bounds) > 0 {
		if !slices.Equal(p.bounds, p.ttft.Bounds) {
			p.bounds = slices.Clone(p.ttft.Bounds)
		}
		v.TTFT = &Histogram{Bounds: p.bounds, Cumulative: slices.Clone(p.ttft.Cumulative), Count: p.ttft.Count, Sum: p.ttft.Sum}
	}
	return v
}

// labelSetEnd returns the index of the '}' closing the label set that b
// starts with, checking its syntax: name="value" pairs, commas between,
// escapes inside the quotes.
func labelSetEnd(b []byte) (int, error) {
	i := 1
	for {
		for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
			i++
		}
		if i < len(b) && b[i] == '}' {
			return i, nil
		}
		// A label name, or a quoted one.
		if i < len(b) && b[i] == '"' {
			j := closingQuote(b, i+1)
			if j < 0 {
				return 0, errors.New("unterminated quoted label name")
			}
			i = j + 1
		} else {
			start := i
			for i < len(b) && isNameByte(b[i], i > start) {
				i++
			}
			if i == start {
				break
			}
		}
		for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
			i++
		}
		if i >= len(b) || b[i] != '=' {
			break
		}
		i++
		for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
			i++
		}
		if i >= len(b) || b[i] != '"' {
			break
		}
		j := closingQuote(b, i+1)
		if j < 0 {
			return 0, errors.New("unterminated label value")
		}
		i = j + 1
		for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
			i++
		}
		if i < len(b) && b[i] == ',' {
			i++
			continue
		}
		if i < len(b) && b[i] == '}' {
			return i, nil
		}
		break
	}
	return 0, errors.New("malformed label set")
}

// closingQuote returns the index of the '"' ending the quoted string that
// starts at b[i], skipping escaped characters, or -1.
func closingQuote(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case '\\':
			i += 2
			continue
		case '"':
			return i
		}
		i++
	}
	return -1
}

func isNameByte(c byte, notFirst bool) bool {
	return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (notFirst && c >= '0' && c <= '9')
}

// labelValue returns the raw (still escaped) value of label name in the
// checked label set labels (the bytes between the braces).
func labelValue(labels []byte, name string) ([]byte, bool) {
	i := 0
	for i < len(labels) {
		for i < len(labels) && (labels[i] == ' ' || labels[i] == '\t' || labels[i] == ',') {
			i++
		}
		if i >= len(labels) {
			break
		}
		var key []byte
		if labels[i] == '"' {
			j := closingQuote(labels, i+1)
			key, i = labels[i+1:j], j+1
		} else {
			start := i
			for i < len(labels) && labels[i] != '=' && labels[i] != ' ' && labels[i] != '\t' {
				i++
			}
			key = labels[start:i]
		}
		for i < len(labels) && labels[i] != '"' {
			i++
		}
		j := closingQuote(labels, i+1)
		if j < 0 {
			break
		}
		if string(key) == name {
			return labels[i+1 : j], true
		}
		i = j + 1
	}
	return nil, false
}

// labelEquals compares a raw label value with an unescaped one.
func labelEquals(raw []byte, want string) bool {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw) == want
	}
	return unescape(raw) == want
}

// unescape undoes the text format's label value escapes (\\, \", \n).
func unescape(raw []byte) string {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw)
	}
	var sb strings.Builder
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		if c == '\\' && i+1 < len(raw) {
			i++
			switch raw[i] {
			case 'n':
				c = '\n'
			default:
				c = raw[i]
			}
		}
		sb.WriteByte(c)
	}
	return sb.String()
}

// sampleValue reads the value after a sample's name and labels: blanks
// (none needed after a label set), the number, then optionally a blank and a timestamp.
func sampleValue(rest []byte) (float64, error) {
	i := 0
	for i < len(rest) && (rest[i] == ' ' || rest[i] == '\t') {
		i++
	}
	rest = rest[i:]
	end := 0
	for end < len(rest) && rest[end] != ' ' && rest[end] != '\t' && rest[end] != '\r' {
		end++
	}
	num := rest[:end]
	if len(num) == 0 {
		return 0, errors.New("missing sample value")
	}
	if tail := bytes.TrimSpace(rest[end:]); len(tail) > 0 {
		if _, err := strconv.ParseInt(string(tail), 10, 64); err != nil {
			return 0, fmt.Errorf("bad timestamp %q", tail)
		}
	}
	if v, ok := simpleFloat(num); ok {
		return v, nil
	}
	v, err := strconv.ParseFloat(string(num), 64)
	if err != nil {
		return 0, fmt.Errorf("bad sample value %q", num)
	}
	return v, nil
}

// simpleFloat reads the common shapes of a Python client's values ("3",
// "3.0", "0.4213") exactly and quickly; anything else (exponents, more
// than 15 digits, NaN, Inf) reports false for strconv to read.
func simpleFloat(b []byte) (float64, bool) {
	if len(b) == 0 || len(b) > 16 {
		return 0, false
	}
	var mant uint64
	digits, frac := 0, -1
	for i, c := range b {
		switch {
		case c >= '0' && c <= '9':
			mant = mant*10 + uint64(c-'0')
			digits++
			if frac >= 0 {
				frac++
			}
		case c == '.' && frac < 0 && i > 0:
			frac = 0
		default:
			return 0, false
		}
	}
	if digits == 0 || digits > 15 {
		return 0, false
	}
	f := float64(mant) // exact: mant < 10^15 < 2^53
	if frac > 0 {
		f /= pow10[frac] // one correctly rounded division of exact values
	}
	return f, true
}

var pow10 = [...]float64{1, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16}

func splitAdapters(raw []byte) []string {
	var out []string
	for len(raw) > 0 {
		part := raw
		if i := bytes.IndexByte(raw, ','); i >= 0 {
			part, raw = raw[:i], raw[i+1:]
		} else {
			raw = nil
		}
		if a := strings.TrimSpace(unescape(part)); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// nameEnd returns the length of the metric name at the start of b (a
// line without its newline): up to the label set or the first blank.
func nameEnd(b []byte) int {
	for i, c := range b {
		if nameStop[c] {
			return i
		}
	}
	return len(b)
}

var nameStop = [256]bool{'{': true, ' ': true, '\t': true, '\r': true, '\n': true}

func toInt(f float64) int {
	if math.IsNaN(f) || f <= 0 {
		return 0
	}
	if f > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(math.Round(f))
}
