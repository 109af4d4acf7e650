package prefix

import (
	"math/rand/v2"
	"testing"
)

// TestTableMatchesMap drives the open-addressing table and a Go map with
// the same random operations (with clustered keys, key 0 included) and
// compares them after every step.
func TestTableMatchesMap(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	tb := newTable[int32](0)
	ref := map[uint64]int32{}
	for i := range 200000 {
		// Few distinct keys, so puts, hits, deletes and misses all happen;
		// the key space size drifts so the table grows and shrinks.
		space := uint64(16 + (i/20000)%5*400)
		k := r.Uint64N(space)
		if r.IntN(2) == 0 {
			k *= 1 << 40 // far apart keys too
		}
		switch r.IntN(3) {
		case 0, 1:
			v := int32(r.IntN(1000))
			tb.put(k, v)
			ref[k] = v
		case 2:
			_, had := ref[k]
			if got := tb.del(k); got != had {
				t.Fatalf("step %d: del(%d) = %v, map had it: %v", i, k, got, had)
			}
			delete(ref, k)
		}
		if tb.n != len(ref) {
			t.Fatalf("step %d: n = %d, map %d", i, tb.n, len(ref))
		}
		if p, ok := tb.get(k); ok != (ref[k] != 0 || func() bool { _, o := ref[k]; return o }()) || (ok && *p != ref[k]) {
			t.Fatalf("step %d: get(%d) mismatch", i, k)
		}
	}
	for k, v := range ref {
		if p, ok := tb.get(k); !ok || *p != v {
			t.Fatalf("final: key %d = %v/%v, want %d", k, p, ok, v)
		}
	}
	seen := 0
	tb.each(func(k uint64, v *int32) {
		seen++
		if ref[k] != *v {
			t.Fatalf("each: key %d", k)
		}
	})
	if seen != len(ref) {
		t.Fatalf("each saw %d of %d", seen, len(ref))
	}
	if len(tb.keys)*3 < tb.n*4 {
		t.Fatalf("load factor exceeded: %d in %d slots", tb.n, len(tb.keys))
	}
}
