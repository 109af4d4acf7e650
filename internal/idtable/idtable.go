// Package idtable owns a copy-on-write table of named entries, each with
// a small integer ID: the IDs of removed entries are reused before new
// ones are taken, so that per-ID arrays (bitsets of holders, per-ID
// counters) stay as short as the number of live entries allows. Readers
// load the current snapshot with one atomic pointer load and never lock
// or allocate; writers (Add, Remove) are serialised by the table and
// publish a new snapshot each.
package idtable

import (
	"sort"
	"sync"
	"sync/atomic"
)

// Snapshot is the table's content at one moment. It is never modified
// once published: readers may keep it as long as they need.
type Snapshot[T any] struct {
	ByName map[string]*T
	ByID   []*T // nil where the ID is free
}

// Table maps names to entries *T and their IDs. Call Init before any
// other method; all methods are safe for concurrent use.
type Table[T any] struct {
	mu   sync.Mutex // serialises Add and Remove
	cur  atomic.Pointer[Snapshot[T]]
	free []uint16 // IDs of removed entries, reused last-freed first
	next int      // the lowest ID never handed out
	max  int
}

// Init makes t an empty table holding at most max entries (at most
// 1<<16, the IDs' range).
func (t *Table[T]) Init(max int) {
	t.max = min(max, 1<<16)
	t.cur.Store(&Snapshot[T]{ByName: map[string]*T{}})
}

// Load returns the current snapshot.
func (t *Table[T]) Load() *Snapshot[T] { return t.cur.Load() }

// Get returns the entry called name, or nil.
func (t *Table[T]) Get(name string) *T { return t.cur.Load().ByName[name] }

// Add returns the entry called name, creating it if needed with create,
// which is given the entry's ID and how many entries the table holds
// with it; nil when the table is full. create runs under the writers'
// lock, before the entry is published.
func (t *Table[T]) Add(name string, create func(id uint16, n int) *T) *T {
	if v := t.Get(name); v != nil {
		return v
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.cur.Load()
	if v := old.ByName[name]; v != nil {
		return v
	}
	var id uint16
	switch {
	case len(t.free) > 0:
		id = t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
	case t.next < t.max:
		id = uint16(t.next)
		t.next++
	default:
		return nil
	}
	v := create(id, len(old.ByName)+1)
	next := &Snapshot[T]{ByName: make(map[string]*T, len(old.ByName)+1), ByID: make([]*T, max(len(old.ByID), int(id)+1))}
	for k, e := range old.ByName {
		next.ByName[k] = e
	}
	copy(next.ByID, old.ByID)
	next.ByName[name] = v
	next.ByID[id] = v
	t.cur.Store(next)
	return v
}

// Remove takes the entry called name out of the table and frees its ID;
// it does nothing if there is none. drop is given the entry and how many
// entries remain, under the writers' lock, before the entry is
// unpublished: readers of the current snapshot may still find it.
func (t *Table[T]) Remove(name string, drop func(v *T, n int)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.cur.Load()
	v := old.ByName[name]
	if v == nil {
		return
	}
	id := idOf(old, v)
	drop(v, len(old.ByName)-1)
	next := &Snapshot[T]{ByName: make(map[string]*T, len(old.ByName)), ByID: append([]*T(nil), old.ByID...)}
	for k, e := range old.ByName {
		if k != name {
			next.ByName[k] = e
		}
	}
	next.ByID[id] = nil
	t.cur.Store(next)
	t.free = append(t.free, id)
}

// idOf returns v's ID in s.
func idOf[T any](s *Snapshot[T], v *T) uint16 {
	for i, e := range s.ByID {
		if e == v {
			return uint16(i)
		}
	}
	panic("idtable: entry missing from ByID")
}

// Names returns the entries' names, sorted.
func (t *Table[T]) Names() []string {
	s := t.cur.Load()
	out := make([]string, 0, len(s.ByName))
	for n := range s.ByName {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
