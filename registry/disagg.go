package registry

import (
	"errors"
	"fmt"
	"strings"
)

// Role says which half of a disaggregated request an endpoint serves: the
// prefill (compute the prompt's KV cache), the decode (receive that KV and
// generate), or both. Roles only matter in a pool with a Disaggregation
// policy; elsewhere every endpoint serves whole requests, as before.
type Role string

// The roles. The zero value is RoleBoth.
const (
	RoleBoth    Role = ""
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// Roles lists the role names a configuration may write, in documentation
// order ("both" is RoleBoth).
var Roles = []string{"prefill", "decode", "both"}

// ErrBadRole and ErrBadDisaggregation are the sentinels of role and
// disaggregation problems.
var (
	ErrBadRole           = errors.New("bad role")
	ErrBadDisaggregation = errors.New("bad disaggregation")
)

// ParseRole reads a role as written in HCL or Consul meta: "prefill",
// "decode", "both" (or "", or llm-d's "prefill-decode", both meaning
// both), case and surrounding space ignored.
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "both", "prefill-decode":
		return RoleBoth, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	return RoleBoth, fmt.Errorf("%w %q: want one of %s", ErrBadRole, s, quoteList(Roles))
}

// String returns the role's configuration name ("both" for RoleBoth).
func (r Role) String() string {
	if r == RoleBoth {
		return "both"
	}
	return string(r)
}

// Prefills reports whether an endpoint of role r may run prefills for
// other servers.
func (r Role) Prefills() bool { return r == RoleBoth || r == RolePrefill }

// Decodes reports whether an endpoint of role r may receive a client's
// request: a decode, or a whole request.
func (r Role) Decodes() bool { return r == RoleBoth || r == RoleDecode }

// Disaggregation is a pool's (or a model's) prefill/decode policy: when a
// request's prompt is long enough and little enough of it is cached on the
// decode server chosen, its prefill runs on a prefill server and only the
// decode on the chosen one (the decode server's sidecar performs the two
// steps). The picker owns its use; the registry carries it.
type Disaggregation struct {
	// Disabled turns the split off (a model's block can turn its pool's
	// off for that model).
	Disabled bool
	// UncachedTokens is the threshold: a request is split when the prompt
	// tokens not already cached on the decode server chosen are at least
	// this many (llm-d's nonCachedTokens). 0 means the default.
	UncachedTokens int
	// MinPromptTokens keeps prompts shorter than this whole, whatever is
	// cached (llm-d's promptTokens); 0: no such gate.
	MinPromptTokens int
	// PrefillQueueThreshold is the waiting requests at which a prefill
	// server counts as saturated and is not chosen; when every one is, the
	// decode server runs the whole request. 0: the pool's queue_threshold.
	PrefillQueueThreshold int
	// DeclRange is where the block was declared ("file:line:column").
	DeclRange string
}

// DefaultUncachedTokens is the split threshold when none is set: at 512
// uncached tokens a prefill costs tens of milliseconds on a large model,
// well above the transfer's cost (llm-d's documented example value).
const DefaultUncachedTokens = 512

// EffectiveUncachedTokens is the threshold with the default applied.
func (d *Disaggregation) EffectiveUncachedTokens() int {
	if d.UncachedTokens > 0 {
		return d.UncachedTokens
	}
	return DefaultUncachedTokens
}

// DisaggregationFor returns the policy for a request of model m in pool p:
// the model's own block if it has one, else the pool's; nil when the
// request is never split (no policy, or a disabled one).
func DisaggregationFor(p *Pool, m *Model) *Disaggregation {
	if p == nil || p.Disaggregation == nil {
		return nil
	}
	d := p.Disaggregation
	if m != nil && m.Disaggregation != nil {
		d = m.Disaggregation
	}
	if d.Disabled {
		return nil
	}
	return d
}

// validateDisaggregation checks a disaggregation block of a pool or model
// (field prefix "disaggregation.").
func validateDisaggregation(kind, name, where string, d *Disaggregation,
	add func(kind, name, field, where string, sentinel error, format string, args ...any)) {
	for _, v := range []struct {
		field string
		n     int
	}{{"uncached_tokens", d.UncachedTokens}, {"min_prompt_tokens", d.MinPromptTokens}, {"prefill_queue_threshold", d.PrefillQueueThreshold}} {
		if v.n < 0 {
			add(kind, name, "disaggregation."+v.field, where, ErrBadDisaggregation, "%s %d is negative; want 0 or more", v.field, v.n)
		}
	}
}

// validateRoles checks a pool's endpoint roles and disaggregation block,
// and a model's block against its pool.
func validateRoles(s *State, add func(kind, name, field, where string, sentinel error, format string, args ...any),
	addEndpoint func(pool, addr, field string, sentinel error, msg string)) {
	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		if p.Disaggregation != nil {
			validateDisaggregation(KindPool, name, p.DeclRange, p.Disaggregation, add)
		}
		for _, ep := range p.Endpoints {
			if r, err := ParseRole(string(ep.Role)); err != nil || r != ep.Role {
				addEndpoint(name, ep.Address, "role", ErrBadRole, fmt.Sprintf("role %q is not a canonical role", ep.Role))
			}
		}
	}
	for _, name := range s.ModelNames() {
		m := s.Models[name]
		if m.Disaggregation == nil {
			continue
		}
		validateDisaggregation(KindModel, name, m.DeclRange, m.Disaggregation, add)
		if p, ok := s.Pools[m.Pool]; ok && p.Disaggregation == nil {
			add(KindModel, name, "disaggregation", m.DeclRange, ErrBadDisaggregation,
				"pool %q is not disaggregated; give it a disaggregation block (and endpoint roles) first", m.Pool)
		}
	}
}
