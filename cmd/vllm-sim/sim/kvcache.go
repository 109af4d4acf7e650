package sim

import (
	"encoding/binary"
	"hash/fnv"
)

// block is one KV-cache block of blockSize token slots.
type block struct {
	id     int
	ref    int    // running requests using this block
	hash   uint64 // content hash, valid when cached
	cached bool   // registered in kvCache.byHash
	// free-queue links; a block is in the free queue iff ref == 0.
	prev, next *block
	inFree     bool
	// aheadFresh: in the free queue ahead of the never-used blocks.
	aheadFresh bool
}

// kvCache manages the GPU KV blocks as vLLM's block pool does: a free
// queue in eviction order (taken from the head; freed cached blocks are
// appended at the tail, freed blocks without a hash put at the head, to
// be reused first) and, with prefix caching, a map from chained block
// hash to the blocks holding that content (vLLM does not deduplicate:
// two requests that compute one prefix at once cache it twice; lookups
// take the first). A block with ref 0 that is still cached can be reused
// by a later request with the same prefix until it is evicted. With
// events on, every change to the cached set is recorded as vLLM
// publishes it (see KVEvent).
//
// Blocks are allocated when first used: the never-used ones (fresh)
// stand in the free queue, in id order, where they would in a queue built
// up front (behind the blocks pushed to its head, ahead of those appended
// at its tail), so an idle engine with a large cache costs no memory (a
// fleet of simulators in one process stays small).
type kvCache struct {
	blockSize     int
	prefixCaching bool
	total         int     // usable blocks: all but the null block
	fresh         int     // blocks never used yet
	slab          []block // where the next fresh block is allocated
	head, tail    *block  // free queue of used blocks
	ahead         int     // queued blocks ahead of the fresh ones (at the head)
	numFree       int     // fresh plus queued
	byHash        map[uint64][]*block
	// events, when non-nil, collects the KV events of the current step.
	events *[]KVEvent
}

// slabBlocks is how many blocks are allocated at a time.
const slabBlocks = 1024

// KVEventKind is the type of a KVEvent.
type KVEventKind uint8

// The KV events vLLM publishes.
const (
	// KVStored: a run of full blocks entered the prefix cache.
	KVStored KVEventKind = iota + 1
	// KVRemoved: a cached block was evicted.
	KVRemoved
	// KVCleared: the prefix cache was reset.
	KVCleared
)

// KVEvent is one change to the cached blocks, as vLLM's BlockStored,
// BlockRemoved and AllBlocksCleared describe it.
type KVEvent struct {
	Kind KVEventKind
	// Hashes are the blocks' chained hashes; Parent the hash of the block
	// the stored run follows (HasParent false for a prompt's first).
	Hashes    []uint64
	Parent    uint64
	HasParent bool
	// Tokens are the stored blocks' tokens; LoRA the adapter they were
	// computed with ("" the base model).
	Tokens []uint32
	LoRA   string
}

func (c *kvCache) emit(ev KVEvent) {
	if c.events != nil {
		*c.events = append(*c.events, ev)
	}
}

// newKVCache returns a cache of numBlocks blocks, block 0 of which is
// vLLM's null block: never allocated, not counted in the usage (vLLM's
// usage is 1 - free/(num_gpu_blocks - 1)).
func newKVCache(numBlocks, blockSize int, prefixCaching, events bool) *kvCache {
	usable := max(numBlocks-1, 0)
	c := &kvCache{
		blockSize:     blockSize,
		prefixCaching: prefixCaching,
		total:         usable,
		fresh:         usable,
		numFree:       usable,
		byHash:        make(map[uint64][]*block),
	}
	if events {
		c.events = new([]KVEvent)
	}
	return c
}

func (c *kvCache) pushFree(b *block) {
	b.inFree = true
	b.prev, b.next = c.tail, nil
	if c.tail != nil {
		c.tail.next = b
	} else {
		c.head = b
	}
	c.tail = b
	c.numFree++
}

// pushFreeFront puts b at the head of the free queue: reused first,
// before any never-used block.
func (c *kvCache) pushFreeFront(b *block) {
	b.inFree = true
	if c.fresh > 0 {
		b.aheadFresh = true
		c.ahead++
	}
	b.prev, b.next = nil, c.head
	if c.head != nil {
		c.head.prev = b
	} else {
		c.tail = b
	}
	c.head = b
	c.numFree++
}

func (c *kvCache) removeFree(b *block) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		c.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		c.tail = b.prev
	}
	if b.aheadFresh {
		b.aheadFresh = false
		c.ahead--
	}
	b.prev, b.next, b.inFree = nil, nil, false
	c.numFree--
}

// popFree takes the least recently freed block, evicting its cached content.
func (c *kvCache) popFree() *block {
	if c.fresh > 0 && c.ahead == 0 {
		if len(c.slab) == cap(c.slab) {
			// A new slab; blocks of the old ones stay where they are.
			c.slab = make([]block, 0, min(slabBlocks, c.fresh))
		}
		c.slab = append(c.slab, block{id: c.total - c.fresh + 1, ref: 1})
		c.fresh--
		c.numFree--
		return &c.slab[len(c.slab)-1]
	}
	b := c.head
	c.removeFree(b)
	if b.cached {
		c.uncache(b)
		c.emit(KVEvent{Kind: KVRemoved, Hashes: []uint64{b.hash}})
	}
	b.ref = 1
	return b
}

// uncache removes b from the hash map.
func (c *kvCache) uncache(b *block) {
	list := c.byHash[b.hash]
	for i, o := range list {
		if o == b {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(c.byHash, b.hash)
	} else {
		c.byHash[b.hash] = list
	}
	b.cached = false
}

// reset drops every cached hash, as vLLM's reset_prefix_cache: it fails
// (false) while any block is in use.
func (c *kvCache) reset() bool {
	if c.numFree != c.total {
		return false
	}
	for _, list := range c.byHash {
		for _, b := range list {
			b.cached = false
		}
	}
	clear(c.byHash)
	c.emit(KVEvent{Kind: KVCleared})
	return true
}

// capacity is how many blocks requests can use (the null block aside).
func (c *kvCache) capacity() int { return c.total }

// usage is the fraction of usable blocks not in the free queue.
func (c *kvCache) usage() float64 {
	if c.total == 0 {
		return 0
	}
	return 1 - float64(c.numFree)/float64(c.total)
}

// blocksFor is the number of blocks needed to hold n tokens.
func (c *kvCache) blocksFor(n int) int {
	return (n + c.blockSize - 1) / c.blockSize
}

// chainHash returns the hash of a full block: it covers the parent block's
// hash and the block's tokens, so equal hashes mean equal whole prefixes.
func chainHash(parent uint64, toks []uint32) uint64 {
	h := fnv.New64a()
	var buf [8]byte
	binary.LittleEndian.PutUint64(buf[:], parent)
	_, _ = h.Write(buf[:])
	for _, t := range toks {
		binary.LittleEndian.PutUint32(buf[:4], t)
		_, _ = h.Write(buf[:4])
	}
	return h.Sum64()
}

// seedHash is the parent hash of a request's first block; adapters get
// different seeds so a LoRA never reuses the base model's KV (as in vLLM,
// where the adapter is part of the block key).
func seedHash(lora string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("lora:"))
	_, _ = h.Write([]byte(lora))
	return h.Sum64()
}

// extendHashes makes sure s.hashes holds the chained hash of every full
// block of s.tokens.
func (c *kvCache) extendHashes(s *seq) {
	full := len(s.tokens) / c.blockSize
	for i := len(s.hashes); i < full; i++ {
		parent := seedHash(s.lora)
		if i > 0 {
			parent = s.hashes[i-1]
		}
		s.hashes = append(s.hashes, chainHash(parent, s.tokens[i*c.blockSize:(i+1)*c.blockSize]))
	}
}

// lookup returns the longest run of cached blocks matching s's prefix,
// leaving at least the last token to be computed.
func (c *kvCache) lookup(s *seq) []*block {
	if !c.prefixCaching {
		return nil
	}
	c.extendHashes(s)
	maxBlocks := (len(s.tokens) - 1) / c.blockSize
	var hits []*block
	for i := 0; i < maxBlocks && i < len(s.hashes); i++ {
		list := c.byHash[s.hashes[i]]
		if len(list) == 0 {
			break
		}
		hits = append(hits, list[0])
	}
	return hits
}

// admit gives a waiting request its cached prefix blocks plus fresh blocks
// for numTokens tokens in total. It returns false (changing nothing) when
// there are not enough free blocks.
func (c *kvCache) admit(s *seq, hits []*block, numTokens int) bool {
	need := c.blocksFor(numTokens) - len(hits)
	evictableHits := 0
	for _, b := range hits {
		if b.ref == 0 {
			evictableHits++
		}
	}
	if need+evictableHits > c.numFree {
		return false
	}
	for _, b := range hits {
		if b.ref == 0 {
			c.removeFree(b)
		}
		b.ref++
	}
	s.blocks = append(s.blocks[:0], hits...)
	s.numCachedBlocks = len(hits)
	for range need {
		s.blocks = append(s.blocks, c.popFree())
	}
	return true
}

// grow makes room for numTokens tokens in a running request; false when
// there are not enough free blocks.
func (c *kvCache) grow(s *seq, numTokens int) bool {
	need := c.blocksFor(numTokens) - len(s.blocks)
	if need <= 0 {
		return true
	}
	if need > c.numFree {
		return false
	}
	for range need {
		s.blocks = append(s.blocks, c.popFree())
	}
	return true
}

// commit registers every block of s that became full (all its tokens
// computed) in the prefix cache.
func (c *kvCache) commit(s *seq) {
	if !c.prefixCaching {
		return
	}
	full := s.numComputed / c.blockSize
	if full <= s.numCachedBlocks {
		return
	}
	c.extendHashes(s)
	ev := KVEvent{Kind: KVStored, LoRA: s.lora}
	if s.numCachedBlocks > 0 {
		ev.Parent, ev.HasParent = s.hashes[s.numCachedBlocks-1], true
	}
	for i := s.numCachedBlocks; i < full; i++ {
		b := s.blocks[i]
		if b.cached {
			continue
		}
		h := s.hashes[i]
		b.hash, b.cached = h, true
		c.byHash[h] = append(c.byHash[h], b)
		ev.Hashes = append(ev.Hashes, h)
	}
	if len(ev.Hashes) > 0 && c.events != nil {
		ev.Tokens = append([]uint32(nil), s.tokens[s.numCachedBlocks*c.blockSize:full*c.blockSize]...)
		c.emit(ev)
	}
	s.numCachedBlocks = full
}

// release returns s's blocks, last block first so a request's tail is
// evicted before its (more shareable) head; blocks without a hash go to
// the head of the queue, reused before any cached block (vLLM's
// free_blocks).
func (c *kvCache) release(s *seq) {
	c.releaseBlocks(s.blocks)
	s.blocks = s.blocks[:0]
	s.numCachedBlocks = 0
}

// releaseBlocks drops one reference to each block, last block first; a
// block freed without a hash goes to the head of the free queue.
func (c *kvCache) releaseBlocks(blocks []*block) {
	var uncached []*block
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		b.ref--
		if b.ref != 0 {
			continue
		}
		if b.cached {
			c.pushFree(b)
		} else {
			uncached = append(uncached, b)
		}
	}
	for i := len(uncached) - 1; i >= 0; i-- {
		c.pushFreeFront(uncached[i])
	}
}
