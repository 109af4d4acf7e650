package sched

import (
	"container/list"
	"sync"
	"time"
)

// Session table defaults.
const (
	DefaultSessionCapacity = 65536
	DefaultSessionTTL      = 10 * time.Minute
	DefaultSessionHeader   = "x-session-id"
)

// Sessions remembers which endpoint each session was last sent to: a
// bounded LRU whose entries also expire TTL after their last use. It is
// safe for concurrent use.
type Sessions struct {
	mu  sync.Mutex
	cap int
	ttl time.Duration
	m   map[string]*list.Element
	lru list.List // front = most recent; values are *sessionEntry
}

type sessionEntry struct {
	key  string
	addr string
	seen time.Time
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
	return &Sessions{cap: capacity, ttl: ttl, m: map[string]*list.Element{}}
}

// Get returns the endpoint address remembered for key, if not expired.
func (s *Sessions) Get(key string, now time.Time) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	el := s.m[key]
	if el == nil {
		return "", false
	}
	e := el.Value.(*sessionEntry)
	if now.Sub(e.seen) > s.ttl {
		s.lru.Remove(el)
		delete(s.m, key)
		return "", false
	}
	return e.addr, true
}

// Put remembers addr for key as of now, evicting the least recently used
// session when full.
func (s *Sessions) Put(key, addr string, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if el := s.m[key]; el != nil {
		e := el.Value.(*sessionEntry)
		e.addr, e.seen = addr, now
		s.lru.MoveToFront(el)
		return
	}
	for s.lru.Len() >= s.cap {
		old := s.lru.Back()
		s.lru.Remove(old)
		delete(s.m, old.Value.(*sessionEntry).key)
	}
	s.m[key] = s.lru.PushFront(&sessionEntry{key: key, addr: addr, seen: now})
}

// Len returns the number of remembered sessions (expired ones included
// until they are looked up or evicted).
func (s *Sessions) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lru.Len()
}

// SessionEntry is one session as Export copies it.
type SessionEntry struct {
	Key, Addr string
	Expires   time.Time
}

// Export copies the unexpired sessions at now, most recently used first.
func (s *Sessions) Export(now time.Time) []SessionEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]SessionEntry, 0, s.lru.Len())
	for el := s.lru.Front(); el != nil; el = el.Next() {
		e := el.Value.(*sessionEntry)
		if exp := e.seen.Add(s.ttl); exp.After(now) {
			out = append(out, SessionEntry{Key: e.key, Addr: e.addr, Expires: exp})
		}
	}
	return out
}

// Import remembers an exported session unless the table already knows a
// more recent one for the key. Import the most recently used last, so the
// LRU order survives.
func (s *Sessions) Import(e SessionEntry) {
	seen := e.Expires.Add(-s.ttl)
	s.mu.Lock()
	if el := s.m[e.Key]; el != nil && !el.Value.(*sessionEntry).seen.Before(seen) {
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.Put(e.Key, e.Addr, seen)
}
