package sched

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

func TestSessionsSharded(t *testing.T) {
	t.Parallel()
	if n := len(NewSessions(10, 0).shards); n != 1 {
		t.Errorf("a 10-session table has %d shards, want one exact LRU", n)
	}
	tab := NewSessions(0, time.Minute)
	if n := len(tab.shards); n != maxSessionShards {
		t.Fatalf("default table: %d shards", n)
	}
	t0 := time.Unix(1000, 0)
	const total = 100000
	for i := range total {
		tab.Put(fmt.Sprintf("s%d", i), fmt.Sprintf("10.0.0.%d:8000", i%7), t0.Add(time.Duration(i)*time.Microsecond))
	}
	// Every shard filled up and evicted its own least recent sessions.
	if n := tab.Len(); n != DefaultSessionCapacity {
		t.Fatalf("%d sessions kept, want the capacity %d", n, DefaultSessionCapacity)
	}
	checkSessions(t, tab)
	if a, ok := tab.Get(fmt.Sprintf("s%d", total-1), t0); !ok || a != fmt.Sprintf("10.0.0.%d:8000", (total-1)%7) {
		t.Errorf("latest session -> %q %v", a, ok)
	}
	if _, ok := tab.Get("s0", t0); ok {
		t.Error("the oldest session survived a full table")
	}

	out := tab.Export(t0)
	if len(out) != DefaultSessionCapacity {
		t.Fatalf("exported %d", len(out))
	}
	if !slices.IsSortedFunc(out, func(a, b SessionEntry) int { return b.Expires.Compare(a.Expires) }) {
		t.Error("export is not most recently used first across shards")
	}
	if want := t0.Add((total-1)*time.Microsecond + time.Minute); !out[0].Expires.Equal(want) {
		t.Errorf("first exported expires %v, want %v", out[0].Expires, want)
	}
	if n := len(tab.Export(t0.Add(time.Minute + (total-100)*time.Microsecond))); n != 99 {
		t.Errorf("%d sessions unexpired near the end of the TTL, want 99", n)
	}

	// Import, least recent first, restores every session.
	back := NewSessions(0, time.Minute)
	for _, e := range slices.Backward(out) {
		back.Import(e)
	}
	if got := back.Export(t0); !slices.Equal(got, out) {
		t.Error("import then export changed the sessions")
	}
	// A more recent local entry wins over an imported one.
	back.Put("s99999", "elsewhere", t0.Add(time.Hour))
	back.Import(out[0])
	if a, _ := back.Get("s99999", t0.Add(time.Hour)); a != "elsewhere" {
		t.Errorf("older import replaced a newer session: %q", a)
	}
}

// TestSessionsConcurrent exports while requests read and write sessions
// (run with -race).
func TestSessionsConcurrent(t *testing.T) {
	t.Parallel()
	tab := NewSessions(0, time.Minute)
	now := time.Now()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20000 {
				k := fmt.Sprintf("w%d-%d", w, i%5000)
				tab.Put(k, "a", now)
				if a, ok := tab.Get(k, now); !ok || a != "a" {
					t.Errorf("%s -> %q %v", k, a, ok)
					return
				}
			}
		}()
	}
	for range 20 {
		if n := len(tab.Export(now)); n > DefaultSessionCapacity {
			t.Fatalf("exported %d", n)
		}
	}
	wg.Wait()
	if n := tab.Len(); n != 20000 {
		t.Errorf("%d sessions, want 4 writers x 5000", n)
	}
	checkSessions(t, tab)
}

// checkSessions verifies every shard's list, index and free chain agree.
func checkSessions(t *testing.T, s *Sessions) {
	t.Helper()
	for k := range s.shards {
		sh := &s.shards[k]
		n, prev := 0, int32(-1)
		for i := sh.head; i >= 0; i = sh.nodes[i].next {
			if sh.nodes[i].prev != prev || sh.index[sh.nodes[i].key] != i {
				t.Fatalf("shard %d: node %d badly linked or indexed", k, i)
			}
			prev = i
			n++
		}
		if prev != sh.tail || n != len(sh.index) || n > sh.cap {
			t.Fatalf("shard %d: %d listed, %d indexed, tail %d (want %d), cap %d", k, n, len(sh.index), sh.tail, prev, sh.cap)
		}
		free := 0
		for i := sh.free; i >= 0; i = sh.nodes[i].next {
			free++
		}
		if n+free != len(sh.nodes) {
			t.Fatalf("shard %d: %d listed + %d free != %d nodes", k, n, free, len(sh.nodes))
		}
	}
}

func TestSessionsExpiryReusesNodes(t *testing.T) {
	t.Parallel()
	tab := NewSessions(4, time.Minute)
	t0 := time.Unix(1000, 0)
	for i := range 4 {
		tab.Put(fmt.Sprintf("s%d", i), "a", t0.Add(time.Duration(i)*time.Second))
	}
	// s1 and s2 expire on lookup; s0 was used again just now.
	tab.Put("s0", "b", t0.Add(time.Minute))
	for _, k := range []string{"s1", "s2"} {
		if _, ok := tab.Get(k, t0.Add(time.Minute+2*time.Second+1)); ok {
			t.Fatalf("%s did not expire", k)
		}
	}
	checkSessions(t, tab)
	if tab.Len() != 2 {
		t.Fatalf("%d sessions after two expired", tab.Len())
	}
	tab.Put("s4", "c", t0.Add(time.Minute))
	tab.Put("s5", "c", t0.Add(time.Minute))
	tab.Put("s6", "c", t0.Add(time.Minute)) // full again: evicts s3, the least recent
	checkSessions(t, tab)
	if n := len(tab.shards[0].nodes); n != 4 {
		t.Errorf("%d nodes for a 4-session table: freed nodes not reused", n)
	}
	if _, ok := tab.Get("s3", t0.Add(time.Minute)); ok {
		t.Error("least recent session s3 not evicted")
	}
	if a, ok := tab.Get("s0", t0.Add(time.Minute)); !ok || a != "b" {
		t.Errorf("s0 -> %q %v", a, ok)
	}
}
