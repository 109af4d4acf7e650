package load

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Report is the outcome of a run: one StageReport per stage and the total.
type Report struct {
	Config      Config        `json:"config"`
	Start       time.Time     `json:"start"`
	Elapsed     time.Duration `json:"-"`
	ElapsedS    float64       `json:"elapsed_s"`
	Interrupted bool          `json:"interrupted"` // the context was cancelled (Ctrl-C): partial report
	Total       StageReport   `json:"total"`
	Stages      []StageReport `json:"stages"`
}

// StageReport holds the measurements of the requests sent during one stage
// (or, for Report.Total, during the whole run). Latencies and tokens count
// successful requests only.
type StageReport struct {
	Stage       int     `json:"stage"` // -1 for the total
	Rate        float64 `json:"rate,omitempty"`
	Concurrency int     `json:"concurrency,omitempty"`
	// WindowS is the measurement window: from the stage's start until the
	// later of its end and its last request's completion.
	WindowS float64 `json:"window_s"`

	Sent      int64 `json:"sent"`      // requests issued
	Completed int64 `json:"completed"` // 200 with a complete answer
	Failed    int64 `json:"failed"`    // HTTP errors, transport errors, timeouts, broken streams
	Cancelled int64 `json:"cancelled"` // cut off by Ctrl-C or the drain timeout
	// Dropped counts open-loop arrivals not sent because MaxInFlight
	// requests were already in flight.
	Dropped int64 `json:"dropped"`
	// SessionsBusy counts open-loop multi-turn arrivals skipped because
	// every session was still waiting for its previous answer.
	SessionsBusy int64 `json:"sessions_busy,omitempty"`

	Errors        map[string]int64  `json:"errors"`         // by kind: "http 503", "transport", "timeout", "stream", ...
	ErrorExamples map[string]string `json:"error_examples"` // first message seen per kind
	Statuses      map[int]int64     `json:"statuses"`       // every HTTP status received
	Servers       map[string]int64  `json:"servers"`        // x-served-by value -> responses
	Models        map[string]int64  `json:"models"`         // model sent (base or LoRA adapter) -> requests

	PromptTokens       int64   `json:"prompt_tokens"`
	CachedTokens       int64   `json:"cached_tokens"`
	OutputTokens       int64   `json:"output_tokens"`
	PrefixCacheHitRate float64 `json:"prefix_cache_hit_rate"` // CachedTokens / PromptTokens

	RequestThroughput     float64 `json:"request_throughput"`      // completed requests per second of window
	OutputTokenThroughput float64 `json:"output_token_throughput"` // output tokens per second of window

	TTFT Summary `json:"ttft"` // request sent -> first token event
	TPOT Summary `json:"tpot"` // (end - first token) / (output tokens - 1), per request
	ITL  Summary `json:"itl"`  // gaps between consecutive token events
	E2E  Summary `json:"e2e"`  // request sent -> response complete
}

type stageAcc struct {
	index                  int
	stage                  Stage
	start, end, lastFinish time.Time

	sent, completed, failed, cancelled, dropped, busy int64
	prompt, cached, out                               int64

	errors   map[string]int64
	examples map[string]string
	statuses map[int]int64
	servers  map[string]int64
	models   map[string]int64

	ttft, tpot, itl, e2e histogram
}

func newStageAcc(i int, st Stage) *stageAcc {
	return &stageAcc{
		index: i, stage: st,
		errors: map[string]int64{}, examples: map[string]string{}, statuses: map[int]int64{},
		servers: map[string]int64{}, models: map[string]int64{},
	}
}

// collector aggregates results; safe for concurrent use.
type collector struct {
	mu     sync.Mutex
	stages []*stageAcc
}

func newCollector(stages []Stage) *collector {
	c := &collector{}
	for i, st := range stages {
		c.stages = append(c.stages, newStageAcc(i, st))
	}
	return c
}

func (c *collector) stageBounds(i int, start, end time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !start.IsZero() {
		c.stages[i].start = start
	}
	if !end.IsZero() {
		c.stages[i].end = end
	}
}

func (c *collector) sent(stage int, model string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stages[stage].sent++
	c.stages[stage].models[model]++
}

func (c *collector) dropped(stage int, busySessions bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if busySessions {
		c.stages[stage].busy++
	} else {
		c.stages[stage].dropped++
	}
}

func (c *collector) record(r *result) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a := c.stages[r.stage]
	if r.end.After(a.lastFinish) {
		a.lastFinish = r.end
	}
	if r.status != 0 {
		a.statuses[r.status]++
	}
	if r.server != "" {
		a.servers[r.server]++
	}
	switch r.errKind {
	case "":
	case ErrCancelled:
		a.cancelled++
		return
	default:
		a.failed++
		a.errors[r.errKind]++
		if _, ok := a.examples[r.errKind]; !ok {
			a.examples[r.errKind] = truncate(r.detail, 300)
		}
		return
	}
	a.completed++
	a.prompt += int64(r.prompt)
	a.cached += int64(r.cached)
	a.out += int64(r.outTokens)
	a.e2e.record(r.end.Sub(r.start))
	if !r.firstToken.IsZero() {
		a.ttft.record(r.firstToken.Sub(r.start))
		if r.outTokens > 1 {
			a.tpot.record(r.end.Sub(r.firstToken) / time.Duration(r.outTokens-1))
		}
	}
	for _, d := range r.itl {
		a.itl.record(d)
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// report builds the stage reports and their total.
func (c *collector) report() (stages []StageReport, total StageReport) {
	c.mu.Lock()
	defer c.mu.Unlock()
	all := newStageAcc(-1, Stage{})
	for _, a := range c.stages {
		stages = append(stages, a.build())
		all.merge(a)
	}
	total = all.build()
	return stages, total
}

func (a *stageAcc) merge(o *stageAcc) {
	if !o.start.IsZero() && (a.start.IsZero() || o.start.Before(a.start)) {
		a.start = o.start
	}
	if o.end.After(a.end) {
		a.end = o.end
	}
	if o.lastFinish.After(a.lastFinish) {
		a.lastFinish = o.lastFinish
	}
	a.sent += o.sent
	a.completed += o.completed
	a.failed += o.failed
	a.cancelled += o.cancelled
	a.dropped += o.dropped
	a.busy += o.busy
	a.prompt += o.prompt
	a.cached += o.cached
	a.out += o.out
	for k, v := range o.errors {
		a.errors[k] += v
	}
	for k, v := range o.examples {
		if _, ok := a.examples[k]; !ok {
			a.examples[k] = v
		}
	}
	for k, v := range o.statuses {
		a.statuses[k] += v
	}
	for k, v := range o.servers {
		a.servers[k] += v
	}
	for k, v := range o.models {
		a.models[k] += v
	}
	a.ttft.merge(&o.ttft)
	a.tpot.merge(&o.tpot)
	a.itl.merge(&o.itl)
	a.e2e.merge(&o.e2e)
}

func (a *stageAcc) build() StageReport {
	r := StageReport{
		Stage: a.index, Rate: a.stage.Rate, Concurrency: a.stage.Concurrency,
		Sent: a.sent, Completed: a.completed, Failed: a.failed, Cancelled: a.cancelled,
		Dropped: a.dropped, SessionsBusy: a.busy,
		Errors: maps.Clone(a.errors), ErrorExamples: maps.Clone(a.examples), Statuses: maps.Clone(a.statuses),
		Servers: maps.Clone(a.servers), Models: maps.Clone(a.models),
		PromptTokens: a.prompt, CachedTokens: a.cached, OutputTokens: a.out,
		TTFT: a.ttft.summary(), TPOT: a.tpot.summary(), ITL: a.itl.summary(), E2E: a.e2e.summary(),
	}
	if a.prompt > 0 {
		r.PrefixCacheHitRate = float64(a.cached) / float64(a.prompt)
	}
	if !a.start.IsZero() {
		end := a.end
		if a.lastFinish.After(end) {
			end = a.lastFinish
		}
		if w := end.Sub(a.start).Seconds(); w > 0 {
			r.WindowS = w
			r.RequestThroughput = float64(a.completed) / w
			r.OutputTokenThroughput = float64(a.out) / w
		}
	}
	return r
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("encode report: %w", err)
	}
	return nil
}

// WriteText writes the report as aligned tables: one row per stage plus
// the total, then latency tables, errors, servers and models.
func (r *Report) WriteText(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	fmt.Fprintf(&b, "loadgen: %s %s model=%s workload=%s arrival=%s seed=%d stream=%v elapsed=%.1fs",
		c.API, c.URL, c.Model, c.Workload.Kind, c.Arrival, c.Seed, !c.NoStream, r.ElapsedS)
	if r.Interrupted {
		b.WriteString(" (INTERRUPTED: partial report)")
	}
	b.WriteString("\n\n")

	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "stage\ttarget\twindow\tsent\tok\tfailed\tcancelled\tdropped\treq/s\tout tok/s\tprompt tok\tcached tok\tcache hit\t")
	row := func(name, target string, s StageReport) {
		fmt.Fprintf(tw, "%s\t%s\t%.1fs\t%d\t%d\t%d\t%d\t%d\t%.2f\t%.1f\t%d\t%d\t%.1f%%\t\n",
			name, target, s.WindowS, s.Sent, s.Completed, s.Failed, s.Cancelled, s.Dropped+s.SessionsBusy,
			s.RequestThroughput, s.OutputTokenThroughput, s.PromptTokens, s.CachedTokens, 100*s.PrefixCacheHitRate)
	}
	for i, s := range r.Stages {
		target := fmt.Sprintf("%g/s", s.Rate)
		if c.Arrival == ArrivalConcurrency {
			target = fmt.Sprintf("c=%d", s.Concurrency)
		}
		if i < len(c.Stages) {
			target += fmt.Sprintf(" %v", c.Stages[i].Duration)
		}
		row(fmt.Sprint(i), target, s)
	}
	row("total", "", r.Total)
	if err := tw.Flush(); err != nil {
		return err
	}

	latency := func(title string, s StageReport) error {
		fmt.Fprintf(&b, "\n%s\n", title)
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "metric\tcount\tmean ms\tp50 ms\tp90 ms\tp99 ms\tmax ms\t")
		for _, m := range []struct {
			name string
			s    Summary
		}{{"TTFT", s.TTFT}, {"TPOT", s.TPOT}, {"ITL", s.ITL}, {"E2E", s.E2E}} {
			fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t\n",
				m.name, m.s.Count, m.s.MeanMs, m.s.P50Ms, m.s.P90Ms, m.s.P99Ms, m.s.MaxMs)
		}
		return tw.Flush()
	}
	if len(r.Stages) > 1 {
		for i, s := range r.Stages {
			if err := latency(fmt.Sprintf("latency, stage %d", i), s); err != nil {
				return err
			}
		}
	}
	if err := latency("latency, total", r.Total); err != nil {
		return err
	}

	t := r.Total
	writeCounts(&b, "statuses", intKeys(t.Statuses))
	writeCounts(&b, "errors", t.Errors)
	for _, k := range slices.Sorted(maps.Keys(t.ErrorExamples)) {
		fmt.Fprintf(&b, "  e.g. %s: %s\n", k, t.ErrorExamples[k])
	}
	writeCounts(&b, "servers", t.Servers)
	writeCounts(&b, "models", t.Models)
	if t.SessionsBusy > 0 {
		fmt.Fprintf(&b, "multi-turn arrivals skipped (all sessions busy): %d\n", t.SessionsBusy)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func intKeys(m map[int]int64) map[string]int64 {
	out := make(map[string]int64, len(m))
	for k, v := range m {
		out[fmt.Sprint(k)] = v
	}
	return out
}

func writeCounts(b *strings.Builder, title string, m map[string]int64) {
	if len(m) == 0 {
		fmt.Fprintf(b, "\n%s: none\n", title)
		return
	}
	var total int64
	for _, v := range m {
		total += v
	}
	width := 0
	for k := range m {
		width = max(width, len(k))
	}
	fmt.Fprintf(b, "\n%s:\n", title)
	for _, k := range slices.Sorted(maps.Keys(m)) {
		fmt.Fprintf(b, "  %-*s %8d  %5.1f%%\n", width, k, m[k], 100*float64(m[k])/math.Max(1, float64(total)))
	}
}
