// Package load owns switchyard's load generator: seeded synthetic workloads
// (shared-prefix, multi-turn chat, random lengths), open-loop (constant,
// Poisson) and closed-loop (fixed concurrency) arrivals in stages, an
// OpenAI-compatible streaming client that measures TTFT, TPOT, ITL and
// end-to-end latency on real token events, and the report those runs produce.
//
// cmd/loadgen is a thin flag front end; benchmarks and integration tests call
// Run in-process.
package load

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// API selects the OpenAI endpoint requests are sent to.
type API string

// Supported APIs.
const (
	APICompletions API = "completions" // POST /v1/completions with "prompt"
	APIChat        API = "chat"        // POST /v1/chat/completions with "messages"
)

// WorkloadKind names a synthetic workload shape.
type WorkloadKind string

// Supported workloads.
const (
	// WorkloadSharedPrefix: Groups groups, each with its own random system
	// prompt; each group has UsersPerGroup users, each with a fixed question.
	// A request picks a random (group, user) and sends system prompt +
	// question, so requests of one group share an exact prefix.
	WorkloadSharedPrefix WorkloadKind = "shared-prefix"
	// WorkloadMultiTurn: Sessions concurrent chat sessions of Turns turns;
	// each turn resends the whole conversation (previous answers included)
	// plus a new user message, with a session id header.
	WorkloadMultiTurn WorkloadKind = "multi-turn"
	// WorkloadRandom: independent prompts with lengths drawn uniformly from
	// Input, no shared prefixes.
	WorkloadRandom WorkloadKind = "random"
	// WorkloadShortLong: many short prompts, few long ones. A request is
	// long with probability LongFraction: one of Groups long documents
	// (SystemLen tokens, the system prompt) and a new question of
	// QuestionLen tokens; otherwise a new prompt of Input tokens.
	WorkloadShortLong WorkloadKind = "short-long"
)

// ArrivalKind selects how requests are released.
type ArrivalKind string

// Supported arrival processes.
const (
	ArrivalConstant    ArrivalKind = "constant"    // open loop, evenly spaced at Stage.Rate per second
	ArrivalPoisson     ArrivalKind = "poisson"     // open loop, exponential gaps with mean 1/Stage.Rate
	ArrivalConcurrency ArrivalKind = "concurrency" // closed loop, Stage.Concurrency requests always in flight
	// ArrivalBursty is open loop, Poisson arrivals whose rate alternates
	// between bursts at BurstFactor times Stage.Rate and quiet spells at
	// BurstQuiet times it, the bursts a quarter of the time, so the mean
	// is Stage.Rate; phase lengths are exponential with means BurstMean
	// and 3*BurstMean.
	ArrivalBursty ArrivalKind = "bursty"
)

// The bursty arrival process.
const (
	BurstFactor = 2.5
	BurstQuiet  = 0.5
	BurstMean   = time.Second
)

// Range is an inclusive integer range; Min == Max means a fixed value.
type Range struct {
	Min int `json:"min"`
	Max int `json:"max"`
}

// Fixed returns the range holding only n.
func Fixed(n int) Range { return Range{Min: n, Max: n} }

func (r Range) String() string {
	if r.Min == r.Max {
		return fmt.Sprint(r.Min)
	}
	return fmt.Sprintf("%d-%d", r.Min, r.Max)
}

func (r Range) valid(allowZero bool) bool {
	lo := 1
	if allowZero {
		lo = 0
	}
	return r.Min >= lo && r.Max >= r.Min
}

// Workload describes the synthetic requests. All lengths are in tokens; the
// generated text is words of exactly four lowercase letters separated by
// spaces, so N words are N tokens for cmd/vllm-sim's tokenizer.
type Workload struct {
	Kind WorkloadKind `json:"kind"`

	// Output is the number of tokens each request asks for (max_tokens and
	// min_tokens, with ignore_eos). Used by every workload.
	Output Range `json:"output"`

	// shared-prefix
	Groups        int `json:"groups,omitempty"`
	UsersPerGroup int `json:"users_per_group,omitempty"`
	SystemLen     int `json:"system_len,omitempty"`   // also the per-session system prompt for multi-turn (0 = none)
	QuestionLen   int `json:"question_len,omitempty"` // shared-prefix question; multi-turn user message

	// multi-turn
	Sessions      int    `json:"sessions,omitempty"`
	Turns         int    `json:"turns,omitempty"`
	SessionHeader string `json:"session_header,omitempty"` // default "x-session-id"

	// random; short-long: the short prompts
	Input Range `json:"input,omitzero"`

	// short-long: the share of long requests
	LongFraction float64 `json:"long_fraction,omitempty"`
}

// relevant returns w with the fields other workloads use zeroed, so a
// report shows only what shaped the run.
func (w Workload) relevant() Workload {
	out := Workload{Kind: w.Kind, Output: w.Output}
	switch w.Kind {
	case WorkloadSharedPrefix:
		out.Groups, out.UsersPerGroup, out.SystemLen, out.QuestionLen = w.Groups, w.UsersPerGroup, w.SystemLen, w.QuestionLen
	case WorkloadMultiTurn:
		out.Sessions, out.Turns, out.SystemLen, out.QuestionLen, out.SessionHeader = w.Sessions, w.Turns, w.SystemLen, w.QuestionLen, w.SessionHeader
	case WorkloadRandom:
		out.Input = w.Input
	case WorkloadShortLong:
		out.Input, out.Groups, out.SystemLen, out.QuestionLen, out.LongFraction = w.Input, w.Groups, w.SystemLen, w.QuestionLen, w.LongFraction
	}
	return out
}

// Stage is one phase of a run: Rate requests per second (open loop) or
// Concurrency requests in flight (closed loop) for Duration.
type Stage struct {
	Rate        float64       `json:"rate,omitempty"`
	Concurrency int           `json:"concurrency,omitempty"`
	Duration    time.Duration `json:"duration"`
}

// LoRASplit sends Fraction of the requests with model = Adapter.
type LoRASplit struct {
	Adapter  string  `json:"adapter"`
	Fraction float64 `json:"fraction"`
}

// Config is a whole load run.
type Config struct {
	// URL is the OpenAI-compatible base URL, e.g. http://127.0.0.1:8080
	// (a trailing /v1 is accepted). Several comma-separated URLs are used
	// in turn, request by request: client-side round-robin straight to
	// model servers, the baseline routing is measured against.
	URL   string `json:"url"`
	API   API    `json:"api"`
	Model string `json:"model"`
	// NoStream asks for whole JSON answers instead of SSE; then only E2E
	// latency is measured (no TTFT, TPOT or ITL). Streaming is the default.
	NoStream bool          `json:"no_stream,omitempty"`
	Headers  http.Header   `json:"headers,omitempty"` // sent with every request
	Timeout  time.Duration `json:"timeout"`           // per request; 0 = 60s (JSON: nanoseconds, as all durations here)

	Workload Workload    `json:"workload"`
	Arrival  ArrivalKind `json:"arrival"`
	Stages   []Stage     `json:"stages"`
	LoRA     []LoRASplit `json:"lora,omitempty"`
	Seed     uint64      `json:"seed"`

	// MaxInFlight caps open-loop requests in flight; an arrival that finds
	// the cap reached is dropped and counted. 0 = 10000.
	MaxInFlight int `json:"max_in_flight"`
	// DrainTimeout bounds how long Run waits for in-flight requests after
	// the last stage; the rest are cancelled and counted. 0 = 30s.
	DrainTimeout time.Duration `json:"drain_timeout"`

	// Client overrides the tuned HTTP client Run builds (tests, custom TLS).
	Client *http.Client `json:"-"`
	// Logger receives progress messages; nil discards them.
	Logger *slog.Logger `json:"-"`
}

// Defaults used when a Config field is zero.
const (
	DefaultTimeout       = 60 * time.Second
	DefaultMaxInFlight   = 10000
	DefaultDrainTimeout  = 30 * time.Second
	DefaultSessionHeader = "x-session-id"
)

func (c *Config) withDefaults() Config {
	out := *c
	if out.API == "" {
		out.API = APICompletions
	}
	if out.Timeout == 0 {
		out.Timeout = DefaultTimeout
	}
	if out.MaxInFlight == 0 {
		out.MaxInFlight = DefaultMaxInFlight
	}
	if out.DrainTimeout == 0 {
		out.DrainTimeout = DefaultDrainTimeout
	}
	if out.Arrival == "" {
		out.Arrival = ArrivalConstant
	}
	if out.Workload.Kind == "" {
		out.Workload.Kind = WorkloadRandom
	}
	if out.Workload.SessionHeader == "" {
		out.Workload.SessionHeader = DefaultSessionHeader
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return out
}

// Validate reports every problem with the configuration at once.
func (c *Config) Validate() error {
	cfg := c.withDefaults()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	for _, raw := range strings.Split(cfg.URL, ",") {
		if u, err := url.Parse(strings.TrimSpace(raw)); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("url %q: want http(s)://host[:port], or several separated by commas", raw)
		}
	}
	if cfg.API != APICompletions && cfg.API != APIChat {
		bad("api %q: want %q or %q", cfg.API, APICompletions, APIChat)
	}
	if cfg.Model == "" {
		bad("model: required")
	}
	if cfg.Timeout < 0 || cfg.DrainTimeout < 0 || cfg.MaxInFlight < 0 {
		bad("timeout, drain timeout and max in-flight must not be negative")
	}
	w := cfg.Workload
	if !w.Output.valid(false) {
		bad("output length %s: want 1 or more, min <= max", w.Output)
	}
	switch w.Kind {
	case WorkloadSharedPrefix:
		if w.Groups < 1 || w.UsersPerGroup < 1 {
			bad("shared-prefix: groups (%d) and users per group (%d) must be >= 1", w.Groups, w.UsersPerGroup)
		}
		if w.SystemLen < 1 || w.QuestionLen < 1 {
			bad("shared-prefix: system prompt length (%d) and question length (%d) must be >= 1", w.SystemLen, w.QuestionLen)
		}
	case WorkloadMultiTurn:
		if w.Sessions < 1 || w.Turns < 1 {
			bad("multi-turn: sessions (%d) and turns (%d) must be >= 1", w.Sessions, w.Turns)
		}
		if w.QuestionLen < 1 || w.SystemLen < 0 {
			bad("multi-turn: user message length (%d) must be >= 1 and system prompt length (%d) >= 0", w.QuestionLen, w.SystemLen)
		}
		if strings.TrimSpace(w.SessionHeader) == "" {
			bad("multi-turn: session header name is empty")
		}
	case WorkloadRandom:
		if !w.Input.valid(false) {
			bad("random: input length %s: want 1 or more, min <= max", w.Input)
		}
	case WorkloadShortLong:
		if !w.Input.valid(false) {
			bad("short-long: short prompt length %s: want 1 or more, min <= max", w.Input)
		}
		if w.Groups < 1 || w.SystemLen < 1 || w.QuestionLen < 1 {
			bad("short-long: documents (%d), document length (%d) and question length (%d) must be >= 1", w.Groups, w.SystemLen, w.QuestionLen)
		}
		if w.LongFraction < 0 || w.LongFraction > 1 {
			bad("short-long: long fraction %v: want [0, 1]", w.LongFraction)
		}
	default:
		bad("workload %q: want %q, %q, %q or %q", w.Kind, WorkloadSharedPrefix, WorkloadMultiTurn, WorkloadRandom, WorkloadShortLong)
	}
	switch cfg.Arrival {
	case ArrivalConstant, ArrivalPoisson, ArrivalConcurrency, ArrivalBursty:
	default:
		bad("arrival %q: want %q, %q, %q or %q", cfg.Arrival, ArrivalConstant, ArrivalPoisson, ArrivalBursty, ArrivalConcurrency)
	}
	if len(cfg.Stages) == 0 {
		bad("stages: at least one stage is required")
	}
	for i, s := range cfg.Stages {
		if s.Duration <= 0 {
			bad("stage %d: duration %v must be positive", i, s.Duration)
		}
		if cfg.Arrival == ArrivalConcurrency {
			if s.Concurrency < 0 {
				bad("stage %d: concurrency %d must not be negative", i, s.Concurrency)
			}
		} else if s.Rate < 0 {
			bad("stage %d: rate %v must not be negative", i, s.Rate)
		}
	}
	sum := 0.0
	seen := map[string]bool{}
	for _, l := range cfg.LoRA {
		if l.Adapter == "" || l.Fraction <= 0 || l.Fraction > 1 {
			bad("lora %q:%v: want a name and a fraction in (0,1]", l.Adapter, l.Fraction)
		}
		if seen[l.Adapter] {
			bad("lora %q listed twice", l.Adapter)
		}
		seen[l.Adapter] = true
		sum += l.Fraction
	}
	if sum > 1+1e-9 {
		bad("lora fractions sum to %.3f, more than 1", sum)
	}
	return errors.Join(errs...)
}

// TotalDuration is the sum of the stage durations (the run's length before
// draining).
func (c *Config) TotalDuration() time.Duration {
	var d time.Duration
	for _, s := range c.Stages {
		d += s.Duration
	}
	return d
}

// endpoints returns the request URL of every configured base URL for the
// configured API.
func (c *Config) endpoints() []string {
	var out []string
	for _, raw := range strings.Split(c.URL, ",") {
		base := strings.TrimRight(strings.TrimSpace(raw), "/")
		if !strings.HasSuffix(base, "/v1") {
			base += "/v1"
		}
		if c.API == APIChat {
			out = append(out, base+"/chat/completions")
		} else {
			out = append(out, base+"/completions")
		}
	}
	return out
}
