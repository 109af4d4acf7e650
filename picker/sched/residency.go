package sched

import (
	"time"

	"github.com/switchyard/switchyard/picker/prefix"
)

// Residency is what a scorer knows of the KV caches of a pool's
// endpoints: how much of a request's prompt each holds, and what a pick
// would push out of a full one. The estimating prefix index provides it
// from the picker's own picks (IndexResidency); an index that follows the
// engines' own KV-cache events can provide it exactly, falling back to an
// estimate for a server whose events it lacks. Both methods run on the
// decision's hot path: they must not allocate.
type Residency interface {
	// Held sets held[i] to how many of the request's leading prompt
	// blocks (of Request.BlockTokens) the endpoint at addrs[i] holds.
	Held(req *Request, addrs []string, held []int)
	// Evicts reports what the endpoint at addr would push out of its
	// cache to take blocks new blocks of the request's prompt.
	Evicts(req *Request, addr string, blocks int) Eviction
}

// Eviction is what a pick would push out of an endpoint's KV cache.
type Eviction struct {
	// Blocks is how many cached blocks it would evict: 0 while the cache
	// has room for the new ones.
	Blocks int
	// Lost is how many of them are the pool's only cached copy of a
	// prefix in use (a block requests reused recently): the next request
	// for each computes it again.
	Lost int
}

// ReuseWindow is how recently IndexResidency requires a block to have
// been reused for its eviction to count as lost: a prefix nobody asked
// for in a minute is not held for anyone.
const ReuseWindow = time.Minute

// IndexResidency is Residency from the estimating prefix index: an
// endpoint holds what the picker last routed to it, up to its KV block
// count, least recently routed evicted first, as vLLM evicts the least
// recently freed blocks.
type IndexResidency struct {
	Index *prefix.Index
}

// Held implements Residency.
func (r IndexResidency) Held(req *Request, addrs []string, held []int) {
	if r.Index == nil || len(req.Hashes) == 0 {
		clear(held[:len(addrs)])
		return
	}
	r.Index.MatchInto(req.Hashes, addrs, held)
}

// Evicts implements Residency.
func (r IndexResidency) Evicts(req *Request, addr string, blocks int) Eviction {
	if r.Index == nil {
		return Eviction{}
	}
	ev := r.Index.Evictions(addr, blocks, req.Now.Add(-ReuseWindow))
	return Eviction{Blocks: ev.Blocks, Lost: ev.Sole}
}
