package sched

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/registry"
)

// Scorer names, as used in a pool's scheduling.scorers weights.
const (
	// ScorerQueue: scraped waiting requests plus requests sent since the
	// last scrape (fewer is better).
	ScorerQueue = "queue"
	// ScorerRunning: scraped running requests (fewer is better).
	ScorerRunning = "running"
	// ScorerKVCache: 1 - scraped KV-cache utilisation.
	ScorerKVCache = "kv-cache"
	// ScorerInFlight: requests in flight through this picker (fewer is
	// better; tokens break ties).
	ScorerInFlight = "in-flight"
	// ScorerInFlightTokens: estimated prompt tokens in flight through this
	// picker (fewer is better).
	ScorerInFlightTokens = "in-flight-tokens"
	// ScorerPrefix: fraction of the prompt's KV blocks the endpoint likely
	// caches, faded out when the endpoint is much busier than the least
	// loaded one.
	ScorerPrefix = "prefix"
	// ScorerLoRA: adapter running > free adapter slot > no slot (adapter
	// requests only).
	ScorerLoRA = "lora"
	// ScorerSession: the endpoint that served the session's previous
	// request, unless it is overloaded.
	ScorerSession = "session"
	// ScorerTTFT: predicted time to first token (prefill queued ahead or
	// slot wait, prefill of the uncached prompt, adapter load), as
	// min/own, so the fastest scores 1.
	ScorerTTFT = "ttft"
)

// ScorerNames lists every scorer name, in documentation order.
func ScorerNames() []string {
	return []string{ScorerQueue, ScorerRunning, ScorerKVCache, ScorerInFlight, ScorerInFlightTokens, ScorerPrefix, ScorerLoRA, ScorerSession, ScorerTTFT}
}

// Profile names (registry.Scheduling.Profile).
const (
	// ProfileDefault is what a pool without a profile gets: the profile
	// DefaultProfileIs names.
	ProfileDefault = "default"
	// ProfileWeighted is the weighted mix of DefaultWeights.
	ProfileWeighted     = "weighted"
	ProfileRoundRobin   = "round-robin"
	ProfileRandom       = "random"
	ProfileLeastQueue   = "least-queue"
	ProfileLeastRequest = "least-request"
	// ProfilePredictedTTFT sends each request where its predicted time to
	// first token is lowest (TTFTScorer).
	ProfilePredictedTTFT = "predicted-ttft"
	// ProfileCacheAware is predicted-ttft that also prices what a pick
	// evicts from a full KV cache and pulls noisy learned rates towards
	// the pool's (TTFTScorer with EvictionCost and Shrink).
	ProfileCacheAware = "cache-aware"
)

// ProfileNames lists every profile name.
func ProfileNames() []string {
	return []string{ProfileDefault, ProfileWeighted, ProfilePredictedTTFT, ProfileCacheAware, ProfileRoundRobin, ProfileRandom, ProfileLeastQueue, ProfileLeastRequest}
}

// DefaultProfileIs is the profile "default" (and no profile) stands for.
const DefaultProfileIs = ProfileWeighted

// Picker names (registry.Scheduling.Picker).
const (
	PickerMaxScore       = "max-score"
	PickerWeightedRandom = "weighted-random"
)

// PickerNames lists every picker name a pool may choose.
func PickerNames() []string { return []string{PickerMaxScore, PickerWeightedRandom} }

// DefaultWeights returns the default profile's scorer weights. The mix
// aims at the lowest time to first token with no tuning:
//
//	prefix           3    a cached prompt skips most of its prefill; faded by the load guard
//	queue            2    waiting requests delay the first token directly
//	lora             2    an adapter request on a server without the adapter waits for a slot
//	session          2    multi-turn sessions reuse their conversation's KV blocks
//	kv-cache         1    a full KV cache preempts and evicts
//	in-flight-tokens 0.5  outstanding prefill work the scrape cannot see yet
//
// running and in-flight are 0 (available to overrides): queue already
// counts what the picker sent since the last scrape.
func DefaultWeights() map[string]float64 {
	return map[string]float64{
		ScorerPrefix: 3, ScorerQueue: 2, ScorerLoRA: 2, ScorerSession: 2,
		ScorerKVCache: 1, ScorerInFlightTokens: 0.5,
	}
}

// PredictedTTFTWeights returns the predicted-ttft profile's scorer
// weights:
//
//	ttft       1     the predicted time to first token decides
//	session    0.2   a session stays on its server unless that is predicted
//	                 more than a quarter slower than the best
//	in-flight  0.01  breaks near-ties (predictions within 1 %), as before
//	                 any metrics or with prompts too short to predict
//	                 apart: requests in decode hold no prefill, but they
//	                 slow every engine step, so the less busy server wins
func PredictedTTFTWeights() map[string]float64 {
	return map[string]float64{ScorerTTFT: 1, ScorerSession: 0.2, ScorerInFlight: 0.01}
}

// profileWeights returns the built-in weights of a profile.
func profileWeights(name string) map[string]float64 {
	switch name {
	case ProfileLeastQueue:
		return map[string]float64{ScorerQueue: 1}
	case ProfileLeastRequest:
		return map[string]float64{ScorerInFlight: 1}
	case ProfilePredictedTTFT, ProfileCacheAware:
		return PredictedTTFTWeights()
	case ProfileRoundRobin, ProfileRandom:
		return map[string]float64{}
	}
	return DefaultWeights()
}

// Deps is the per-pool state scorers and pickers share across profile
// rebuilds. Nil fields disable what needs them.
type Deps struct {
	// Prefix is the pool's prefix-cache index (prefix scorer).
	Prefix *prefix.Index
	// Residency, when set, is what the TTFT scorer of the cache-aware
	// profile consults for what endpoints hold and evict (an index fed by
	// the engines' KV events); nil: the estimating Prefix index.
	Residency Residency
	// Sessions is the pool's session table (session scorer).
	Sessions *Sessions
	// RoundRobin is the pool's round-robin position.
	RoundRobin *atomic.Uint64
	// MaxInFlightPerEndpoint adds the in-flight saturation guard (<= 0:
	// none).
	MaxInFlightPerEndpoint int64
	// Guard overrides DefaultLoadGuard for affinity scorers (zero value:
	// the default).
	Guard loadGuard
}

// Rules judges a pool's scheduling block: profile, picker, scorer names
// and weights, thresholds and metric overrides. It is the one statement of
// what a scheduling block may say: the registry applies it to every
// configuration (registry.SchedulingRules, reported at the field's file
// position) and BuildProfile to every block it builds. Nil is valid.
func Rules(sc *registry.Scheduling) []registry.Problem {
	if sc == nil {
		return nil
	}
	var out []registry.Problem
	add := func(field, format string, args ...any) {
		out = append(out, registry.Problem{Field: field, Msg: fmt.Sprintf(format, args...)})
	}
	if sc.Profile != "" && !slices.Contains(ProfileNames(), sc.Profile) {
		add("profile", "unknown profile %q: want one of %s", sc.Profile, quoted(ProfileNames()))
	}
	if sc.Picker != "" && !slices.Contains(PickerNames(), sc.Picker) {
		add("picker", "unknown picker %q: want one of %s", sc.Picker, quoted(PickerNames()))
	}
	if sc.ScrapeIntervalMS < 0 {
		add("scrape_interval", "scrape_interval %d ms is negative", sc.ScrapeIntervalMS)
	}
	if sc.IdleScrapeIntervalMS < 0 {
		add("idle_scrape_interval", "idle_scrape_interval %d ms is negative", sc.IdleScrapeIntervalMS)
	}
	if sc.QueueThreshold < 0 {
		add("queue_threshold", "queue_threshold %d is negative; want 0 or more", sc.QueueThreshold)
	}
	if sc.KVThreshold < 0 || sc.KVThreshold > 1 || math.IsNaN(sc.KVThreshold) {
		add("kv_threshold", "kv_threshold %g is not in [0, 1]", sc.KVThreshold)
	}
	for _, n := range slices.Sorted(maps.Keys(sc.Scorers)) {
		switch w := sc.Scorers[n]; {
		case !slices.Contains(ScorerNames(), n):
			add("scorers."+n, "unknown scorer %q: want one of %s", n, quoted(ScorerNames()))
		case w < 0 || math.IsNaN(w) || math.IsInf(w, 0):
			add("scorers."+n, "scorer %q has weight %g; want a finite number >= 0", n, w)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(sc.Metrics)) {
		switch v := sc.Metrics[k]; {
		case !slices.Contains(metrics.LogicalNames(), k):
			add("metrics."+k, "unknown metric %q: want one of %s", k, quoted(metrics.LogicalNames()))
		case v == "":
			add("metrics."+k, "metric %q has an empty name", k)
		default:
			if err := metrics.ValidateOverrides(map[string]string{k: v}); err != nil {
				add("metrics."+k, "%v", err)
			}
		}
	}
	return out
}

// ValidateScheduling returns Rules' problems as one error (nil when there
// are none), each prefixed with its field.
func ValidateScheduling(sc *registry.Scheduling) error {
	var errs []error
	for _, p := range Rules(sc) {
		errs = append(errs, fmt.Errorf("scheduling.%s: %s", p.Field, p.Msg))
	}
	return errors.Join(errs...)
}

func quoted(xs []string) string {
	q := make([]string, len(xs))
	for i, x := range xs {
		q[i] = fmt.Sprintf("%q", x)
	}
	return strings.Join(q, ", ")
}

// BuildProfile turns a pool's scheduling block (nil: defaults) into a
// Profile. Every profile filters on the subset hint, draining, endpoint
// model lists and metrics health (the default profile also on LoRA slots),
// and carries the saturation rule: Thresholds from queue_threshold /
// kv_threshold (defaults 5 and 0.8) plus the in-flight guard from deps.
func BuildProfile(sc *registry.Scheduling, deps Deps) (*Profile, error) {
	if err := ValidateScheduling(sc); err != nil {
		return nil, err
	}
	if sc == nil {
		sc = &registry.Scheduling{}
	}
	name := sc.Profile
	if name == "" || name == ProfileDefault {
		name = DefaultProfileIs
	}
	guard := deps.Guard
	if guard == (loadGuard{}) {
		guard = DefaultLoadGuard
	}
	weights := profileWeights(name)
	for n, w := range sc.Scorers {
		weights[n] = w
	}
	p := &Profile{
		Name: name,
		// Health first (after draining): it judges the whole pool, as
		// EDS does; the per-request filters follow.
		Filters: []Filter{drainingFilter{}, healthFilter{}, subsetFilter{}, modelFilter{AnyAdapter: sc.AdaptersOnDemand}},
	}
	if name == ProfileWeighted || name == ProfilePredictedTTFT || name == ProfileCacheAware {
		p.Filters = append(p.Filters, loraFilter{})
	}
	for _, n := range ScorerNames() {
		w := weights[n]
		if w == 0 {
			continue
		}
		var s Scorer
		switch n {
		case ScorerQueue:
			s = queueScorer{}
		case ScorerRunning:
			s = runningScorer{}
		case ScorerKVCache:
			s = kvCacheScorer{}
		case ScorerInFlight:
			s = leastInFlight{}
		case ScorerInFlightTokens:
			s = inFlightTokensScorer{}
		case ScorerPrefix:
			if deps.Prefix == nil {
				continue
			}
			s = &prefixScorer{Index: deps.Prefix, Guard: guard}
		case ScorerLoRA:
			s = loraScorer{}
		case ScorerSession:
			if deps.Sessions == nil {
				continue
			}
			s = &sessionScorer{Table: deps.Sessions, Guard: guard}
		case ScorerTTFT:
			ts := &TTFTScorer{Index: deps.Prefix}
			if name == ProfileCacheAware {
				ts.Residency, ts.EvictionCost, ts.Shrink = deps.Residency, true, true
			}
			s = ts
		}
		p.Scorers = append(p.Scorers, weightedScorer{Scorer: s, Weight: w})
	}
	switch {
	case name == ProfileRoundRobin:
		p.Picker = roundRobin{Counter: deps.RoundRobin}
	case sc.Picker == PickerWeightedRandom:
		p.Picker = weightedRandom{}
	default:
		p.Picker = maxScore{}
	}
	th := Thresholds{Queue: sc.QueueThreshold, KV: sc.KVThreshold}
	if th.Queue == 0 {
		th.Queue = DefaultQueueThreshold
	}
	if th.KV == 0 {
		th.KV = DefaultKVThreshold
	}
	p.Saturation = anySaturated{th, inFlightLimit{Max: deps.MaxInFlightPerEndpoint}}
	return p, nil
}

// Uses reports whether the profile has a scorer called name with a
// non-zero weight (the picker skips prompt hashing and session lookups a
// profile does not use).
func (p *Profile) Uses(name string) bool {
	for _, ws := range p.Scorers {
		if ws.Weight != 0 && ws.Scorer.Name() == name {
			return true
		}
	}
	return false
}

// DefaultProfile is the least-request profile without per-pool state: it
// needs no metrics and no configuration.
func DefaultProfile() *Profile {
	p, _ := BuildProfile(&registry.Scheduling{Profile: ProfileLeastRequest}, Deps{})
	return p
}
