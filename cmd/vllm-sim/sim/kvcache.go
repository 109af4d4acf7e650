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
}

// kvCache manages the GPU KV blocks: a free queue in LRU order (evicted from
// the head, freed blocks appended at the tail) and, with prefix caching, a
// map from chained block hash to the block holding that content. A block
// with ref 0 that is still cached can be reused by a later request with the
// same prefix until it is evicted.
//
// Blocks are allocated when first used: the never-used ones (fresh) head
// the free queue, in id order, as they would in a queue built up front,
// so an idle engine with a large cache costs no memory (a fleet of
// simulators in one process stays small).
type kvCache struct {
	blockSize     int
	prefixCaching bool
	total         int
	fresh         int     // blocks never used yet, ahead of the queue
	slab          []block // where the next fresh block is allocated
	head, tail    *block  // free queue of used blocks
	numFree       int     // fresh plus queued
	byHash        map[uint64]*block
}

// slabBlocks is how many blocks are allocated at a time.
const slabBlocks = 1024

func newKVCache(numBlocks, blockSize int, prefixCaching bool) *kvCache {
	return &kvCache{
		blockSize:     blockSize,
		prefixCaching: prefixCaching,
		total:         numBlocks,
		fresh:         numBlocks,
		numFree:       numBlocks,
		byHash:        make(map[uint64]*block),
	}
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
	b.prev, b.next, b.inFree = nil, nil, false
	c.numFree--
}

// popFree takes the least recently freed block, evicting its cached content.
func (c *kvCache) popFree() *block {
	if c.fresh > 0 {
		if len(c.slab) == cap(c.slab) {
			// A new slab; blocks of the old ones stay where they are.
			c.slab = make([]block, 0, min(slabBlocks, c.fresh))
		}
		c.slab = append(c.slab, block{id: c.total - c.fresh, ref: 1})
		c.fresh--
		c.numFree--
		return &c.slab[len(c.slab)-1]
	}
	b := c.head
	c.removeFree(b)
	if b.cached {
		if c.byHash[b.hash] == b {
			delete(c.byHash, b.hash)
		}
		b.cached = false
	}
	b.ref = 1
	return b
}

// usage is the fraction of blocks not in the free queue.
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
		b, ok := c.byHash[s.hashes[i]]
		if !ok {
			break
		}
		hits = append(hits, b)
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
	for i := s.numCachedBlocks; i < full; i++ {
		b := s.blocks[i]
		h := s.hashes[i]
		if _, dup := c.byHash[h]; !dup && !b.cached {
			b.hash, b.cached = h, true
			c.byHash[h] = b
		}
	}
	s.numCachedBlocks = full
}

// release returns s's blocks, last block first so a request's tail is
// evicted before its (more shareable) head.
func (c *kvCache) release(s *seq) {
	for i := len(s.blocks) - 1; i >= 0; i-- {
		b := s.blocks[i]
		b.ref--
		if b.ref == 0 {
			c.pushFree(b)
		}
	}
	s.blocks = s.blocks[:0]
	s.numCachedBlocks = 0
}
