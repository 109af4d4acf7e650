package sim

import (
	"slices"
	"testing"
)

// Blocks are allocated when first used, yet the free queue keeps vLLM's
// order: a block freed without a hash is reused before any never-used
// block, a freed cached one only after them. Block 0 is the null block,
// never handed out.
func TestFreeQueueOrderWithLazyBlocks(t *testing.T) {
	t.Parallel()
	c := newKVCache(5, 16, true, true)
	b0, b1 := c.popFree(), c.popFree()
	if b0.id != 1 || b1.id != 2 || c.numFree != 2 {
		t.Fatalf("first blocks %d, %d, %d free; want 1, 2, 2", b0.id, b1.id, c.numFree)
	}
	b1.hash, b1.cached = 42, true
	c.byHash[42] = []*block{b1}
	c.releaseBlocks([]*block{b0, b1})
	if c.numFree != 4 || c.usage() != 0 {
		t.Fatalf("after release: %d free, usage %v", c.numFree, c.usage())
	}
	var order []int
	for range 4 {
		order = append(order, c.popFree().id)
	}
	if want := []int{1, 3, 4, 2}; !slices.Equal(order, want) {
		t.Errorf("reuse order %v, want %v (unhashed, never used, cached)", order, want)
	}
	if len(c.byHash) != 0 || b1.cached {
		t.Errorf("the cached block was reused but is still cached")
	}
	if evs := *c.events; len(evs) != 1 || evs[0].Kind != KVRemoved || evs[0].Hashes[0] != 42 {
		t.Errorf("events %+v, want one removal of 42", evs)
	}
}

// reset clears the prefix cache only while no block is in use, and then
// every cached block, allocated lazily or not.
func TestResetWithLazyBlocks(t *testing.T) {
	t.Parallel()
	c := newKVCache(8, 16, true, false)
	b := c.popFree()
	b.hash, b.cached = 7, true
	c.byHash[7] = []*block{b}
	if c.reset() {
		t.Fatal("reset while a block is in use")
	}
	c.releaseBlocks([]*block{b})
	if !c.reset() || b.cached || len(c.byHash) != 0 {
		t.Fatalf("reset of an idle cache: cached %v, %d hashes", b.cached, len(c.byHash))
	}
}
