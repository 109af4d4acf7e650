package sched

import (
	"runtime"
	"slices"
	"sync"
	"time"
)

// Session table defaults.
const (
	DefaultSessionCapacity = 65536
	DefaultSessionTTL      = 10 * time.Minute
	DefaultSessionHeader   = "x-session-id"
)

// Sharding of the session table: up to maxSessionShards shards, each
// holding at least minSessionShard sessions, so small tables keep one
// exact LRU.
const (
	maxSessionShards = 64
	minSessionShard  = 1024
)

// Sessions remembers which endpoint each session was last sent to: a
// bounded LRU whose entries also expire TTL after their last use. It is
// safe for concurrent use. The table is split by session id into shards
// with their own lock and LRU (a large table evicts per shard, each
// shard's least recently used first), so requests of different sessions
// rarely wait for each other, and Export holds one shard's lock only for
// a copy of its entries.
type Sessions struct {
	ttl    time.Duration
	shards []sessionShard
}

// sessionShard is an LRU kept as a doubly linked list over a slice of
// nodes (no allocation per session, and Export can copy it in one go).
type sessionShard struct {
	mu         sync.Mutex
	cap        int
	index      map[string]int32 // session id -> node
	nodes      []sessionNode
	head, tail int32 // most and least recently used; -1 when empty
	free       int32 // a chain (through next) of unused nodes; -1 if none
	_          [64]byte
}

type sessionNode struct {
	key, addr  string
	seen       time.Time
	prev, next int32
}

// NewSessions returns a table of at most capacity sessions expiring after
// ttl (zero values mean the defaults).
func NewSessions(capacity int, ttl time.Duration) *Sessions {
	if capacity <= 0 {
		capacity = DefaultSessionCapacity
	}
	if ttl <= 0 {
		ttl = DefaultSessionTTL
	}
	n := 1
	for n < maxSessionShards && capacity/(2*n) >= minSessionShard {
		n *= 2
	}
	s := &Sessions{ttl: ttl, shards: make([]sessionShard, n)}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.cap = capacity / n
		if i < capacity%n {
			sh.cap++
		}
		sh.index = map[string]int32{}
		sh.head, sh.tail, sh.free = -1, -1, -1
	}
	return s
}

// shard returns key's shard. The hash (FNV-1a, folded) is the same in
// every process, so sessions exported from a full table import into the
// same shards after a restart and all fit.
func (s *Sessions) shard(key string) *sessionShard {
	if len(s.shards) == 1 {
		return &s.shards[0]
	}
	h := uint64(14695981039346656037)
	for i := 0; i < len(key); i++ {
		h ^= uint64(key[i])
		h *= 1099511628211
	}
	h ^= h >> 32
	return &s.shards[h%uint64(len(s.shards))]
}

// Get returns the endpoint address remembered for key, if not expired.
func (s *Sessions) Get(key string, now time.Time) (string, bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, ok := sh.index[key]
	if !ok {
		return "", false
	}
	n := &sh.nodes[i]
	if now.Sub(n.seen) > s.ttl {
		sh.remove(i)
		return "", false
	}
	return n.addr, true
}

// Put remembers addr for key as of now, evicting the least recently used
// session of key's shard when it is full.
func (s *Sessions) Put(key, addr string, now time.Time) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.put(key, addr, now)
}

func (sh *sessionShard) put(key, addr string, now time.Time) {
	if i, ok := sh.index[key]; ok {
		n := &sh.nodes[i]
		n.addr, n.seen = addr, now
		sh.unlink(i)
		sh.pushFront(i)
		return
	}
	for len(sh.index) >= sh.cap {
		sh.remove(sh.tail)
	}
	i := sh.free
	if i >= 0 {
		sh.free = sh.nodes[i].next
	} else {
		i = int32(len(sh.nodes))
		sh.nodes = append(sh.nodes, sessionNode{})
	}
	sh.nodes[i] = sessionNode{key: key, addr: addr, seen: now}
	sh.index[key] = i
	sh.pushFront(i)
}

// remove forgets node i and puts it on the free chain.
func (sh *sessionShard) remove(i int32) {
	sh.unlink(i)
	delete(sh.index, sh.nodes[i].key)
	sh.nodes[i] = sessionNode{next: sh.free, prev: -1}
	sh.free = i
}

func (sh *sessionShard) unlink(i int32) {
	n := &sh.nodes[i]
	if n.prev >= 0 {
		sh.nodes[n.prev].next = n.next
	} else {
		sh.head = n.next
	}
	if n.next >= 0 {
		sh.nodes[n.next].prev = n.prev
	} else {
		sh.tail = n.prev
	}
	n.prev, n.next = -1, -1
}

func (sh *sessionShard) pushFront(i int32) {
	n := &sh.nodes[i]
	n.prev, n.next = -1, sh.head
	if sh.head >= 0 {
		sh.nodes[sh.head].prev = i
	}
	sh.head = i
	if sh.tail < 0 {
		sh.tail = i
	}
}

// Len returns the number of remembered sessions (expired ones included
// until they are looked up or evicted).
func (s *Sessions) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.index)
		sh.mu.Unlock()
	}
	return n
}

// SessionEntry is one session as Export copies it.
type SessionEntry struct {
	Key, Addr string
	Expires   time.Time
}

// Export copies the unexpired sessions at now, most recently used first.
// Each shard is locked only while its nodes are copied (one slice copy);
// the walk in LRU order runs on the copy, and Export yields the processor
// between shards, so a large table's export holds up neither requests nor
// a CPU for long.
func (s *Sessions) Export(now time.Time) []SessionEntry {
	out := make([]SessionEntry, 0, s.Len())
	var nodes []sessionNode
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		nodes = append(nodes[:0], sh.nodes...)
		head := sh.head
		sh.mu.Unlock()
		for j := head; j >= 0; j = nodes[j].next {
			if exp := nodes[j].seen.Add(s.ttl); exp.After(now) {
				out = append(out, SessionEntry{Key: nodes[j].key, Addr: nodes[j].addr, Expires: exp})
			}
		}
		if len(s.shards) > 1 {
			runtime.Gosched()
		}
	}
	if len(s.shards) > 1 {
		slices.SortStableFunc(out, func(a, b SessionEntry) int { return b.Expires.Compare(a.Expires) })
	}
	return out
}

// Import remembers an exported session unless the table already knows a
// more recent one for the key. Import the most recently used last, so the
// LRU order survives.
func (s *Sessions) Import(e SessionEntry) {
	seen := e.Expires.Add(-s.ttl)
	sh := s.shard(e.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if i, ok := sh.index[e.Key]; ok && !sh.nodes[i].seen.Before(seen) {
		return
	}
	sh.put(e.Key, e.Addr, seen)
}
