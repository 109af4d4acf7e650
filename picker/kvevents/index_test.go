package kvevents

import (
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker/sched"
)

var testNow = time.Unix(1_800_000_000, 0)

// engineHashes are what a fake engine calls a prompt's blocks: unrelated
// to the router's keys, as in vLLM.
func engineHashes(tokens []uint32, bs int, salt uint64) []uint64 {
	var out []uint64
	h := salt
	for i := 0; i+bs <= len(tokens); i += bs {
		h = finalize(h*31 + uint64(tokens[i]) + uint64(i))
		out = append(out, h)
	}
	return out
}

// storeRun is the BlockStored for blocks [from, to) of a prompt.
func storeRun(tokens []uint32, bs, from, to int, hashes []uint64, lora string) Event {
	e := Event{Kind: BlockStored, Hashes: append([]uint64(nil), hashes[from:to]...), Tokens: tokens[from*bs : to*bs], BlockSize: bs, Medium: MediumGPU, LoRAName: lora}
	if from > 0 {
		e.Parent, e.HasParent = hashes[from-1], true
	}
	if lora != "" {
		for range to - from {
			e.Extra = append(e.Extra, StringsDigest(lora))
		}
	}
	return e
}

func apply(s *Server, events ...Event) { s.Apply(&Batch{Events: events}, testNow) }

// cached runs a Query for tokens against addrs and returns the cached
// token counts, -1 where not exact.
func cached(x *Index, tokens []uint32, adapter string, addrs ...string) []int {
	q := x.NewQuery(tokens, adapter, "")
	defer q.Release()
	n, ok := make([]int, len(addrs)), make([]bool, len(addrs))
	q.CachedTokens(addrs, n, ok)
	for i := range n {
		if !ok[i] {
			n[i] = -1
		}
	}
	return n
}

func eq(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestIndexFollowsStoresAndEvictions(t *testing.T) {
	x := NewIndex()
	a, b := x.Server("a"), x.Server("b")
	a.SetState(Synced)
	b.SetState(Synced)
	prompt := seqTokens(100, 40) // 10 blocks of 4
	ha := engineHashes(prompt, 4, 1)
	hb := engineHashes(prompt, 4, 2)
	// a computes the first 6 blocks in two runs; b the first 3.
	apply(a, storeRun(prompt, 4, 0, 4, ha, ""))
	apply(a, storeRun(prompt, 4, 4, 6, ha, ""))
	apply(b, storeRun(prompt, 4, 0, 3, hb, ""))
	if got := cached(x, prompt, "", "a", "b", "c"); !eq(got, []int{24, 12, -1}) {
		t.Fatalf("cached %v, want [24 12 -1]", got)
	}
	// The last prompt token is always computed: a prompt of exactly 6
	// blocks has 5 cacheable.
	if got := cached(x, prompt[:24], "", "a"); !eq(got, []int{20}) {
		t.Fatalf("6-block prompt: cached %v, want [20]", got)
	}
	// a evicts block 2 (tail blocks go first in vLLM, but any order is
	// followed): its prefix now stops at 2 blocks.
	apply(a, Event{Kind: BlockRemoved, Hashes: []uint64{ha[2]}, Medium: MediumGPU})
	if got := cached(x, prompt, "", "a", "b"); !eq(got, []int{8, 12}) {
		t.Fatalf("after eviction: %v, want [8 12]", got)
	}
	// A different prompt sharing 2 blocks matches those 2.
	other := append(append([]uint32(nil), prompt[:8]...), seqTokens(900, 32)...)
	if got := cached(x, other, "", "a", "b"); !eq(got, []int{8, 8}) {
		t.Fatalf("shared prefix: %v, want [8 8]", got)
	}
	// The adapter's blocks are other blocks.
	if got := cached(x, prompt, "sql", "a", "b"); !eq(got, []int{0, 0}) {
		t.Fatalf("adapter: %v, want [0 0]", got)
	}
	apply(b, Event{Kind: AllBlocksCleared})
	if got := cached(x, prompt, "", "a", "b"); !eq(got, []int{8, 0}) {
		t.Fatalf("after clear: %v, want [8 0]", got)
	}
	if st := b.Stats(); st.Blocks != 0 || st.Keys != 0 || st.Cleared != 1 {
		t.Fatalf("b stats %+v", st)
	}
	// Only synced servers are exact.
	a.SetState(Partial)
	if got := cached(x, prompt, "", "a", "b"); !eq(got, []int{-1, 0}) {
		t.Fatalf("partial: %v, want [-1 0]", got)
	}
}

// vLLM may hold one block twice (two requests computed it at once): the
// key stays until the last copy is evicted.
func TestIndexCountsCopies(t *testing.T) {
	x := NewIndex()
	s := x.Server("s")
	s.SetState(Synced)
	prompt := seqTokens(0, 16)
	h := engineHashes(prompt, 4, 7)
	apply(s, storeRun(prompt, 4, 0, 4, h, ""), storeRun(prompt, 4, 0, 4, h, ""))
	apply(s, Event{Kind: BlockRemoved, Hashes: h[1:2]})
	if got := cached(x, prompt, "", "s"); !eq(got, []int{12}) {
		t.Fatalf("one copy evicted: %v, want [12]", got)
	}
	apply(s, Event{Kind: BlockRemoved, Hashes: h[1:2]})
	if got := cached(x, prompt, "", "s"); !eq(got, []int{4}) {
		t.Fatalf("both copies evicted: %v, want [4]", got)
	}
	// Removing what was never stored is counted, not fatal.
	apply(s, Event{Kind: BlockRemoved, Hashes: []uint64{12345}})
	if st := s.Stats(); st.UnknownRemoved != 1 || st.Blocks != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// Blocks whose parent the view never saw cannot be keyed: they are
// tracked (so their removal balances) but never matched.
func TestIndexOrphansAndMedia(t *testing.T) {
	x := NewIndex()
	s := x.Server("s")
	s.SetState(Synced)
	prompt := seqTokens(0, 16)
	h := engineHashes(prompt, 4, 3)
	apply(s, storeRun(prompt, 4, 2, 4, h, "")) // parent h[1] unknown
	if got := cached(x, prompt, "", "s"); !eq(got, []int{0}) {
		t.Fatalf("orphans matched: %v", got)
	}
	st := s.Stats()
	if st.Orphans != 2 || st.Blocks != 2 || st.Matchable != 0 {
		t.Fatalf("stats %+v", st)
	}
	// Offloaded copies are counted by medium and never matched.
	cpu := storeRun(prompt, 4, 0, 2, h, "")
	cpu.Medium = "CPU"
	apply(s, cpu)
	if got := cached(x, prompt, "", "s"); !eq(got, []int{0}) {
		t.Fatalf("CPU blocks matched: %v", got)
	}
	if st := s.Stats(); st.Media["CPU"] != 2 {
		t.Fatalf("media %+v", st.Media)
	}
	apply(s, Event{Kind: BlockRemoved, Hashes: h[:2], Medium: "CPU"}, Event{Kind: BlockRemoved, Hashes: h[2:4]})
	if st := s.Stats(); st.Blocks != 0 || len(st.Media) != 0 || st.UnknownRemoved != 0 {
		t.Fatalf("after removals %+v", st)
	}
}

// A run whose first blocks were skipped (vLLM leaves null and masked
// blocks out of block_hashes, not out of token_ids) keys the hashed
// blocks by their place.
func TestIndexSkippedLeadingBlocks(t *testing.T) {
	x := NewIndex()
	s := x.Server("s")
	s.SetState(Synced)
	prompt := seqTokens(50, 16)
	h := engineHashes(prompt, 4, 9)
	apply(s, storeRun(prompt, 4, 0, 1, h, ""))
	e := storeRun(prompt, 4, 1, 4, h, "")
	e.Hashes = e.Hashes[1:] // block 1 skipped
	apply(s, e)
	keys := AppendKeys(nil, prompt, 4, 0, nil)
	if !s.Holds(keys[0]) || s.Holds(keys[1]) || !s.Holds(keys[2]) || !s.Holds(keys[3]) {
		t.Fatalf("holds %v %v %v %v", s.Holds(keys[0]), s.Holds(keys[1]), s.Holds(keys[2]), s.Holds(keys[3]))
	}
}

func TestIndexAdapterAndSalt(t *testing.T) {
	x := NewIndex()
	s := x.Server("s")
	s.SetState(Synced)
	prompt := seqTokens(7, 16)
	h := engineHashes(prompt, 4, 5)
	apply(s, storeRun(prompt, 4, 0, 4, h, "sql"))
	if got := cached(x, prompt, "sql", "s"); !eq(got, []int{12}) {
		t.Fatalf("adapter: %v, want [12]", got)
	}
	if got := cached(x, prompt, "", "s"); !eq(got, []int{0}) {
		t.Fatalf("base model matched the adapter's blocks: %v", got)
	}
	// An older engine names the adapter only in lora_name.
	legacy := storeRun(prompt, 4, 0, 4, engineHashes(prompt, 4, 6), "sql")
	legacy.Extra = nil
	x2 := NewIndex()
	s2 := x2.Server("s")
	s2.SetState(Synced)
	apply(s2, legacy)
	if got := cached(x2, prompt, "sql", "s"); !eq(got, []int{12}) {
		t.Fatalf("legacy adapter event: %v, want [12]", got)
	}
	// A cache salt keys the first block (and so the whole chain).
	salted := storeRun(prompt, 4, 0, 4, engineHashes(prompt, 4, 8), "")
	salted.Extra = []uint64{StringsDigest("s1"), 0, 0, 0}
	x3 := NewIndex()
	s3 := x3.Server("s")
	s3.SetState(Synced)
	apply(s3, salted)
	q := x3.NewQuery(prompt, "", "s1")
	n, ok := []int{0}, []bool{false}
	q.CachedTokens([]string{"s"}, n, ok)
	q.Release()
	if n[0] != 12 || !ok[0] {
		t.Fatalf("salted: %v %v, want 12", n, ok)
	}
	if got := cached(x3, prompt, "", "s"); !eq(got, []int{0}) {
		t.Fatalf("unsalted request matched salted blocks: %v", got)
	}
}

func TestIndexObserve(t *testing.T) {
	x := NewIndex()
	x.Server("a")
	x.Observe("a", 64, 64)
	x.Observe("a", 64, 32)
	x.Observe("a", 0, 32)
	x.Observe("a", 0, 0)
	x.Observe("gone", 1, 2)
	x.ObserveBound("a", 32, 64)
	x.ObserveBound("a", 32, 32)
	x.ObserveBound("a", 32, 0)
	if st := x.Lookup("a").Stats(); st.Agreed != 2 || st.Over != 2 || st.Under != 1 || st.Bounded != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// A Query that knows only a stable prefix of the prompt counts what each
// server holds of it: exactly where the server holds part of the
// prefix, at least the prefix's full blocks where it holds them all.
func TestQueryPrefix(t *testing.T) {
	x := NewIndex()
	prompt := seqTokens(100, 40) // 10 blocks of 4
	for i, name := range []string{"a", "b", "c"} {
		s := x.Server(name)
		s.SetState(Synced)
		n := []int{6, 3, 10}[i]
		apply(s, storeRun(prompt, 4, 0, n, engineHashes(prompt, 4, uint64(i)), ""))
	}
	known := prompt[:26] // 6 full blocks and 2 tokens
	q := x.NewQuery(known, "", "")
	q.prefix, q.total = true, 60
	defer q.Release()
	addrs := []string{"a", "b", "c"}
	n, ok := make([]int, 3), make([]bool, 3)
	q.CachedTokens(addrs, n, ok)
	if !eq(n, []int{24, 12, 24}) || !ok[0] || !ok[1] || !ok[2] {
		t.Fatalf("cached %v %v, want [24 12 24]", n, ok)
	}
	if !q.Bounded(n[0]) || q.Bounded(n[1]) || !q.Bounded(n[2]) || q.Tokens() != 60 || q.Known() != 26 || !q.Prefix() {
		t.Fatalf("bounded %v %v %v, tokens %d known %d", q.Bounded(n[0]), q.Bounded(n[1]), q.Bounded(n[2]), q.Tokens(), q.Known())
	}
	// The same tokens as a whole prompt: the last token is computed.
	whole := x.NewQuery(prompt[:24], "", "")
	defer whole.Release()
	whole.CachedTokens(addrs, n, ok)
	if !eq(n, []int{20, 12, 20}) || whole.Bounded(n[0]) {
		t.Fatalf("whole prompt: cached %v", n)
	}
}

func TestIndexRemoveServer(t *testing.T) {
	x := NewIndex()
	prompt := seqTokens(0, 8)
	for _, name := range []string{"a", "b"} {
		s := x.Server(name)
		s.SetState(Synced)
		apply(s, storeRun(prompt, 4, 0, 2, engineHashes(prompt, 4, 1), ""))
	}
	x.Remove("a")
	if got := cached(x, prompt, "", "a", "b"); !eq(got, []int{-1, 4}) {
		t.Fatalf("after remove: %v", got)
	}
	c := x.Server("c") // reuses a's id: must not inherit its blocks
	c.SetState(Synced)
	if got := cached(x, prompt, "", "c"); !eq(got, []int{0}) {
		t.Fatalf("new server inherited blocks: %v", got)
	}
}

func BenchmarkQuery(b *testing.B) {
	x := NewIndex()
	var addrs []string
	prompt := seqTokens(0, 4096)
	for i := range 16 {
		name := string(rune('a'+i)) + ":8000"
		addrs = append(addrs, name)
		s := x.Server(name)
		s.SetState(Synced)
		// Each server holds a different share of the prompt.
		apply(s, storeRun(prompt, 16, 0, 16*(i+1), engineHashes(prompt, 16, uint64(i)), ""))
	}
	n, ok := make([]int, len(addrs)), make([]bool, len(addrs))
	b.ReportAllocs()
	for b.Loop() {
		q := x.NewQuery(prompt, "", "")
		q.CachedTokens(addrs, n, ok)
		q.Release()
	}
}

// A Query is what picker/sched consults as a request's exact view.
var _ sched.CacheView = (*Query)(nil)

// A request routed to a server counts its prompt's blocks as on their
// way there (tentatively) until the server's events announce them, or
// for PendingFor; a cleared server loses them.
func TestQueryRoutedPending(t *testing.T) {
	x := NewIndex()
	a, b := x.Server("a"), x.Server("b")
	for _, s := range []*Server{a, b} {
		s.SetState(Synced)
		// Both learn their block size from an unrelated store.
		other := seqTokens(9000, 8)
		apply(s, storeRun(other, 4, 0, 2, engineHashes(other, 4, 7), ""))
	}
	prompt := seqTokens(100, 21)
	q := x.NewQuery(prompt, "", "")
	n, ok := make([]int, 2), make([]bool, 2)
	q.CachedTokens([]string{"a", "b"}, n, ok)
	if n[0] != 0 || n[1] != 0 {
		t.Fatalf("cached %v before routing", n)
	}
	q.Routed("a")
	q.Release()

	q = x.NewQuery(prompt, "", "")
	defer q.Release()
	q.CachedTokens([]string{"a", "b"}, n, ok)
	if n[0] != 20 || n[1] != 0 || !q.Tentative("a") || q.Tentative("b") {
		t.Fatalf("after routing to a: cached %v, tentative %v %v", n, q.Tentative("a"), q.Tentative("b"))
	}
	// The events announce the first 3 blocks: exact for those, pending
	// for the rest.
	apply(a, storeRun(prompt, 4, 0, 3, engineHashes(prompt, 4, 1), ""))
	q.CachedTokens([]string{"a"}, n, ok)
	if n[0] != 20 || !q.Tentative("a") {
		t.Fatalf("partly stored: cached %d, tentative %v", n[0], q.Tentative("a"))
	}
	apply(a, storeRun(prompt, 4, 3, 5, engineHashes(prompt, 4, 1), ""))
	q.CachedTokens([]string{"a"}, n, ok)
	if n[0] != 20 || q.Tentative("a") {
		t.Fatalf("stored: cached %d, tentative %v", n[0], q.Tentative("a"))
	}
	// Expired pending blocks count for nothing; a cleared server loses
	// its pending ones.
	q.CachedTokens([]string{"b"}, n, ok)
	x.setPending(q.keysFor(4), b.id, time.Now().Add(-time.Second).UnixNano())
	if q.CachedTokens([]string{"b"}, n, ok); n[0] != 0 {
		t.Fatalf("expired pending blocks counted: %d", n[0])
	}
	q.Routed("b")
	b.Clear()
	if q.CachedTokens([]string{"b"}, n, ok); n[0] != 0 || q.Tentative("b") {
		t.Fatalf("cleared server: %d", n[0])
	}
}
