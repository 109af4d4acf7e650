package prefix

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// block returns a 64-character block made of c.
func block(c byte) string { return strings.Repeat(string(c), 64) }

func hits(x *Index, hashes []uint64) map[string]int {
	out := map[string]int{}
	for _, h := range x.Match(hashes, nil) {
		out[h.Endpoint] = h.Blocks
	}
	return out
}

func TestHasherBlocks(t *testing.T) {
	t.Parallel()
	h := NewHasher(HashConfig{})
	if h.BlockChars() != 64 || h.MaxBlocks() != 256 {
		t.Fatalf("defaults: %d chars, %d blocks", h.BlockChars(), h.MaxBlocks())
	}
	if got := NewHasher(HashConfig{BlockTokens: 32, CharsPerToken: 3.5}).BlockChars(); got != 112 {
		t.Errorf("32 tokens * 3.5 chars = %d, want 112", got)
	}

	shared := block('a') + block('b') + block('c')
	p1 := shared + block('d') + "tail"
	p2 := shared + block('e') + block('f')
	h1 := h.Hash(nil, "m", p1)
	h2 := h.Hash(nil, "m", p2)
	if len(h1) != 4 || len(h2) != 5 {
		t.Fatalf("block counts %d, %d; want 4 (partial tail ignored), 5", len(h1), len(h2))
	}
	if !slices.Equal(h1[:3], h2[:3]) || h1[3] == h2[3] {
		t.Fatalf("shared prefix not reflected: %x vs %x", h1, h2)
	}
	if got := h.Hash(nil, "m", block('a')[:63]); len(got) != 0 {
		t.Errorf("a 63-char prompt has %d blocks, want 0", len(got))
	}

	// Chain property: the same block after a different parent hashes
	// differently.
	x := h.Hash(nil, "m", block('a')+block('z'))
	y := h.Hash(nil, "m", block('b')+block('z'))
	if x[1] == y[1] {
		t.Error("block hash ignores its parent")
	}
	// The model seeds the chain.
	if other := h.Hash(nil, "adapter-1", p1); other[0] == h1[0] {
		t.Error("model name does not change the hashes")
	}
	// Appends to dst and is deterministic across Hashers.
	dst := h.Hash([]uint64{7}, "m", p1)
	if dst[0] != 7 || !slices.Equal(dst[1:], NewHasher(HashConfig{}).Hash(nil, "m", p1)) {
		t.Error("Hash must append deterministically")
	}
	// A different seed changes hashes and the fingerprint.
	hs := NewHasher(HashConfig{Seed: 42})
	if hs.Hash(nil, "m", p1)[0] == h1[0] || hs.Fingerprint() == h.Fingerprint() {
		t.Error("seed ignored")
	}
	if NewHasher(HashConfig{BlockTokens: 8}).Fingerprint() == h.Fingerprint() {
		t.Error("fingerprint ignores block size")
	}
	// Pin the algorithm: persisted hashes depend on it. Change the
	// Fingerprint version if this value changes.
	if got := h.Hash(nil, "", block('a'))[0]; got != 0x4a3a509f142b1111 {
		t.Errorf("hash of one 'a' block = %#x; algorithm changed?", got)
	}
}

func TestHasherMaxBlocks(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 64*300)
	if n := len(NewHasher(HashConfig{}).Hash(nil, "m", long)); n != 256 {
		t.Errorf("default cap: %d blocks", n)
	}
	if n := len(NewHasher(HashConfig{MaxBlocks: 10}).Hash(nil, "m", long)); n != 10 {
		t.Errorf("cap 10: %d blocks", n)
	}
}

func TestHashSpread(t *testing.T) {
	t.Parallel()
	// Blocks differing in one byte, at any position, never collide, and
	// the shard index (top bits) is spread.
	h := NewHasher(HashConfig{})
	seen := map[uint64]bool{}
	shards := map[uint64]int{}
	base := []byte(block('q'))
	for pos := 0; pos < 64; pos++ {
		for c := 0; c < 64; c++ {
			b := bytes.Clone(base)
			b[pos] = byte(c)
			v := h.Hash(nil, "m", string(b))[0]
			if seen[v] {
				t.Fatalf("collision at pos %d byte %d", pos, c)
			}
			seen[v] = true
			shards[v>>(64-shardBits)]++
		}
	}
	if len(shards) != numShards {
		t.Errorf("only %d of %d shards used", len(shards), numShards)
	}
}

func TestMatchLongestPrefix(t *testing.T) {
	t.Parallel()
	h := NewHasher(HashConfig{})
	x := NewIndex(Config{})
	shared := block('a') + block('b') + block('c')
	p1 := h.Hash(nil, "m", shared+block('d'))
	p2 := h.Hash(nil, "m", shared+block('e')+block('f'))

	x.Add("10.0.0.1:8000", p1)
	if got := hits(x, p2); !reflect.DeepEqual(got, map[string]int{"10.0.0.1:8000": 3}) {
		t.Fatalf("two prompts sharing 3 blocks: %v", got)
	}
	if got := hits(x, p1); got["10.0.0.1:8000"] != 4 {
		t.Fatalf("same prompt: %v", got)
	}
	// B holds blocks 0 and 2 but not 1: the match stops at the first miss.
	x.Add("10.0.0.2:8000", p1[:1])
	x.Add("10.0.0.2:8000", p1[2:3])
	// C holds block 1 only: without the root it matches nothing.
	x.Add("10.0.0.3:8000", p1[1:2])
	want := map[string]int{"10.0.0.1:8000": 4, "10.0.0.2:8000": 1}
	if got := hits(x, p1); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v want %v", got, want)
	}
	// The chain property end to end: block 'z' after a different parent.
	x.Add("10.0.0.4:8000", h.Hash(nil, "m", block('y')+block('z')))
	if got := hits(x, h.Hash(nil, "m", block('a')+block('z'))); got["10.0.0.4:8000"] != 0 || got["10.0.0.1:8000"] != 1 {
		t.Fatalf("chain: %v", got)
	}

	out := make([]int, 3)
	x.MatchInto(p1, []string{"10.0.0.2:8000", "unknown:1", "10.0.0.1:8000"}, out)
	if !slices.Equal(out, []int{1, 0, 4}) {
		t.Fatalf("MatchInto = %v", out)
	}
	if got := x.Match(nil, nil); len(got) != 0 {
		t.Fatalf("empty query: %v", got)
	}
}

// MatchInto gives the same answer whether few endpoints hold the prefix
// (found among the candidates one by one) or many (looked up by name),
// with ids past the inline holder words.
func TestMatchIntoFewAndMany(t *testing.T) {
	t.Parallel()
	h := NewHasher(HashConfig{})
	p := h.Hash(nil, "m", block('a')+block('b')+block('c'))
	for _, holders := range []int{1, fewHits, fewHits + 1, 300} {
		x := NewIndex(Config{})
		var eps []string
		want := map[string]int{}
		for i := range 600 {
			name := fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250)
			eps = append(eps, name)
			// Spread the holders over the ids, past 256.
			if i%(600/holders) == 0 && len(want) < holders {
				n := 1 + i%3
				x.Add(name, p[:n])
				want[name] = n
			}
		}
		out := make([]int, len(eps))
		x.MatchInto(p, eps, out)
		for i, name := range eps {
			if out[i] != want[name] {
				t.Fatalf("%d holders: %s matched %d blocks, want %d", holders, name, out[i], want[name])
			}
		}
	}
}

// The index's entries over all endpoints stay within MaxEntries (plus the
// eighth a share may lag): each endpoint keeps its share, its most recent
// blocks, and gets room back when endpoints go.
func TestMaxEntriesBoundsTheIndex(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{MaxEntries: 1000})
	fill := func(name string, from int) {
		hs := make([]uint64, 600)
		for i := range hs {
			hs[i] = uint64(from + i + 1)
		}
		x.Add(name, hs)
	}
	for e := range 10 {
		name := fmt.Sprintf("ep%d", e)
		x.SetCapacity(name, 600)
		fill(name, e*10000)
	}
	st := x.Stats()
	if st.Entries > 1000*9/8 {
		t.Fatalf("%d entries for MaxEntries 1000", st.Entries)
	}
	for name, es := range st.PerEndpoint {
		if es.Capacity > 1000/10*9/8 || es.Entries > es.Capacity {
			t.Errorf("%s: %+v, want its share of about 100", name, es)
		}
	}
	// What is kept is the most recently touched: a chain's leading
	// blocks (Add touches them last).
	if hits(x, []uint64{1})["ep0"] != 1 || hits(x, []uint64{600})["ep0"] != 0 {
		t.Errorf("ep0 kept the wrong end of its chain: %v %v", hits(x, []uint64{1}), hits(x, []uint64{600}))
	}
	for e := 2; e < 10; e++ {
		x.Remove(fmt.Sprintf("ep%d", e))
	}
	fill("ep0", 50000)
	st = x.Stats()
	if c := st.PerEndpoint["ep0"].Capacity; c != 500 || st.PerEndpoint["ep0"].Entries != 500 {
		t.Errorf("two endpoints left: ep0 %+v, want capacity and entries 500", st.PerEndpoint["ep0"])
	}
}

func TestLRUEvictionAndCapacity(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 4})
	const ep = "e:1"
	a := []uint64{1, 2, 3} // a chain: root 1
	b := []uint64{10, 11}
	x.Add(ep, a)
	// Root most recent: 1, 2, 3.
	if got := x.Export(0).Endpoints[0].Hashes; !slices.Equal(got, []uint64{1, 2, 3}) {
		t.Fatalf("order after first add: %v", got)
	}
	x.Add(ep, b) // inserting 10 at capacity evicts 3, the least recent.
	if got := x.Export(0).Endpoints[0].Hashes; !slices.Equal(got, []uint64{10, 11, 1, 2}) {
		t.Fatalf("order after second add: %v", got)
	}
	if got := hits(x, a); got[ep] != 2 {
		t.Fatalf("after evicting the tail block: %v", got)
	}
	x.Add(ep, []uint64{2}) // touch 2: 2, 10, 11, 1
	x.Add(ep, []uint64{20})
	if got := x.Export(0).Endpoints[0].Hashes; !slices.Equal(got, []uint64{20, 2, 10, 11}) {
		t.Fatalf("order after touch: %v", got)
	}
	if got := hits(x, a); len(got) != 0 {
		t.Fatalf("root evicted, yet matched: %v", got)
	}
	st := x.Stats()
	if st.Entries != 4 || st.PerEndpoint[ep] != (EndpointStats{Entries: 4, Capacity: 4}) || st.Blocks != 4 || st.Bytes <= 0 {
		t.Fatalf("stats %+v", st)
	}

	// Shrinking evicts the least recent entries.
	x.SetCapacity(ep, 2)
	if got := x.Export(0).Endpoints[0].Hashes; !slices.Equal(got, []uint64{20, 2}) {
		t.Fatalf("after shrink: %v", got)
	}
	if got := hits(x, []uint64{10}); len(got) != 0 {
		t.Fatalf("evicted block still matched: %v", got)
	}
	x.Add(ep, []uint64{30, 31, 32})
	if st := x.Stats(); st.Entries != 2 || st.Blocks != 2 {
		t.Fatalf("capacity not enforced: %+v", st)
	}
	// Growing keeps entries and allows more.
	x.SetCapacity(ep, 1000)
	x.Add(ep, []uint64{40, 41, 42})
	if got := x.Export(0).Endpoints[0].Hashes; !slices.Equal(got, []uint64{40, 41, 42, 30, 31}) {
		t.Fatalf("after grow: %v", got)
	}
	// Capacity is clamped.
	y := NewIndex(Config{MaxCapacity: 8})
	y.SetCapacity(ep, 1<<20)
	if c := y.Stats().PerEndpoint[ep].Capacity; c != 8 {
		t.Fatalf("clamped capacity %d", c)
	}
}

func TestEvictions(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 10})
	a := []uint64{11, 12, 13, 14}
	b := []uint64{21, 22, 23, 24}
	start := time.Now()
	x.Add("e1", a)
	x.Add("e1", a) // found held: reused
	x.Add("e1", b) // LRU, least recent first: 14 13 12 11 24 23 22 21
	checkInvariants(t, x)
	if got := x.Evictions("e1", 2, start); got != (Eviction{}) {
		t.Errorf("2 new blocks with room for 2: %+v, want nothing evicted", got)
	}
	if got := x.Evictions("e1", 4, start); got != (Eviction{Blocks: 2, Sole: 2}) {
		t.Errorf("4 new blocks: %+v, want a's last 2 blocks, reused and held nowhere else", got)
	}
	if got := x.Evictions("e1", 10, start); got != (Eviction{Blocks: 8, Sole: 4}) {
		t.Errorf("10 new blocks: %+v, want all 8 out, a's 4 the only reused ones", got)
	}
	if got := x.Evictions("e1", 4, time.Now().Add(time.Hour)); got != (Eviction{Blocks: 2}) {
		t.Errorf("reuse before since: %+v, want no sole block counted", got)
	}
	x.Add("e2", a[:3])
	if got := x.Evictions("e1", 4, start); got != (Eviction{Blocks: 2, Sole: 1}) {
		t.Errorf("a's first 3 blocks also on e2: %+v, want only block 14 sole", got)
	}
	if got := x.Evictions("nobody", 4, start); got != (Eviction{}) {
		t.Errorf("untracked endpoint: %+v", got)
	}
	// Sampling: a long tail is checked at most maxEvictionChecks times
	// and the count scaled.
	y := NewIndex(Config{DefaultCapacity: 1000})
	long := make([]uint64, 1000)
	for i := range long {
		long[i] = uint64(1000 + i)
	}
	y.Add("e", long)
	y.Add("e", long)
	if got := y.Evictions("e", 1000, start); got != (Eviction{Blocks: 1000, Sole: 1000}) {
		t.Errorf("1000 reused blocks out: %+v", got)
	}
}

func TestRemove(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{})
	chain := []uint64{100, 101, 102}
	x.Add("a", chain)
	x.Add("b", chain[:2])
	x.Remove("a")
	x.Remove("never-added")
	if got := hits(x, chain); !reflect.DeepEqual(got, map[string]int{"b": 2}) {
		t.Fatalf("after Remove: %v", got)
	}
	st := x.Stats()
	if st.Endpoints != 1 || st.Entries != 2 || st.Blocks != 2 {
		t.Fatalf("stats after remove %+v", st)
	}
	if !slices.Equal(x.Endpoints(), []string{"b"}) {
		t.Fatalf("endpoints %v", x.Endpoints())
	}
	// A new endpoint reuses the freed id without inheriting anything.
	x.Add("c", []uint64{200})
	if got := hits(x, chain); !reflect.DeepEqual(got, map[string]int{"b": 2}) {
		t.Fatalf("new endpoint inherited entries: %v", got)
	}
	x.Add("a", chain[:1])
	if got := hits(x, chain); !reflect.DeepEqual(got, map[string]int{"a": 1, "b": 2}) {
		t.Fatalf("re-added endpoint: %v", got)
	}
	checkInvariants(t, x)
}

func TestManyEndpointsOverflowBits(t *testing.T) {
	t.Parallel()
	// Ids from 256 up live in the overflow bitsets; exercise both.
	x := NewIndex(Config{DefaultCapacity: 8})
	chain := []uint64{1, 2, 3, 4}
	want := map[string]int{}
	for i := range 300 {
		name := fmt.Sprintf("ep%03d", i)
		n := 1 + i%4
		x.Add(name, chain[:n])
		want[name] = n
	}
	if got := hits(x, chain); !reflect.DeepEqual(got, want) {
		t.Fatalf("300 endpoints: %d hits, mismatch", len(got))
	}
	checkInvariants(t, x)
	for i := 0; i < 300; i += 2 {
		x.Remove(fmt.Sprintf("ep%03d", i))
		delete(want, fmt.Sprintf("ep%03d", i))
	}
	if got := hits(x, chain); !reflect.DeepEqual(got, want) {
		t.Fatalf("after removing half: %d hits, mismatch", len(got))
	}
	checkInvariants(t, x)
	for i := 1; i < 300; i += 2 {
		x.Remove(fmt.Sprintf("ep%03d", i))
	}
	if st := x.Stats(); st.Blocks != 0 || st.Entries != 0 {
		t.Fatalf("empty index keeps %+v", st)
	}
	checkInvariants(t, x)
}

// checkInvariants verifies that the global hash -> holders map is exactly
// the union of the endpoint LRUs and that capacities hold.
func checkInvariants(t *testing.T, x *Index) {
	t.Helper()
	want := map[uint64][]uint16{}
	tbl := x.table.Load()
	for name, ep := range tbl.ByName {
		ep.mu.Lock()
		if ep.slots.n > ep.capacity {
			t.Errorf("%s: %d entries > capacity %d", name, ep.slots.n, ep.capacity)
		}
		n := 0
		for s := ep.head; s >= 0; s = ep.nodes[s].next {
			n++
			want[ep.nodes[s].hash] = append(want[ep.nodes[s].hash], ep.id)
		}
		if n != ep.slots.n {
			t.Errorf("%s: list has %d nodes, map %d", name, n, ep.slots.n)
		}
		if len(ep.reused) != len(ep.nodes) {
			t.Errorf("%s: %d reuse stamps for %d nodes", name, len(ep.reused), len(ep.nodes))
		}
		if p := ep.npend.Load(); p != 0 || len(ep.pendLens) != 0 {
			t.Errorf("%s: %d deferred picks left unrecorded", name, p)
		}
		ep.mu.Unlock()
		if tbl.ByID[ep.id] != ep {
			t.Errorf("%s: id table mismatch", name)
		}
	}
	got := map[uint64][]uint16{}
	for i := range x.shards {
		sh := &x.shards[i]
		sh.m.each(func(h uint64, v *holders) {
			words := append(slices.Clone(v[:]), sh.over[h]...)
			var ids []uint16
			for w, word := range words {
				for b := 0; b < 64; b++ {
					if word&(1<<b) != 0 {
						ids = append(ids, uint16(w*64+b))
					}
				}
			}
			if len(ids) == 0 {
				t.Errorf("hash %x kept with no holders", h)
			}
			got[h] = ids
		})
		for h := range sh.over {
			if _, ok := sh.m.get(h); !ok {
				t.Errorf("overflow bits for %x without a main entry", h)
			}
		}
	}
	for h := range want {
		slices.Sort(want[h])
		slices.Sort(got[h])
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("global index differs from endpoint LRUs:\n got %v\nwant %v", got, want)
	}
}

func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 64})
	h := NewHasher(HashConfig{BlockTokens: 1, CharsPerToken: 8})
	prompts := make([][]uint64, 20)
	for i := range prompts {
		p := fmt.Sprintf("system prompt shared by all!%08d", i%4) + strings.Repeat(fmt.Sprintf("%08d", i), 10)
		prompts[i] = h.Hash(nil, "m", p)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			var dst []Hit
			out := make([]int, 3)
			for i := range 2000 {
				ep := fmt.Sprintf("ep%d", r.IntN(6))
				p := prompts[r.IntN(len(prompts))]
				switch op := r.IntN(100); {
				case op < 45:
					x.Add(ep, p)
				case op < 90:
					dst = x.Match(p, dst[:0])
					for _, hit := range dst {
						if hit.Blocks < 1 || hit.Blocks > len(p) {
							t.Errorf("impossible hit %+v", hit)
						}
					}
					x.MatchInto(p, []string{"ep0", "ep1", "ep2"}, out)
				case op < 94:
					x.SetCapacity(ep, 16+r.IntN(64))
				case op < 97:
					x.Remove(ep)
				default:
					_ = x.Stats()
					_ = x.Export(0)
				}
				_ = i
			}
		}()
	}
	wg.Wait()
	checkInvariants(t, x)
}

func TestExportImportRoundTrip(t *testing.T) {
	t.Parallel()
	h := NewHasher(HashConfig{})
	x := NewIndex(Config{DefaultCapacity: 50})
	r := rand.New(rand.NewPCG(1, 2))
	var queries [][]uint64
	for i := range 40 {
		var sb strings.Builder
		for range 1 + r.IntN(8) {
			sb.WriteString(block(byte('a' + r.IntN(3))))
		}
		p := h.Hash(nil, "m", sb.String())
		queries = append(queries, p)
		x.Add(fmt.Sprintf("10.0.0.%d:8000", i%5), p)
	}
	x.SetCapacity("10.0.0.1:8000", 7)
	d := x.Export(h.Fingerprint())
	b, err := d.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var back Dump
	if err := back.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, d) {
		t.Fatalf("binary round trip changed the dump")
	}
	if back.Fingerprint != h.Fingerprint() {
		t.Fatal("fingerprint lost")
	}
	y := NewIndex(Config{})
	y.Import(back)
	if got := y.Export(h.Fingerprint()); !reflect.DeepEqual(got, d) {
		t.Fatalf("import/export changed LRU order or capacity:\n got %+v\nwant %+v", got, d)
	}
	for _, q := range queries {
		if a, b := hits(x, q), hits(y, q); !reflect.DeepEqual(a, b) {
			t.Fatalf("match differs after import: %v vs %v", a, b)
		}
	}
	checkInvariants(t, y)

	for _, bad := range [][]byte{nil, []byte("XXXX\x01"), b[:len(b)-3], append([]byte("SYPX\x09"), b[5:]...)} {
		var d Dump
		if err := d.UnmarshalBinary(bad); !errors.Is(err, ErrBadDump) {
			t.Errorf("corrupt dump %q...: err = %v", bad[:min(len(bad), 6)], err)
		}
	}
}

func TestExportEndpoint(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 8})
	if _, _, ok := x.ExportEndpoint("a", 0, nil, &ExportScratch{}); ok {
		t.Fatal("exported an unknown endpoint")
	}
	if _, ok := x.Version("a"); ok {
		t.Fatal("version of an unknown endpoint")
	}
	x.Add("a", []uint64{1, 2, 3})
	x.Add("a", []uint64{4, 5})
	x.Add("a", []uint64{2})
	var sc ExportScratch
	e, v1, ok := x.ExportEndpoint("a", 0, []uint64{99}, &sc)
	if !ok || e.Endpoint != "a" || e.Capacity != 8 || !slices.Equal(e.Hashes, []uint64{99, 2, 4, 5, 1, 3}) {
		t.Fatalf("export %+v %v: want most recent first after the 99 already in dst", e, ok)
	}
	if cur, _ := x.Version("a"); cur != v1 {
		t.Errorf("version %d, export reported %d", cur, v1)
	}
	if e, _, _ := x.ExportEndpoint("a", 2, nil, &sc); !slices.Equal(e.Hashes, []uint64{2, 4}) {
		t.Errorf("limit 2: %v", e.Hashes)
	}
	if _, v, _ := x.ExportEndpoint("a", 0, nil, &sc); v != v1 {
		t.Error("exporting changed the version")
	}

	// Every change moves the version on, and a removed and re-created
	// endpoint never repeats an old one.
	seen := map[uint64]bool{v1: true}
	for i, change := range []func(){
		func() { x.Add("a", []uint64{2}) }, // reorders nothing visible, still a change
		func() { x.SetCapacity("a", 4) },
		func() { x.Import(Dump{Endpoints: []EndpointDump{{Endpoint: "a", Capacity: 4, Hashes: []uint64{7}}}}) },
		func() { x.Remove("a"); x.Add("a", []uint64{1, 2, 3}) },
	} {
		change()
		v, ok := x.Version("a")
		if !ok || seen[v] {
			t.Fatalf("change %d: version %d (known %v) repeats", i, v, ok)
		}
		seen[v] = true
	}
	x.SetCapacity("a", 8) // the re-created endpoint's capacity: no change
	if v, _ := x.Version("a"); !seen[v] {
		t.Error("setting the same capacity changed the version")
	}
}

// TestAddNeverWaits: a pick recorded while another goroutine holds the
// endpoint's lock returns at once and is recorded when the holder
// releases it; under heavy contention every pick ends up recorded.
func TestAddNeverWaits(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 1 << 16})
	x.Add("e", []uint64{1})
	ep := x.lookup("e", false)
	ep.mu.Lock() // as an export's copy would
	done := make(chan struct{})
	go func() { x.Add("e", []uint64{2, 3}); close(done) }()
	<-done // Add returned while the lock is held
	if m := hits(x, []uint64{2, 3}); m["e"] != 0 {
		t.Fatalf("deferred pick visible before the holder released the lock: %v", m)
	}
	x.unlock(ep)
	if m := hits(x, []uint64{2, 3}); m["e"] != 2 {
		t.Fatalf("deferred pick not recorded on release: %v", m)
	}
	if e, _, _ := x.ExportEndpoint("e", 0, nil, &ExportScratch{}); !slices.Equal(e.Hashes, []uint64{2, 3, 1}) {
		t.Errorf("LRU order %v, want the deferred chain most recent", e.Hashes)
	}

	// Many writers on one endpoint while an exporter and a stats reader
	// keep taking its lock: no chain is lost.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		var sc ExportScratch
		for {
			select {
			case <-stop:
				return
			default:
			}
			x.ExportEndpoint("e", 0, nil, &sc)
			_ = x.Stats()
		}
	}()
	var writers sync.WaitGroup
	for w := range 4 {
		writers.Add(1)
		go func() {
			defer writers.Done()
			for i := range 2000 {
				x.Add("e", []uint64{uint64(1000 + w*10000 + i*2), uint64(1001 + w*10000 + i*2)})
			}
		}()
	}
	writers.Wait()
	close(stop)
	wg.Wait()
	for w := range 4 {
		for i := range 2000 {
			c := []uint64{uint64(1000 + w*10000 + i*2), uint64(1001 + w*10000 + i*2)}
			if m := hits(x, c); m["e"] != 2 {
				t.Fatalf("writer %d pick %d lost: %v", w, i, m)
			}
		}
	}
	checkInvariants(t, x)
}

// TestExportDuringAdds exports endpoints while other goroutines keep
// adding to them (run with -race): every export is one consistent LRU, a
// duplicate-free list no longer than the capacity.
func TestExportDuringAdds(t *testing.T) {
	t.Parallel()
	x := NewIndex(Config{DefaultCapacity: 300})
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			chain := make([]uint64, 40)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				for k := range chain {
					chain[k] = r.Uint64N(1000)
				}
				x.Add(fmt.Sprintf("e%d", i%3), chain)
				if i%500 == 0 {
					x.Remove("e2")
				}
			}
		}()
	}
	var sc ExportScratch
	for range 300 {
		for _, name := range []string{"e0", "e1", "e2"} {
			e, _, ok := x.ExportEndpoint(name, 0, nil, &sc)
			if !ok {
				continue
			}
			if len(e.Hashes) > 300 || len(e.Hashes) != len(slices.Compact(slices.Sorted(slices.Values(e.Hashes)))) {
				t.Fatalf("%s: %d hashes, duplicates or over capacity", name, len(e.Hashes))
			}
		}
	}
	close(stop)
	wg.Wait()
	checkInvariants(t, x)
}

// --- benchmarks ---

func prompt8k(seed int) string {
	r := rand.New(rand.NewPCG(uint64(seed), 7))
	words := []string{"the ", "model ", "server ", "cache ", "prefix ", "token ", "route ", "envoy ", "picker ", "block "}
	var sb strings.Builder
	for sb.Len() < 32<<10 {
		sb.WriteString(words[r.IntN(len(words))])
	}
	return sb.String()[:32<<10]
}

func BenchmarkHash8kTokens(b *testing.B) {
	p := prompt8k(1)
	for _, maxBlocks := range []int{DefaultMaxBlocks, 512} {
		b.Run(fmt.Sprintf("maxBlocks=%d", maxBlocks), func(b *testing.B) {
			h := NewHasher(HashConfig{MaxBlocks: maxBlocks})
			dst := make([]uint64, 0, 512)
			b.SetBytes(int64(min(len(p), maxBlocks*h.BlockChars())))
			b.ReportAllocs()
			for b.Loop() {
				dst = h.Hash(dst[:0], "llama", p)
			}
		})
	}
}

// populated100 returns an index of 100 endpoints that each served 40 8k
// prompts sharing a 2k-token system prompt, plus a query prompt sharing it.
//
// Each endpoint's LRU holds 4096 blocks (less than the 5248 routed to it),
// so the index is in its steady state: every new block evicts one.
func populated100(b *testing.B) (*Index, Hasher, []string, string) {
	h := NewHasher(HashConfig{})
	x := NewIndex(Config{DefaultCapacity: 4096})
	system := prompt8k(0)[:8<<10]
	eps := make([]string, 100)
	var hs []uint64
	for i := range eps {
		eps[i] = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250)
		for j := range 40 {
			hs = h.Hash(hs[:0], "llama", system+prompt8k(i*100 + j)[8<<10:])
			x.Add(eps[i], hs)
		}
	}
	return x, h, eps, system + prompt8k(999999)[8<<10:]
}

func BenchmarkMatch100Endpoints(b *testing.B) {
	x, h, _, q := populated100(b)
	hs := h.Hash(nil, "llama", q)
	dst := make([]Hit, 0, 128)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		dst = x.Match(hs, dst[:0])
	}
	if len(dst) != 100 || dst[0].Blocks != 128 {
		b.Fatalf("unexpected hits %d %+v", len(dst), dst[0])
	}
}

// BenchmarkHashMatchInto100Endpoints is the part of a scheduling decision
// on the request's critical path: hash an 8k-token prompt and score 100
// endpoints by name.
func BenchmarkHashMatchInto100Endpoints(b *testing.B) {
	x, h, eps, q := populated100(b)
	hs := make([]uint64, 0, 512)
	out := make([]int, len(eps))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		hs = h.Hash(hs[:0], "llama", q)
		x.MatchInto(hs, eps, out)
	}
	if out[0] != 128 {
		b.Fatalf("matched %d blocks", out[0])
	}
}

// BenchmarkHashMatchAdd100Endpoints is the per-request prefix work of a
// scheduling decision: hash an 8k-token prompt, score 100 endpoints,
// record the pick.
func BenchmarkHashMatchAdd100Endpoints(b *testing.B) {
	x, h, eps, _ := populated100(b)
	system := prompt8k(0)[:8<<10]
	queries := make([]string, 64)
	for i := range queries {
		queries[i] = system + prompt8k(5000000 + i)[8<<10:]
	}
	hs := make([]uint64, 0, 512)
	out := make([]int, len(eps))
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		hs = h.Hash(hs[:0], "llama", queries[i%len(queries)])
		x.MatchInto(hs, eps, out)
		best := 0
		for j, n := range out {
			if n > out[best] {
				best = j
			}
		}
		x.Add(eps[(best+i)%len(eps)], hs)
		i++
	}
}

func BenchmarkParallelMatchAdd(b *testing.B) {
	x, h, eps, q := populated100(b)
	hs := h.Hash(nil, "llama", q)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		dst := make([]Hit, 0, 128)
		i := 0
		for pb.Next() {
			dst = x.Match(hs, dst[:0])
			x.Add(eps[i%len(eps)], hs)
			i++
		}
	})
}

// BenchmarkAddAtCapacity records 8k-token prompts (128 shared, 128 new
// blocks each) into a full LRU, so every new block evicts one.
func BenchmarkAddAtCapacity(b *testing.B) {
	h := NewHasher(HashConfig{})
	x := NewIndex(Config{DefaultCapacity: 4096})
	system := prompt8k(0)[:8<<10]
	queries := make([][]uint64, 256)
	for i := range queries {
		queries[i] = h.Hash(nil, "llama", system+prompt8k(1000 + i)[8<<10:])
	}
	for _, q := range queries {
		x.Add("ep", q) // fill: 128 + 256*128 blocks > capacity
	}
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		x.Add("ep", queries[i%len(queries)])
		i++
	}
	if st := x.Stats(); st.Entries != 4096 {
		b.Fatalf("entries %d", st.Entries)
	}
}
