package kvevents

import (
	"slices"
	"sync"
	"time"
)

// MaxQueryBlocks caps the blocks of a prompt that are keyed and matched
// (the first 256k tokens with 32-token blocks); longer prompts are
// matched on that prefix.
const MaxQueryBlocks = 8192

// Query is one request's prompt as its engines see it: the token ids the
// engine will compute, keyed by block. It answers, for any servers of its
// Index, how many of the prompt's tokens each holds in its KV cache: what
// vLLM will report as usage.prompt_tokens_details.cached_tokens if the
// request goes there now. Build one with Index.NewQuery per request and
// Release it when the request is routed; a Query is not safe for
// concurrent use.
type Query struct {
	x      *Index
	tokens []uint32 // read only: may be shared with the tokenizer's cache
	extra  func(int) uint64
	// prefix: tokens are a stable prefix of the prompt, whose length is
	// estimated at total tokens.
	prefix bool
	total  int
	// keys are the prompt's block keys for blockSize (computed on first
	// use; servers of one pool share a block size).
	blockSize int
	keys      []uint64
	servers   []*Server
	group     []*Server
	sizes     []int
	matched   []int
	// tentative: servers whose last count included blocks pending there
	// (Routed), not announced yet.
	tentative holders
}

var queryPool = sync.Pool{New: func() any { return new(Query) }}

// NewQuery returns a Query for a prompt of tokens (which it reads but
// never changes, and keeps until Release), sent to adapter (the LoRA
// adapter's name; "" for the base model) with cache salt salt ("" none).
func (x *Index) NewQuery(tokens []uint32, adapter, salt string) *Query {
	q := queryPool.Get().(*Query)
	q.x, q.tokens, q.extra = x, tokens, RequestExtra(adapter, salt)
	q.prefix, q.total = false, 0
	q.blockSize, q.keys = 0, q.keys[:0]
	q.tentative = holders{}
	return q
}

// Release returns q to the pool; q must not be used afterwards.
func (q *Query) Release() {
	q.x, q.tokens, q.extra = nil, nil, nil
	clear(q.servers)
	q.servers = q.servers[:0]
	queryPool.Put(q)
}

// Tokens is the prompt's length in tokens (estimated when only a
// prefix of its tokens is known).
func (q *Query) Tokens() int {
	if q.prefix {
		return q.total
	}
	return len(q.tokens)
}

// Known is how many of the prompt's tokens the Query knows: all of them,
// or a stable prefix's (Prefix).
func (q *Query) Known() int { return len(q.tokens) }

// Prefix reports whether the Query knows only a stable prefix of the
// prompt's tokens.
func (q *Query) Prefix() bool { return q.prefix }

// Routed records that the request goes to server addr: until that
// server's events announce the blocks of its prompt (or of its known
// prefix) that it does not hold yet, for at most PendingFor, the Index
// counts them as on their way there, so that requests sharing the prompt
// follow it instead of scattering while it is computed.
func (q *Query) Routed(addr string) {
	s := q.x.table.Get(addr)
	if s == nil {
		return
	}
	bs := s.BlockSize()
	if bs <= 0 {
		return
	}
	keys := q.keysFor(bs)
	held := 0
	for held < len(keys) && s.Holds(keys[held]) {
		held++
	}
	if held < len(keys) {
		q.x.setPending(keys[held:], s.id, time.Now().Add(PendingFor).UnixNano())
	}
}

// Tentative reports whether the last CachedTokens count for addr
// includes blocks pending there (Routed), not announced by its events
// yet: a routing hint, neither exact nor a bound.
func (q *Query) Tentative(addr string) bool {
	s := q.x.table.Get(addr)
	return s != nil && q.tentative[s.id/64]&(1<<(s.id%64)) != 0
}

// Bounded reports whether a count CachedTokens gave is only a lower
// bound of what the server will report: the Query knows a prefix of the
// prompt and the server holds all of that prefix's full blocks (it may
// hold more of the prompt). Other counts are exact: the whole prompt's,
// or a prefix's that the server holds only part of.
func (q *Query) Bounded(tokens int) bool {
	if !q.prefix {
		return false
	}
	if q.blockSize <= 0 {
		return true
	}
	return tokens >= len(q.tokens)/q.blockSize*q.blockSize
}

// keysFor returns the prompt's keys for blocks of bs tokens.
func (q *Query) keysFor(bs int) []uint64 {
	if q.blockSize != bs {
		q.blockSize = bs
		q.keys = AppendKeys(q.keys[:0], q.tokens, bs, MaxQueryBlocks, q.extra)
	}
	return q.keys
}

// CachedTokens sets, for each server address addrs[i], tokens[i] to the
// number of the prompt's tokens that server holds in its KV cache and
// exact[i] to whether that is known from the server's events: they are
// synced (see State). Where exact[i] is false, tokens[i] is 0 and the
// caller should fall back to its estimate. Like vLLM, the count is whole
// blocks and leaves the prompt's last token to be computed. For a Query
// that knows only a prefix of the prompt, a server holding the whole
// prefix holds at least its full blocks (Bounded). tokens and exact must
// be at least as long as addrs.
func (q *Query) CachedTokens(addrs []string, tokens []int, exact []bool) {
	t := q.x.table.Load()
	q.servers = q.servers[:0]
	for i, a := range addrs {
		tokens[i], exact[i] = 0, false
		s := t.ByName[a]
		if s == nil || s.State() != Synced {
			q.servers = append(q.servers, nil)
			continue
		}
		exact[i] = true
		q.servers = append(q.servers, s)
	}
	// Block sizes are read once: a subscriber may learn one meanwhile.
	q.sizes = q.sizes[:0]
	for _, s := range q.servers {
		bs := 0
		if s != nil {
			bs = s.BlockSize()
		}
		q.sizes = append(q.sizes, bs)
	}
	// Servers are matched in groups of one block size (normally one
	// group: a pool's servers run one configuration).
	if cap(q.group) < len(q.servers) {
		q.group = make([]*Server, len(q.servers))
		q.matched = make([]int, len(q.servers))
	}
	group, m := q.group[:len(q.servers)], q.matched[:len(q.servers)]
	defer clear(group)
	now := time.Now().UnixNano()
	q.tentative = holders{}
	for i, bs := range q.sizes {
		if bs <= 0 || slices.Contains(q.sizes[:i], bs) {
			continue // unknown, nothing stored yet (nothing cached), or done
		}
		for j, o := range q.servers {
			group[j] = nil
			if q.sizes[j] == bs {
				group[j] = o
			}
		}
		tent := q.x.matchInto(q.keysFor(bs), group, m, now)
		for w := range tent {
			q.tentative[w] |= tent[w]
		}
		// Like vLLM, the prompt's last token is computed: a prefix's
		// last full block may be cached in full.
		limit := max(len(q.tokens)-1, 0) / bs
		if q.prefix {
			limit = len(q.tokens) / bs
		}
		for j, o := range group {
			if o != nil {
				tokens[j] = min(m[j], limit) * bs
			}
		}
	}
}
