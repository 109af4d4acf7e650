// Package decisions owns the picker's decision records: one structured
// record per request (sampled), saying what the request was, which
// endpoints were candidates with every scorer's score, what was picked and
// how the request ended. Records are kept in a bounded in-memory ring,
// queried with filters (the admin API's /api/decisions), and optionally
// appended to a file as JSON lines.
//
// A Record is immutable once added: the ring, readers and the file writer
// share it without copying.
package decisions

import (
	"cmp"
	"encoding/json"
	"slices"
	"strconv"
	"time"
)

// Record is one request's decision and outcome.
type Record struct {
	// Seq numbers records in the order they were added (from 1).
	Seq uint64
	// Time is when the request reached the picker.
	Time time.Time
	// RequestID is Envoy's x-request-id; TraceID the request's trace
	// (hex) when it was traced.
	RequestID, TraceID string
	// Model is the name the client sent, Target the name sent upstream
	// (a rewrite's target, else Model), Pool the pool it was routed in.
	Model, Target, Pool string
	// Tenant is the tenant the request was authenticated as ("" without
	// tenants).
	Tenant   string
	Priority int
	// PromptTokens is the picker's estimate of the prompt's size.
	PromptTokens int64

	// Filters are the profile's filters that ran, each with the
	// candidates it left, out of PoolSize endpoints.
	PoolSize int
	Filters  []FilterStep
	// Scorers are the profile's scorers that ran; each candidate's
	// Scores follow their order.
	Scorers []Scorer
	// Candidates are the filtered endpoints, as indexes into Endpoints
	// (the pool's addresses, shared by every record of the pool), and
	// Totals their weighted totals: at most the recorder's MaxCandidates
	// of the best totals, Omitted counting the rest. Scores holds every
	// candidate's scores, scorer by scorer: Scores[j*len(Candidates)+c] is
	// scorer j's score of candidate c, in [0, 1] before its weight, in
	// units of 1/ScoreUnit (see Score). None of them holds a pointer, so
	// a full ring costs the garbage collector little.
	Endpoints  []string
	Candidates []int32
	Totals     []float32
	Scores     []uint16
	Omitted    int
	// Predicted is, with the predicted-ttft profile, each candidate's
	// predicted time to first token, in Candidates' order (nil with other
	// profiles).
	Predicted []PredictedTTFT
	// Picked is the primary endpoint, Fallbacks the others in the
	// destination list, in order.
	Picked    string
	Fallbacks []string
	// DecisionTime is how long the decision took (parse, filter, score,
	// pick), the admission wait excluded.
	DecisionTime time.Duration
	// PD is the prefill/decode decision of a completions or chat request
	// of a disaggregated pool (nil otherwise).
	PD *PD

	// Queued: the request waited in the pool's admission queue, for
	// QueueWait, and left it as QueueOutcome ("dispatched", or why not).
	Queued       bool
	QueueWait    time.Duration
	QueueOutcome string

	// Status is the HTTP status: the picker's own local reply, else the
	// model server's; 0 when the request ended before any answer (the
	// client or Envoy gave up). Error is the local reply's message.
	Status int
	Error  string
	// Served is the endpoint Envoy reports as having served the request
	// ("" when not reported).
	Served string
	// TTFT is the time from arrival to the first response body bytes,
	// Duration to the end of the response; OutputTokens the tokens
	// generated (the server's usage, else counted stream events).
	TTFT, Duration time.Duration
	OutputTokens   int
}

// FilterStep is one filter and the candidates it left.
type FilterStep struct {
	Name string `json:"name"`
	Left int    `json:"left"`
}

// Scorer is one scorer of a decision and its weight.
type Scorer struct {
	Name   string  `json:"name"`
	Weight float64 `json:"weight"`
}

// PredictedTTFT is a candidate's predicted time to first token: the wait
// before its prefill (prefill queued ahead or a slot), the prefill of the
// Uncached prompt tokens, and the total (with the fixed part and an
// adapter load).
type PredictedTTFT struct {
	Wait, Prefill, Total time.Duration
	Uncached             int64
}

// PD is a request's prefill/decode decision: split (its prefill on
// Prefill) or why not, the prompt's tokens not cached on the decode
// server (the picked endpoint), and what the decode server's sidecar
// reported having done (split, fallback: the prefill failed and it served
// the request whole, local; "" when it reported nothing).
type PD struct {
	Decision       string `json:"decision"`
	Prefill        string `json:"prefill,omitempty"`
	UncachedTokens int    `json:"uncached_tokens"`
	Result         string `json:"result,omitempty"`
}

// Candidate returns candidate c's address.
func (r *Record) Candidate(c int) string { return r.Endpoints[r.Candidates[c]] }

// ScoreUnit is the resolution of Record.Scores: a score s in [0, 1] is
// kept as round(s * ScoreUnit).
const ScoreUnit = 65535

// QuantizeScore converts a score in [0, 1] for Record.Scores.
func QuantizeScore(s float64) uint16 {
	switch {
	case s <= 0:
		return 0
	case s >= 1:
		return ScoreUnit
	}
	return uint16(s*ScoreUnit + 0.5)
}

// Score returns scorer j's score of candidate c.
func (r *Record) Score(c, j int) float64 {
	return float64(r.Scores[j*len(r.Candidates)+c]) / ScoreUnit
}

// recordJSON is a Record's wire shape (see MarshalJSON).
type recordJSON struct {
	Seq          uint64          `json:"seq"`
	Time         time.Time       `json:"time"`
	RequestID    string          `json:"request_id,omitempty"`
	TraceID      string          `json:"trace_id,omitempty"`
	Model        string          `json:"model"`
	Target       string          `json:"target"`
	Pool         string          `json:"pool"`
	Tenant       string          `json:"tenant"`
	Priority     int             `json:"priority"`
	PromptTokens int64           `json:"prompt_tokens"`
	PoolSize     int             `json:"pool_size"`
	Filters      []FilterStep    `json:"filters"`
	Scorers      []Scorer        `json:"scorers"`
	Candidates   []candidateJSON `json:"candidates"`
	Omitted      int             `json:"candidates_omitted,omitempty"`
	Picked       string          `json:"picked"`
	Fallbacks    []string        `json:"fallbacks"`
	DecisionUS   float64         `json:"decision_us"`
	PD           *PD             `json:"pd,omitempty"`
	Queue        *queueJSON      `json:"queue,omitempty"`
	Outcome      outcomeJSON     `json:"outcome"`
}

type candidateJSON struct {
	Endpoint  string             `json:"endpoint"`
	Total     float64            `json:"total"`
	Scores    map[string]float64 `json:"scores"`
	Predicted *predictedJSON     `json:"predicted_ttft,omitempty"`
}

type predictedJSON struct {
	WaitMS         float64 `json:"wait_ms"`
	PrefillMS      float64 `json:"prefill_ms"`
	TotalMS        float64 `json:"total_ms"`
	UncachedTokens int64   `json:"uncached_tokens"`
}

type queueJSON struct {
	WaitedMS float64 `json:"waited_ms"`
	Outcome  string  `json:"outcome"`
}

type outcomeJSON struct {
	Status       int     `json:"status"`
	Error        string  `json:"error,omitempty"`
	Served       string  `json:"served"`
	TTFTMS       float64 `json:"ttft_ms"`
	DurationMS   float64 `json:"duration_ms"`
	OutputTokens int     `json:"output_tokens"`
}

// MarshalJSON renders the record with candidates best first and each
// candidate's scores keyed by scorer name.
func (r *Record) MarshalJSON() ([]byte, error) {
	out := recordJSON{
		Seq: r.Seq, Time: r.Time.UTC(), RequestID: r.RequestID, TraceID: r.TraceID,
		Model: r.Model, Target: r.Target, Pool: r.Pool, Tenant: r.Tenant, Priority: r.Priority,
		PromptTokens: r.PromptTokens, PoolSize: r.PoolSize, Filters: r.Filters, Scorers: r.Scorers,
		Candidates: make([]candidateJSON, 0, len(r.Candidates)), Omitted: r.Omitted,
		Picked: r.Picked, Fallbacks: r.Fallbacks, DecisionUS: micros(r.DecisionTime), PD: r.PD,
		Outcome: outcomeJSON{Status: r.Status, Error: r.Error, Served: r.Served, TTFTMS: millis(r.TTFT),
			DurationMS: millis(r.Duration), OutputTokens: r.OutputTokens},
	}
	if out.Filters == nil {
		out.Filters = []FilterStep{}
	}
	if out.Scorers == nil {
		out.Scorers = []Scorer{}
	}
	if out.Fallbacks == nil {
		out.Fallbacks = []string{}
	}
	k := len(r.Scorers)
	for c, ep := range r.Candidates {
		cj := candidateJSON{Scores: make(map[string]float64, k)}
		if int(ep) < len(r.Endpoints) {
			cj.Endpoint = r.Endpoints[ep]
		}
		if c < len(r.Totals) {
			cj.Total = round(float64(r.Totals[c]))
		}
		if len(r.Scores) == len(r.Candidates)*k {
			for j := range k {
				cj.Scores[r.Scorers[j].Name] = round(r.Score(c, j))
			}
		}
		if c < len(r.Predicted) {
			p := r.Predicted[c]
			cj.Predicted = &predictedJSON{WaitMS: millis(p.Wait), PrefillMS: millis(p.Prefill), TotalMS: millis(p.Total), UncachedTokens: p.Uncached}
		}
		out.Candidates = append(out.Candidates, cj)
	}
	slices.SortStableFunc(out.Candidates, func(a, b candidateJSON) int { return cmp.Compare(b.Total, a.Total) })
	if r.Queued {
		out.Queue = &queueJSON{WaitedMS: millis(r.QueueWait), Outcome: r.QueueOutcome}
	}
	return json.Marshal(&out)
}

// round keeps 4 decimals: scores are estimates, not measurements.
func round(f float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(f, 'f', 4, 64), 64)
	return v
}

func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func micros(d time.Duration) float64 { return float64(d.Nanoseconds()/100) / 10 }
