// Package pd owns the picker's prefill/decode decision for a request of a
// disaggregated pool: whether to split it, given the decode server the
// pool's profile chose and the prompt tokens cached there, and which
// prefill server runs its prefill. It is a pure function of what the
// request stage knows (the prefix index's matches, the scraped and
// in-flight load); the stage that calls it, and what it answers Envoy,
// are described in docs/routing.md ("Prefill/decode disaggregation").
package pd

import (
	"github.com/switchyard/switchyard/registry"
)

// Policy is a pool's (or model's) disaggregation policy with every default
// applied.
type Policy struct {
	// UncachedTokens: split when at least this many prompt tokens are not
	// cached on the decode server.
	UncachedTokens int
	// MinPromptTokens: never split a shorter prompt.
	MinPromptTokens int
	// PrefillQueueThreshold: a prefill server with this many waiting
	// requests is not chosen.
	PrefillQueueThreshold int
	// KVThreshold: nor one with this KV-cache use or more.
	KVThreshold float64
}

// PolicyFrom applies the defaults to d: the pool's queue threshold and KV
// threshold (the picker's saturation settings) stand in for what d leaves
// unset.
func PolicyFrom(d *registry.Disaggregation, queueThreshold int, kvThreshold float64) Policy {
	p := Policy{
		UncachedTokens:        d.EffectiveUncachedTokens(),
		MinPromptTokens:       d.MinPromptTokens,
		PrefillQueueThreshold: d.PrefillQueueThreshold,
		KVThreshold:           kvThreshold,
	}
	if p.PrefillQueueThreshold == 0 {
		p.PrefillQueueThreshold = queueThreshold
	}
	return p
}

// Candidate is one endpoint as the request stage sees it.
type Candidate struct {
	Address string
	Role    registry.Role
	// Ready is false for an endpoint that is draining, not ready, or whose
	// metrics are stale or failing.
	Ready bool
	// CachedTokens is how many of the prompt's leading tokens the prefix
	// index believes the endpoint holds.
	CachedTokens int
	// Waiting is its queue: the last scrape plus what the picker sent
	// since.
	Waiting int
	// KVUsage is its KV-cache use, 0 to 1.
	KVUsage float64
	// PendingPrefillTokens are the prefill tokens the picker sent it whose
	// request has not yet produced a first token.
	PendingPrefillTokens int
}

// Reason says why a request was or was not split.
type Reason string

// The reasons, also the values of the decision counter's reason label.
const (
	Split            Reason = "split"
	ShortPrompt      Reason = "short-prompt"
	Cached           Reason = "below-threshold"
	NoPrefillServer  Reason = "no-prefill-server"
	PrefillSaturated Reason = "prefill-saturated"
	DecodeRole       Reason = "decode-role"
	// Off: the request's model (or its pool) turns the split off; the
	// request stage decides it without calling Decide.
	Off Reason = "off"
)

// Reasons lists every Reason in a fixed order (the decision counter
// exports each, from zero).
var Reasons = [...]Reason{Split, ShortPrompt, Cached, NoPrefillServer, PrefillSaturated, DecodeRole, Off}

// Index returns r's position in Reasons (len(Reasons) for an unknown one).
func (r Reason) Index() int {
	for i, x := range Reasons {
		if x == r {
			return i
		}
	}
	return len(Reasons)
}

// Decision is the outcome for one request.
type Decision struct {
	// Split is true when the request's prefill runs on Prefill.
	Split   bool
	Prefill string
	// Uncached is the prompt's tokens not cached on the decode server.
	Uncached int
	Reason   Reason
}

// Decide decides for a request of promptTokens tokens whose decode server,
// chosen by the pool's profile, is decode; prefill lists the pool's
// endpoints (any role: those that cannot prefill are skipped). It does not
// allocate.
func Decide(promptTokens int, decode Candidate, prefill []Candidate, pol Policy) Decision {
	d := Decision{Uncached: max(0, promptTokens-decode.CachedTokens)}
	switch {
	case !decode.Role.Decodes():
		d.Reason = DecodeRole
		return d
	case promptTokens < pol.MinPromptTokens:
		d.Reason = ShortPrompt
		return d
	case d.Uncached < pol.UncachedTokens:
		d.Reason = Cached
		return d
	}
	best, seen := -1, false
	var bestCost int
	for i := range prefill {
		c := &prefill[i]
		if !c.Role.Prefills() || c.Address == decode.Address || !c.Ready {
			continue
		}
		seen = true
		if c.Waiting >= pol.PrefillQueueThreshold || (pol.KVThreshold > 0 && c.KVUsage >= pol.KVThreshold) {
			continue
		}
		// The prefill work ahead of this prompt there: its own uncached
		// tokens plus the prefills already sent.
		cost := max(0, promptTokens-c.CachedTokens) + c.PendingPrefillTokens
		if best < 0 || cost < bestCost || cost == bestCost && better(c, &prefill[best]) {
			best, bestCost = i, cost
		}
	}
	switch {
	case best >= 0:
		d.Split, d.Prefill, d.Reason = true, prefill[best].Address, Split
	case seen:
		d.Reason = PrefillSaturated
	default:
		d.Reason = NoPrefillServer
	}
	return d
}

// better breaks a cost tie: fewer waiting requests, then the smaller
// address, so that the choice is deterministic.
func better(a, b *Candidate) bool {
	if a.Waiting != b.Waiting {
		return a.Waiting < b.Waiting
	}
	return a.Address < b.Address
}
