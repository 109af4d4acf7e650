package prefix

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/switchyard/switchyard/internal/idtable"
)

// Defaults for Config fields left zero.
const (
	// DefaultCapacity is an endpoint's LRU size in blocks when its KV block
	// count is unknown (a 16-token block Llama-3-8B on one H100 has ~28k).
	DefaultCapacity = 16384
	// DefaultMaxCapacity clamps any endpoint's LRU size.
	DefaultMaxCapacity = 1 << 18
	// DefaultMaxEntries bounds an Index's LRU entries over all its
	// endpoints (about 80 bytes each: ~330 MB when full): a pool of 150
	// servers with 28k-block caches fits whole; beyond that each endpoint
	// keeps its share, its most recent blocks.
	DefaultMaxEntries = 1 << 22
	// MaxEndpoints is how many endpoints one Index tracks at once.
	MaxEndpoints = 1 << 16
)

const (
	shardBits = 6
	numShards = 1 << shardBits
)

// Config sizes an Index.
type Config struct {
	// DefaultCapacity is the per-endpoint LRU size (blocks) until
	// SetCapacity is called for it; 0 means DefaultCapacity.
	DefaultCapacity int
	// MaxCapacity clamps every endpoint's capacity; 0 means
	// DefaultMaxCapacity.
	MaxCapacity int
	// MaxEntries bounds the LRU entries of all endpoints together: each
	// endpoint's capacity is at most MaxEntries divided by the number of
	// endpoints; 0 means DefaultMaxEntries.
	MaxEntries int
}

// Hit says an endpoint likely holds the first Blocks blocks of a prompt.
type Hit struct {
	Endpoint string
	Blocks   int
}

// Index is an approximate prefix-cache model for a set of endpoints that
// share one Hasher configuration (normally one pool). All methods are safe
// for concurrent use. Match takes only read locks on hash shards; Add locks
// one endpoint (or, when that lock is busy, leaves its chain to the
// holder) and the shards of the hashes it inserts or evicts;
// ExportEndpoint locks one endpoint for a memmove of its slot array.
type Index struct {
	cfg    Config
	shards [numShards]shard

	// table's writers (endpoint creation and removal) are serialised:
	// they rebalance the endpoints' shares.
	table idtable.Table[endpoint]
	// clock numbers changes to endpoints' LRUs (endpoint.version).
	clock atomic.Uint64
	// epoch is the origin of the reuse stamps (endpoint.reused).
	epoch time.Time
	// share is every endpoint's capacity bound (MaxEntries over the
	// endpoints), as last applied to them; written by the table's writers.
	share atomic.Int64

	scratch sync.Pool // *matchScratch
}

type shard struct {
	mu sync.RWMutex
	// m maps a block hash to the bitset of endpoint ids 0..255 holding it;
	// over holds the bits of ids >= 256 (words 4 and up), only for indexes
	// that ever had that many endpoints. Both are pointer-free or small,
	// so the garbage collector does not scan the big map.
	m    table[holders]
	over map[uint64][]uint64
	_    [32]byte // keep neighbouring shards' locks on separate cache lines
}

const holderWords = 4

// holders is the set of endpoint ids below 256 whose LRU holds a block.
type holders [holderWords]uint64

func (h *holders) empty() bool { return h[0]|h[1]|h[2]|h[3] == 0 }

// endpoint is one endpoint's LRU of block hashes: a map from hash to slot
// and an intrusive doubly linked list over a slot array (head = most
// recently used).
type endpoint struct {
	name string
	id   uint16

	mu         sync.Mutex
	removed    bool
	asked      int          // the capacity asked for (SetCapacity, or the default)
	capacity   int          // asked, within the Index's share
	slots      table[int32] // hash -> node index
	nodes      []lruNode
	head, tail int32
	// reused[s] stamps when a pick last found node s's block already
	// held (Index.stamp; 0: never since it was added), by node index.
	reused []uint32
	// version is the Index clock at the LRU's last change (entries,
	// order or capacity); written under mu, read without it.
	version atomic.Uint64

	// Picks deferred because mu was busy: Add never waits for mu (held
	// by an export's copy, a metrics read, another pick); it leaves its
	// chain here and the holder applies it before releasing mu (unlock).
	pendMu   sync.Mutex
	pending  []uint64 // the chains, concatenated
	pendLens []int
	npend    atomic.Int32 // len(pendLens), readable without pendMu
	// The previous pending buffers, reused by the next deferral; only
	// the holder of mu touches them.
	sparePending []uint64
	spareLens    []int
}

type lruNode struct {
	hash       uint64
	prev, next int32
}

// NewIndex returns an empty Index.
func NewIndex(cfg Config) *Index {
	if cfg.MaxCapacity <= 0 {
		cfg.MaxCapacity = DefaultMaxCapacity
	}
	if cfg.DefaultCapacity <= 0 {
		cfg.DefaultCapacity = DefaultCapacity
	}
	cfg.DefaultCapacity = min(cfg.DefaultCapacity, cfg.MaxCapacity)
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	x := &Index{cfg: cfg, epoch: time.Now()}
	x.share.Store(int64(cfg.MaxEntries))
	for i := range x.shards {
		x.shards[i].m = newTable[holders](0)
	}
	x.table.Init(MaxEndpoints)
	x.scratch.New = func() any { return &matchScratch{} }
	return x
}

func (x *Index) shardOf(h uint64) *shard { return &x.shards[h>>(64-shardBits)] }

func (x *Index) addHolder(h uint64, id uint16) {
	s := x.shardOf(h)
	w, bit := int(id/64), uint64(1)<<(id%64)
	s.mu.Lock()
	if w < holderWords {
		if v, ok := s.m.get(h); ok {
			v[w] |= bit
		} else {
			var v holders
			v[w] = bit
			s.m.put(h, v)
		}
	} else {
		if s.over == nil {
			s.over = map[uint64][]uint64{}
		}
		o := s.over[h]
		for len(o) <= w-holderWords {
			o = append(o, 0)
		}
		o[w-holderWords] |= bit
		s.over[h] = o
		if _, ok := s.m.get(h); !ok {
			s.m.put(h, holders{}) // presence marker: the hash is held
		}
	}
	s.mu.Unlock()
}

func (x *Index) dropHolder(h uint64, id uint16) {
	s := x.shardOf(h)
	w, bit := int(id/64), uint64(1)<<(id%64)
	s.mu.Lock()
	v, ok := s.m.get(h)
	if ok {
		if w < holderWords {
			v[w] &^= bit
		} else if o := s.over[h]; w-holderWords < len(o) {
			o[w-holderWords] &^= bit
		}
		if v.empty() && overEmpty(s.over[h]) {
			s.m.del(h)
			delete(s.over, h)
		}
	}
	s.mu.Unlock()
}

func overEmpty(o []uint64) bool {
	for _, w := range o {
		if w != 0 {
			return false
		}
	}
	return true
}

// lookup returns the live endpoint called name, creating it if create is
// set; nil if absent (or the Index is full).
func (x *Index) lookup(name string, create bool) *endpoint {
	if ep := x.table.Get(name); ep != nil || !create {
		return ep
	}
	return x.table.Add(name, func(id uint16, n int) *endpoint {
		ep := &endpoint{name: name, id: id, asked: x.cfg.DefaultCapacity, slots: newTable[int32](min(x.cfg.DefaultCapacity, 1024)), head: -1, tail: -1}
		x.rebalance(n)
		ep.capacity = min(ep.asked, int(x.share.Load()))
		return ep
	})
}

// rebalance sets the share of each of n endpoints in MaxEntries and, when
// it moved by more than an eighth since last applied, resizes every
// endpoint to it (shrinking LRUs evict their least recent entries). Only
// the table's writers call it, one at a time.
func (x *Index) rebalance(n int) {
	share := max(x.cfg.MaxEntries/max(n, 1), 1)
	old := int(x.share.Load())
	if d := share - old; d < old/8 && -d < old/8 {
		// Small moves wait for a larger one (adding endpoints one by one
		// does not resize every LRU each time); the bound is then
		// exceeded by at most an eighth.
		return
	}
	x.share.Store(int64(share))
	for _, ep := range x.table.Load().ByID {
		if ep == nil {
			continue
		}
		ep.mu.Lock()
		if !ep.removed {
			x.resize(ep, min(ep.asked, share))
		}
		x.unlock(ep)
	}
}

// resize sets ep's capacity to blocks, evicting its least recent entries
// beyond it. ep.mu must be held.
func (x *Index) resize(ep *endpoint, blocks int) {
	if ep.capacity == blocks {
		return
	}
	shrunk := blocks < len(ep.nodes)
	ep.capacity = blocks
	for ep.slots.n > blocks {
		s := ep.tail
		h := ep.nodes[s].hash
		ep.unlink(s)
		ep.slots.del(h)
		x.dropHolder(h, ep.id)
	}
	if shrunk {
		ep.compact()
	}
	x.changed(ep)
}

// locked returns the live endpoint called name, created if needed (nil if
// the Index is full), and whether its lock is now held: always when wait
// is set, otherwise only if it was free. An endpoint that Remove retires
// between the lookup and the lock is skipped for the fresh one. Release
// the lock with unlock.
func (x *Index) locked(name string, wait bool) (*endpoint, bool) {
	for {
		ep := x.lookup(name, true)
		if ep == nil {
			return nil, false
		}
		if wait {
			ep.mu.Lock()
		} else if !ep.mu.TryLock() {
			return ep, false
		}
		if !ep.removed {
			return ep, true
		}
		x.unlock(ep)
	}
}

// changed stamps ep's LRU as changed. ep.mu must be held.
func (x *Index) changed(ep *endpoint) { ep.version.Store(x.clock.Add(1)) }

// unlock applies the chains Add deferred while ep.mu was held, then
// releases it. A chain deferred after the last look is not stranded: its
// Add retries the lock after publishing it (npend), and unlock retakes the
// lock when it sees one after releasing.
func (x *Index) unlock(ep *endpoint) {
	for {
		if ep.npend.Load() > 0 {
			ep.pendMu.Lock()
			pending, lens := ep.pending, ep.pendLens
			ep.pending, ep.pendLens = ep.sparePending[:0], ep.spareLens[:0]
			ep.npend.Store(0)
			ep.pendMu.Unlock()
			if !ep.removed { // a removed endpoint's picks are dropped with it
				rest := pending
				for _, n := range lens {
					x.record(ep, rest[:n])
					rest = rest[n:]
				}
			}
			ep.sparePending, ep.spareLens = pending[:0], lens[:0]
		}
		ep.mu.Unlock()
		if ep.npend.Load() == 0 || !ep.mu.TryLock() {
			return
		}
	}
}

// Add records that the blocks hashes (a prompt's chain, root first) were
// just routed to endpoint, making them its most recently used entries, the
// root most recent of all so that prompt tails are evicted first, as a
// server's cache does. New endpoints get the default capacity. Add never
// waits for the endpoint's lock: when another goroutine holds it (an
// export's copy, a metrics read, another pick), the chain is copied aside
// and the holder records it before releasing the lock.
func (x *Index) Add(endpoint string, hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	ep, held := x.locked(endpoint, false)
	switch {
	case ep == nil:
		return // index full
	case held:
		x.record(ep, hashes)
		x.unlock(ep)
	default:
		ep.pendMu.Lock()
		ep.pending = append(ep.pending, hashes...)
		ep.pendLens = append(ep.pendLens, len(hashes))
		ep.npend.Add(1)
		ep.pendMu.Unlock()
		if ep.mu.TryLock() { // released meanwhile: record it ourselves
			x.unlock(ep)
		}
	}
}

// record touches a chain's hashes, tail first. ep.mu must be held.
func (x *Index) record(ep *endpoint, hashes []uint64) {
	now := x.stamp(time.Now())
	for i := len(hashes) - 1; i >= 0; i-- {
		x.touch(ep, hashes[i], now)
	}
	x.changed(ep)
}

// stamp is t as a reuse stamp: milliseconds since the Index's epoch, plus
// one (0 means never). It wraps after 49 days; ages are taken modulo that.
func (x *Index) stamp(t time.Time) uint32 {
	return uint32(t.Sub(x.epoch).Milliseconds()) + 1
}

// touch makes h ep's most recent entry, evicting its least recent one if
// full; a block already held is stamped reused at now. ep.mu must be held.
func (x *Index) touch(ep *endpoint, h uint64, now uint32) {
	if s, ok := ep.slots.get(h); ok {
		ep.moveToFront(*s)
		ep.reused[*s] = now
		return
	}
	var s int32
	if ep.slots.n >= ep.capacity {
		s = ep.tail
		old := ep.nodes[s].hash
		ep.unlink(s)
		ep.slots.del(old)
		x.dropHolder(old, ep.id)
	} else {
		s = int32(len(ep.nodes))
		ep.nodes = append(ep.nodes, lruNode{})
		ep.reused = append(ep.reused, 0)
	}
	ep.nodes[s].hash = h
	ep.reused[s] = 0
	ep.slots.put(h, s)
	ep.pushFront(s)
	x.addHolder(h, ep.id)
}

func (ep *endpoint) unlink(s int32) {
	n := &ep.nodes[s]
	if n.prev >= 0 {
		ep.nodes[n.prev].next = n.next
	} else {
		ep.head = n.next
	}
	if n.next >= 0 {
		ep.nodes[n.next].prev = n.prev
	} else {
		ep.tail = n.prev
	}
	n.prev, n.next = -1, -1
}

func (ep *endpoint) pushFront(s int32) {
	n := &ep.nodes[s]
	n.prev = -1
	n.next = ep.head
	if ep.head >= 0 {
		ep.nodes[ep.head].prev = s
	}
	ep.head = s
	if ep.tail < 0 {
		ep.tail = s
	}
}

func (ep *endpoint) moveToFront(s int32) {
	if ep.head == s {
		return
	}
	ep.unlink(s)
	ep.pushFront(s)
}

// compact rebuilds ep's slot array in LRU order so it holds exactly its
// entries (after shrinking). ep.mu must be held.
func (ep *endpoint) compact() {
	hashes := make([]uint64, 0, ep.slots.n)
	stamps := make([]uint32, 0, ep.slots.n)
	for s := ep.head; s >= 0; s = ep.nodes[s].next {
		hashes = append(hashes, ep.nodes[s].hash)
		stamps = append(stamps, ep.reused[s])
	}
	ep.nodes = make([]lruNode, len(hashes))
	ep.reused = stamps
	ep.slots = newTable[int32](len(hashes))
	ep.head, ep.tail = -1, -1
	for i := len(hashes) - 1; i >= 0; i-- {
		s := int32(i)
		ep.nodes[s].hash = hashes[i]
		ep.slots.put(hashes[i], s)
		ep.pushFront(s)
	}
}

// SetCapacity sizes endpoint's LRU to blocks (clamped to MaxCapacity and
// to the endpoint's share of MaxEntries; <= 0 means the default), creating
// the endpoint if needed and evicting its least recent entries if it
// shrinks. Callers pass the server's KV block
// count (vLLM num_gpu_blocks) once known.
func (x *Index) SetCapacity(endpoint string, blocks int) {
	if blocks <= 0 {
		blocks = x.cfg.DefaultCapacity
	}
	blocks = min(blocks, x.cfg.MaxCapacity)
	ep, _ := x.locked(endpoint, true)
	if ep == nil {
		return
	}
	ep.asked = blocks
	x.resize(ep, min(blocks, int(x.share.Load())))
	x.unlock(ep)
}

// Remove forgets the endpoint called name and everything routed to it. It is a no-op for
// an unknown endpoint.
func (x *Index) Remove(name string) {
	x.table.Remove(name, func(ep *endpoint, n int) {
		ep.mu.Lock()
		for s := ep.head; s >= 0; s = ep.nodes[s].next {
			x.dropHolder(ep.nodes[s].hash, ep.id)
		}
		ep.removed = true
		ep.slots, ep.nodes, ep.reused = table[int32]{}, nil, nil
		ep.head, ep.tail = -1, -1
		x.unlock(ep) // drops picks deferred meanwhile
		// The others' shares grow; rebalance skips ep, removed.
		x.rebalance(n)
	})
}

// Endpoints returns the tracked endpoint names, sorted.
func (x *Index) Endpoints() []string { return x.table.Names() }

// Eviction is what taking new blocks would push out of an endpoint's
// LRU (see Index.Evictions).
type Eviction struct {
	// Blocks is how many of its entries would be evicted: 0 while it has
	// room.
	Blocks int
	// Sole is how many of those the Index holds nowhere else and a pick
	// found already held (reused) recently: blocks of a prefix in use
	// whose only cached copy the eviction would destroy.
	Sole int
}

// maxEvictionChecks bounds the evicted entries Evictions checks for
// other holders; beyond it they are sampled evenly and the count scaled.
const maxEvictionChecks = 64

// Evictions reports what adding n new blocks to endpoint's LRU would
// evict: the least recent entries beyond its capacity, and how many of
// them no other endpoint holds and were reused after since. An endpoint
// the Index does not track evicts nothing. It locks the endpoint briefly
// (applying picks deferred meanwhile) and each checked block's shard.
func (x *Index) Evictions(endpoint string, n int, since time.Time) Eviction {
	ep := x.table.Get(endpoint)
	if ep == nil || n <= 0 {
		return Eviction{}
	}
	ep.mu.Lock()
	defer x.unlock(ep)
	if ep.removed {
		return Eviction{}
	}
	k := min(n-(ep.capacity-ep.slots.n), ep.slots.n)
	if k <= 0 {
		return Eviction{}
	}
	stride := (k + maxEvictionChecks - 1) / maxEvictionChecks
	after := x.stamp(since)
	checked, sole := 0, 0
	i := 0
	for s := ep.tail; s >= 0 && i < k; s, i = ep.nodes[s].prev, i+1 {
		if i%stride != 0 {
			continue
		}
		checked++
		if r := ep.reused[s]; r != 0 && int32(r-after) >= 0 && x.soleHolder(ep.nodes[s].hash, ep.id) {
			sole++
		}
	}
	if checked > 0 && checked < k {
		sole = (sole*k + checked/2) / checked
	}
	return Eviction{Blocks: k, Sole: sole}
}

// soleHolder reports whether id is the only endpoint holding h.
func (x *Index) soleHolder(h uint64, id uint16) bool {
	s := x.shardOf(h)
	s.mu.RLock()
	defer s.mu.RUnlock()
	v, ok := s.m.get(h)
	if !ok {
		return false
	}
	w, bit := int(id/64), uint64(1)<<(id%64)
	for i, word := range v {
		want := uint64(0)
		if i == w {
			want = bit
		}
		if word != want {
			return false
		}
	}
	for i, word := range s.over[h] {
		want := uint64(0)
		if i == w-holderWords {
			want = bit
		}
		if word != want {
			return false
		}
	}
	return true
}

type matchScratch struct {
	active []uint64 // bitset of endpoint ids still matching
	next   []uint64
	live   []int // the words of active that are not zero
	hits   []idHit
	byID   []int32 // MatchInto's per-id counts, all zero between uses
}

type idHit struct {
	id     uint16
	blocks int
}

// match computes, for each endpoint holding hashes[0], how many leading
// hashes it holds (stopping at its first miss), into sc.hits. It walks the
// chain once, intersecting the set of still-matching endpoints with each
// block's holders, a few word ANDs per block.
func (x *Index) match(hashes []uint64, sc *matchScratch) {
	sc.hits = sc.hits[:0]
	if len(hashes) == 0 {
		return
	}
	words := max(holderWords, (len(x.table.Load().ByID)+63)/64)
	if cap(sc.active) < words {
		sc.active = make([]uint64, words)
		sc.next = make([]uint64, words)
	}
	active, next := sc.active[:words], sc.next[:words]
	if !x.holdersInto(hashes[0], active) {
		return
	}
	// Only the words with an endpoint still matching are looked at from
	// here on: a prefix is usually held by a few endpoints of many.
	live := sc.live[:0]
	for w, a := range active {
		if a != 0 {
			live = append(live, w)
		}
	}
	defer func() { sc.live = live[:0] }()
	for i := 1; i < len(hashes); i++ {
		any := x.liveHoldersInto(hashes[i], live, next)
		kept := live[:0]
		for _, w := range live {
			n := next[w] & active[w]
			// Endpoints that dropped out matched exactly i blocks.
			for gone := active[w] &^ n; gone != 0; gone &= gone - 1 {
				sc.hits = append(sc.hits, idHit{id: uint16(w*64 + bits.TrailingZeros64(gone)), blocks: i})
			}
			active[w] = n
			if n != 0 {
				kept = append(kept, w)
			}
		}
		live = kept
		if !any || len(live) == 0 {
			return
		}
	}
	for _, w := range live {
		for rest := active[w]; rest != 0; rest &= rest - 1 {
			sc.hits = append(sc.hits, idHit{id: uint16(w*64 + bits.TrailingZeros64(rest)), blocks: len(hashes)})
		}
	}
}

// liveHoldersInto sets dst[w], for each word w of live, to that word of
// h's holder bitset, and reports whether any endpoint holds h. The
// overflow words (ids of 256 and up) are looked up only when live has
// one.
func (x *Index) liveHoldersInto(h uint64, live []int, dst []uint64) bool {
	s := x.shardOf(h)
	s.mu.RLock()
	defer s.mu.RUnlock()
	p, ok := s.m.get(h)
	var o []uint64
	if len(live) > 0 && live[len(live)-1] >= holderWords {
		o = s.over[h]
		ok = ok || o != nil
	}
	for _, w := range live {
		switch {
		case w < holderWords && p != nil:
			dst[w] = p[w]
		case w >= holderWords && w-holderWords < len(o):
			dst[w] = o[w-holderWords]
		default:
			dst[w] = 0
		}
	}
	return ok
}

// holdersInto overwrites dst with the holder bitset of h and reports
// whether any endpoint holds it.
func (x *Index) holdersInto(h uint64, dst []uint64) bool {
	s := x.shardOf(h)
	s.mu.RLock()
	var v holders
	p, ok := s.m.get(h)
	if ok {
		v = *p
	}
	copy(dst, v[:])
	if len(dst) > holderWords {
		rest := dst[holderWords:]
		o := s.over[h]
		n := copy(rest, o)
		clear(rest[n:])
	}
	s.mu.RUnlock()
	return ok
}

// Match appends to dst, for every endpoint holding at least the first
// block, the number of leading blocks of hashes it likely holds (the
// longest matched prefix: counting stops at an endpoint's first miss), and
// returns the extended slice in no particular order. With a dst of enough
// capacity it does not allocate.
func (x *Index) Match(hashes []uint64, dst []Hit) []Hit {
	sc := x.scratch.Get().(*matchScratch)
	x.match(hashes, sc)
	t := x.table.Load()
	for _, h := range sc.hits {
		if int(h.id) < len(t.ByID) && t.ByID[h.id] != nil {
			dst = append(dst, Hit{Endpoint: t.ByID[h.id].name, Blocks: h.blocks})
		}
	}
	x.scratch.Put(sc)
	return dst
}

// fewHits is how many matching endpoints MatchInto finds among the
// candidates one by one.
const fewHits = 4

// MatchInto sets out[i] to the number of leading blocks of hashes that
// endpoints[i] likely holds (0 if none or unknown). out must be at least as
// long as endpoints. It does not allocate; scorers can use it directly.
func (x *Index) MatchInto(hashes []uint64, endpoints []string, out []int) {
	clear(out[:len(endpoints)])
	sc := x.scratch.Get().(*matchScratch)
	x.match(hashes, sc)
	switch t := x.table.Load(); {
	case len(sc.hits) > 0 && len(sc.hits) <= fewHits:
		// A prompt's prefix is usually held by one or a few endpoints:
		// find each among the candidates by name, rather than look up
		// every candidate (a thousand map lookups per decision).
		for _, h := range sc.hits {
			if int(h.id) >= len(t.ByID) || t.ByID[h.id] == nil {
				continue
			}
			name := t.ByID[h.id].name
			for i, n := range endpoints {
				if len(n) == len(name) && n == name {
					out[i] = h.blocks
				}
			}
		}
	case len(sc.hits) > 0:
		// Spread the hits by endpoint id, then read them back by name.
		if len(sc.byID) < len(t.ByID) {
			sc.byID = make([]int32, len(t.ByID))
		}
		for _, h := range sc.hits {
			if int(h.id) < len(sc.byID) {
				sc.byID[h.id] = int32(h.blocks)
			}
		}
		for i, name := range endpoints {
			if ep := t.ByName[name]; ep != nil && int(ep.id) < len(sc.byID) {
				out[i] = int(sc.byID[ep.id])
			}
		}
		for _, h := range sc.hits {
			if int(h.id) < len(sc.byID) {
				sc.byID[h.id] = 0
			}
		}
	}
	x.scratch.Put(sc)
}

// EndpointStats describes one endpoint's LRU.
type EndpointStats struct {
	Entries  int
	Capacity int
}

// Stats reports an Index's size.
type Stats struct {
	Endpoints int
	// Entries is the total number of per-endpoint LRU entries.
	Entries int
	// Blocks is the number of distinct block hashes held by any endpoint.
	Blocks int
	// Bytes is the size of the index's arrays (hash tables, LRU nodes,
	// overflow bitsets), excluding small fixed overheads.
	Bytes       int64
	PerEndpoint map[string]EndpointStats
}

// Stats returns the Index's current size. It briefly locks each shard and
// endpoint in turn, so it is meant for metrics, not the hot path.
func (x *Index) Stats() Stats {
	const (
		lruSlot    = int(unsafe.Sizeof(int32(0)))
		lruNode    = int64(unsafe.Sizeof(lruNode{}))
		globalSlot = int(unsafe.Sizeof(holders{}))
		// A Go map entry of the rare overflow bitsets, roughly.
		overEntry = 48
	)
	t := x.table.Load()
	st := Stats{Endpoints: len(t.ByName), PerEndpoint: make(map[string]EndpointStats, len(t.ByName))}
	for name, ep := range t.ByName {
		ep.mu.Lock()
		es := EndpointStats{Entries: ep.slots.n, Capacity: ep.capacity}
		st.Bytes += ep.slots.bytes(lruSlot) + int64(cap(ep.nodes))*lruNode
		x.unlock(ep)
		st.PerEndpoint[name] = es
		st.Entries += es.Entries
	}
	for i := range x.shards {
		s := &x.shards[i]
		s.mu.RLock()
		st.Blocks += s.m.n
		st.Bytes += s.m.bytes(globalSlot)
		for _, o := range s.over {
			st.Bytes += overEntry + int64(cap(o))*8
		}
		s.mu.RUnlock()
	}
	return st
}
