package kvevents

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/internal/idtable"
)

// MaxServers is how many servers one Index tracks; more are left to the
// estimating index.
const MaxServers = 256

const (
	shardBits = 6
	numShards = 1 << shardBits
	words     = MaxServers / 64
)

// holders is the set of server ids whose cache holds a block key.
type holders [words]uint64

func (h *holders) empty() bool {
	for _, w := range h {
		if w != 0 {
			return false
		}
	}
	return true
}

type shard struct {
	mu sync.RWMutex
	m  map[uint64]holders
	// pend holds the keys of requests routed to servers whose events
	// have not announced them yet (see Query.Routed), until they expire.
	pend    map[pendKey]int64
	sweepAt int
	_       [24]byte // keep neighbouring shards' locks on separate cache lines
}

// pendKey is a block key on its way to a server; the map holds until
// when (Unix nanoseconds).
type pendKey struct {
	key uint64
	id  uint16
}

// PendingFor is how long a request routed to a server counts as putting
// its prompt's blocks there before the server's events announce them:
// long enough for its queue wait and prefill, short enough that a failed
// request misleads little.
const PendingFor = 10 * time.Second

// Index is the exact residency of a pool's servers' KV caches, as their
// events tell it: which block keys (see AppendKeys) each server holds in
// its GPU cache, and per medium how many blocks. One subscriber per
// server feeds it (Apply, Clear); requests read it (Match, Query) without
// waiting for writers of other keys. All methods are safe for concurrent
// use.
type Index struct {
	table  idtable.Table[Server]
	shards [numShards]shard
}

// NewIndex returns an empty Index.
func NewIndex() *Index {
	x := &Index{}
	for i := range x.shards {
		x.shards[i].m = map[uint64]holders{}
		x.shards[i].pend = map[pendKey]int64{}
	}
	x.table.Init(MaxServers)
	return x
}

func (x *Index) shardOf(k uint64) *shard { return &x.shards[k>>(64-shardBits)] }

// setHolder records that server id holds k's block: it is no longer on
// its way there.
func (x *Index) setHolder(k uint64, id uint16) {
	s := x.shardOf(k)
	s.mu.Lock()
	h := s.m[k]
	h[id/64] |= 1 << (id % 64)
	s.m[k] = h
	if len(s.pend) > 0 {
		delete(s.pend, pendKey{k, id})
	}
	s.mu.Unlock()
}

func (x *Index) clearHolder(k uint64, id uint16) {
	s := x.shardOf(k)
	s.mu.Lock()
	if h, ok := s.m[k]; ok {
		h[id/64] &^= 1 << (id % 64)
		if h.empty() {
			delete(s.m, k)
		} else {
			s.m[k] = h
		}
	}
	s.mu.Unlock()
}

func (x *Index) holdersOf(k uint64) (holders, bool) {
	s := x.shardOf(k)
	s.mu.RLock()
	h, ok := s.m[k]
	s.mu.RUnlock()
	return h, ok
}

// holdersAt is holdersOf, plus which of the servers in want k's block
// is pending on at now (Unix nanoseconds).
func (x *Index) holdersAt(k uint64, want *holders, now int64) (held, pend holders) {
	s := x.shardOf(k)
	s.mu.RLock()
	held = s.m[k]
	if len(s.pend) > 0 {
		for w := range want {
			for rest := want[w] &^ held[w]; rest != 0; rest &= rest - 1 {
				id := uint16(w*64 + bits.TrailingZeros64(rest))
				if s.pend[pendKey{k, id}] > now {
					pend[w] |= 1 << (id % 64)
				}
			}
		}
	}
	s.mu.RUnlock()
	return held, pend
}

// setPending marks keys' blocks as on their way to server id until
// until.
func (x *Index) setPending(keys []uint64, id uint16, until int64) {
	for _, k := range keys {
		s := x.shardOf(k)
		s.mu.Lock()
		s.pend[pendKey{k, id}] = until
		if len(s.pend) >= s.sweepAt {
			now := time.Now().UnixNano()
			for pk, u := range s.pend {
				if u <= now {
					delete(s.pend, pk)
				}
			}
			s.sweepAt = 2*len(s.pend) + 256
		}
		s.mu.Unlock()
	}
}

// clearPending forgets every pending block of server id.
func (x *Index) clearPending(id uint16) {
	for i := range x.shards {
		s := &x.shards[i]
		s.mu.Lock()
		for pk := range s.pend {
			if pk.id == id {
				delete(s.pend, pk)
			}
		}
		s.mu.Unlock()
	}
}

// Server returns the server called name, creating it if needed; nil when
// the Index already tracks MaxServers servers.
func (x *Index) Server(name string) *Server {
	return x.table.Add(name, func(id uint16, _ int) *Server { return newServer(x, name, id) })
}

// Lookup returns the server called name, or nil.
func (x *Index) Lookup(name string) *Server { return x.table.Get(name) }

// Remove forgets the server called name and everything it held.
func (x *Index) Remove(name string) {
	x.table.Remove(name, func(s *Server, _ int) {
		s.mu.Lock()
		s.clearLocked()
		s.removed = true
		s.mu.Unlock()
	})
}

// Servers returns the tracked servers' names, sorted.
func (x *Index) Servers() []string { return x.table.Names() }

// State says whether a server's view can be trusted.
type State int32

// Server states.
const (
	// Connecting: no events received yet; nothing is known.
	Connecting State = iota
	// Synced: every event since the view began was applied and the view
	// began with the engine's cache (its first event, a reset, or a full
	// replay): the view is exact.
	Synced
	// Partial: events flow, but the view began after the engine had
	// already cached blocks (started late, or events were lost beyond
	// replay); blocks cached before then are unknown.
	Partial
	// Disconnected: the event stream is down; the engine may have
	// changed (restarted) meanwhile.
	Disconnected
)

func (s State) String() string {
	switch s {
	case Connecting:
		return "connecting"
	case Synced:
		return "synced"
	case Partial:
		return "partial"
	case Disconnected:
		return "disconnected"
	}
	return "unknown"
}

// Server is one engine's view in an Index. Its subscriber is its only
// writer.
type Server struct {
	x    *Index
	name string
	id   uint16

	state atomic.Int32
	// blockSize is the engine's KV block size in tokens (0 until its first
	// full-block BlockStored).
	blockSize atomic.Int32

	// Predictions checked against what the server reported (Observe,
	// ObserveBound).
	agreed, over, under, bounded atomic.Int64

	mu      sync.Mutex
	removed bool
	// gpu maps the engine's hash of each block in its own cache to the
	// router's key for it.
	gpu map[uint64]blockRec
	// keyRefs counts, per key, the matchable GPU blocks holding it (vLLM
	// may hold copies of one block); the key's holder bit is set while it
	// is positive.
	keyRefs map[uint64]int32
	// other counts the blocks of other media (CPU offload, storage), per
	// medium and engine hash; they are tracked, not matched.
	other map[string]map[uint64]int32
	stats ServerStats
}

// blockRec is one engine block in the GPU cache.
type blockRec struct {
	key    uint64
	copies int32
	// matchable: the key is the block's real key (its parent chain was
	// known and it is a full block of the main KV group).
	matchable bool
}

// ServerStats counts what a server's events did to its view.
type ServerStats struct {
	// Blocks is the GPU blocks held (distinct engine hashes); Matchable
	// how many of them have a known key; Keys the distinct keys.
	Blocks, Matchable, Keys int
	// Media counts blocks of other media by medium.
	Media map[string]int
	// Stored, Removed and Cleared count applied events; Batches applied
	// batches.
	Stored, Removed, Cleared, Batches int64
	// Orphans counts stored blocks whose parent was unknown (events were
	// missed before the view began); UnknownRemoved removals of blocks the
	// view never saw stored.
	Orphans, UnknownRemoved int64
	// LastEvent is when the latest batch was applied.
	LastEvent time.Time
	// Agreed, Over and Under count the exact predictions checked against
	// the cached tokens the server then reported (Index.Observe): equal,
	// more than it had, less. Bounded counts lower bounds it met
	// (ObserveBound; a bound it did not meet counts in Over).
	Agreed, Over, Under, Bounded int64
}

func newServer(x *Index, name string, id uint16) *Server {
	return &Server{x: x, name: name, id: id, gpu: map[uint64]blockRec{}, keyRefs: map[uint64]int32{}, other: map[string]map[uint64]int32{}}
}

// Name is the server's name in its Index.
func (s *Server) Name() string { return s.name }

// State returns the server's state.
func (s *Server) State() State { return State(s.state.Load()) }

// SetState sets the server's state.
func (s *Server) SetState(st State) { s.state.Store(int32(st)) }

// BlockSize is the engine's KV block size in tokens, 0 while unknown.
func (s *Server) BlockSize() int { return int(s.blockSize.Load()) }

// Stats returns the server's counters.
func (s *Server) Stats() ServerStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.Blocks, st.Keys = len(s.gpu), len(s.keyRefs)
	st.Agreed, st.Over, st.Under, st.Bounded = s.agreed.Load(), s.over.Load(), s.under.Load(), s.bounded.Load()
	st.Media = map[string]int{}
	for m, blocks := range s.other {
		if len(blocks) > 0 {
			st.Media[m] = len(blocks)
		}
	}
	return st
}

// Clear drops everything the server holds (an engine reset or restart).
func (s *Server) Clear() {
	s.mu.Lock()
	s.clearLocked()
	s.mu.Unlock()
}

func (s *Server) clearLocked() {
	if s.removed {
		return
	}
	for k := range s.keyRefs {
		s.x.clearHolder(k, s.id)
	}
	s.x.clearPending(s.id)
	clear(s.keyRefs)
	clear(s.gpu)
	clear(s.other)
	s.stats.Matchable = 0
}

// Apply applies one batch of the server's events, in order.
func (s *Server) Apply(b *Batch, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.removed {
		return
	}
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Kind {
		case BlockStored:
			s.stats.Stored++
			s.stored(e)
		case BlockRemoved:
			s.stats.Removed++
			s.removedEv(e)
		case AllBlocksCleared:
			s.stats.Cleared++
			s.clearLocked()
		}
	}
	s.stats.Batches++
	s.stats.LastEvent = now
}

// stored applies a BlockStored. s.mu is held.
func (s *Server) stored(e *Event) {
	if !e.IsGPU() {
		m := s.other[e.Medium]
		if m == nil {
			m = map[uint64]int32{}
			s.other[e.Medium] = m
		}
		for _, h := range e.Hashes {
			m[h]++
		}
		return
	}
	nb, bs := len(e.Hashes), e.BlockSize
	if nb == 0 {
		return
	}
	cur := int(s.blockSize.Load())
	if bs > cur {
		s.blockSize.Store(int32(bs))
		cur = bs
	}
	// Keys are known when the run starts a prompt or its parent is a
	// known block, and its tokens are whole blocks of the engine's size
	// (a smaller block_size is a partial-block entry, which full-block
	// lookups never use) in the main KV group. vLLM leaves skipped blocks
	// (null or masked ones) out of block_hashes but not out of token_ids,
	// always at the run's start, so hashes align with the run's last
	// blocks.
	parent, known := rootKey, true
	if e.HasParent {
		rec, ok := s.gpu[e.Parent]
		parent, known = rec.key, ok && rec.matchable
		if !ok {
			s.stats.Orphans += int64(nb)
		}
	}
	total := 0
	if bs > 0 {
		total = len(e.Tokens) / bs
	}
	known = known && bs == cur && e.Group == 0 && len(e.Tokens)%bs == 0 && total >= nb
	skip := total - nb
	legacy := uint64(0)
	if len(e.Extra) == 0 {
		legacy = legacyExtra(e)
	}
	for i := 0; i < total && known && i < skip; i++ {
		parent = blockKey(parent, legacy, e.Tokens[i*bs:(i+1)*bs])
	}
	for j, h := range e.Hashes {
		var key uint64
		if known {
			x := legacy
			if len(e.Extra) > 0 {
				x = e.Extra[j]
			}
			i := skip + j
			key = blockKey(parent, x, e.Tokens[i*bs:(i+1)*bs])
			parent = key
		}
		rec, ok := s.gpu[h]
		if ok {
			// Another copy of a cached block (vLLM does not deduplicate
			// blocks computed at once by two requests).
			rec.copies++
			if !rec.matchable && known {
				rec.key, rec.matchable = key, true
				s.stats.Matchable++
				if s.keyRefs[key]++; s.keyRefs[key] == 1 {
					s.x.setHolder(key, s.id)
				}
			}
			s.gpu[h] = rec
			continue
		}
		s.gpu[h] = blockRec{key: key, copies: 1, matchable: known}
		if known {
			s.stats.Matchable++
			if s.keyRefs[key]++; s.keyRefs[key] == 1 {
				s.x.setHolder(key, s.id)
			}
		}
	}
}

// removedEv applies a BlockRemoved. s.mu is held.
func (s *Server) removedEv(e *Event) {
	if !e.IsGPU() {
		m := s.other[e.Medium]
		for _, h := range e.Hashes {
			if m[h] > 1 {
				m[h]--
			} else if _, ok := m[h]; ok {
				delete(m, h)
			} else {
				s.stats.UnknownRemoved++
			}
		}
		return
	}
	for _, h := range e.Hashes {
		rec, ok := s.gpu[h]
		if !ok {
			s.stats.UnknownRemoved++
			continue
		}
		if rec.copies > 1 {
			rec.copies--
			s.gpu[h] = rec
			continue
		}
		delete(s.gpu, h)
		if rec.matchable {
			s.stats.Matchable--
			if s.keyRefs[rec.key]--; s.keyRefs[rec.key] <= 0 {
				delete(s.keyRefs, rec.key)
				s.x.clearHolder(rec.key, s.id)
			}
		}
	}
}

// Observe checks an exact prediction against what the server then
// reported: predicted is the cached tokens a Query said addr held
// (Scratch.CachedTokens of the chosen server), actual the response's
// usage.prompt_tokens_details.cached_tokens. The counts (ServerStats
// Agreed, Over, Under) show how exact the view is in production; a race
// between a prediction and an eviction in flight is the usual miss.
func (x *Index) Observe(addr string, predicted, actual int) {
	s := x.Lookup(addr)
	switch {
	case s == nil:
	case predicted == actual:
		s.agreed.Add(1)
	case predicted > actual:
		s.over.Add(1)
	default:
		s.under.Add(1)
	}
}

// ObserveBound checks a lower bound (Query.Bounded) against what the
// server then reported: met when it reported at least that much, over
// otherwise.
func (x *Index) ObserveBound(addr string, predicted, actual int) {
	s := x.Lookup(addr)
	switch {
	case s == nil:
	case actual >= predicted:
		s.bounded.Add(1)
	default:
		s.over.Add(1)
	}
}

// Holds reports whether the server's GPU cache holds a block with key k.
func (s *Server) Holds(k uint64) bool {
	h, ok := s.x.holdersOf(k)
	return ok && h[s.id/64]&(1<<(s.id%64)) != 0
}

// matchInto sets out[i] to how many leading keys servers[i] holds (its
// longest cached prefix, in blocks), counting blocks pending on it at now
// (Unix nanoseconds; see Query.Routed); nil servers get 0. It walks the
// chain once, intersecting the set of servers still matching with each
// key's holders. It returns the servers whose count includes pending
// blocks.
func (x *Index) matchInto(keys []uint64, servers []*Server, out []int, now int64) (tentative holders) {
	clear(out[:len(servers)])
	if len(keys) == 0 {
		return
	}
	var want holders
	for _, s := range servers {
		if s != nil {
			want[s.id/64] |= 1 << (s.id % 64)
		}
	}
	active := want
	n := 0
	for ; n < len(keys); n++ {
		h, p := x.holdersAt(keys[n], &active, now)
		next, alive := holders{}, false
		for w := range active {
			next[w] = active[w] & (h[w] | p[w])
			tentative[w] |= next[w] & p[w] &^ h[w]
			alive = alive || next[w] != 0
			// Servers that drop out here matched n blocks.
			for gone := active[w] &^ next[w]; gone != 0; gone &= gone - 1 {
				setMatched(servers, out, uint16(w*64+bits.TrailingZeros64(gone)), n)
			}
		}
		active = next
		if !alive {
			return tentative
		}
	}
	for w := range active {
		for rest := active[w]; rest != 0; rest &= rest - 1 {
			setMatched(servers, out, uint16(w*64+bits.TrailingZeros64(rest)), n)
		}
	}
	return tentative
}

func setMatched(servers []*Server, out []int, id uint16, n int) {
	for i, s := range servers {
		if s != nil && s.id == id {
			out[i] = n
		}
	}
}
