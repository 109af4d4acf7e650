// Package prefix owns an approximate, routing-time model of which prompt
// prefixes each model server holds in its KV cache. Prompts are cut into
// fixed-size character blocks and hashed as a chain (each block's hash
// covers its parent's), like vLLM's automatic prefix caching. An Index
// remembers, per endpoint, the block hashes recently routed to it in a
// bounded LRU and answers "how many leading blocks of this prompt does each
// endpoint likely hold" for prefix-affinity scoring.
//
// The package knows nothing about requests or scheduling: callers hash,
// Match, pick, then Add.
package prefix

import (
	"math"
	"math/bits"
)

// Defaults for HashConfig fields left zero.
const (
	DefaultBlockTokens   = 16
	DefaultCharsPerToken = 4.0
	DefaultMaxBlocks     = 256
	// DefaultSeed is fixed so hashes survive restarts (see Index.Export).
	DefaultSeed uint64 = 0x5f3759df_a2c2a1d3
)

// HashConfig says how prompts become block hashes.
type HashConfig struct {
	// BlockTokens is the model server's KV block size in tokens (vLLM's
	// cache_config_info block_size); 0 means 16.
	BlockTokens int
	// CharsPerToken approximates tokenisation; 0 means 4.
	CharsPerToken float64
	// MaxBlocks caps how many leading blocks are hashed per prompt, which
	// bounds the cost of very long prompts; 0 means 256.
	MaxBlocks int
	// Seed changes every hash; 0 means DefaultSeed.
	Seed uint64
}

// Hasher cuts prompts into chained block hashes. The zero value is not
// usable; build one with NewHasher. A Hasher is an immutable value, safe for
// concurrent use.
type Hasher struct {
	blockChars int
	maxBlocks  int
	seed       uint64
}

// NewHasher returns a Hasher for cfg, filling defaults.
func NewHasher(cfg HashConfig) Hasher {
	if cfg.BlockTokens <= 0 {
		cfg.BlockTokens = DefaultBlockTokens
	}
	if cfg.CharsPerToken <= 0 || math.IsNaN(cfg.CharsPerToken) || math.IsInf(cfg.CharsPerToken, 0) {
		cfg.CharsPerToken = DefaultCharsPerToken
	}
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = DefaultMaxBlocks
	}
	if cfg.Seed == 0 {
		cfg.Seed = DefaultSeed
	}
	bc := int(math.Round(float64(cfg.BlockTokens) * cfg.CharsPerToken))
	return Hasher{blockChars: max(bc, 1), maxBlocks: cfg.MaxBlocks, seed: cfg.Seed}
}

// BlockChars is the block size in characters (bytes).
func (h Hasher) BlockChars() int { return h.blockChars }

// MaxBlocks is the per-prompt cap on hashed blocks.
func (h Hasher) MaxBlocks() int { return h.maxBlocks }

// Fingerprint identifies the hashing scheme (algorithm version, block size,
// seed). Persisted hashes are only meaningful to a Hasher with the same
// fingerprint.
func (h Hasher) Fingerprint() uint64 {
	const version = 1
	return finish(h.seed^version, uint64(h.blockChars), 0)
}

// Hash appends to dst the chained hashes of prompt's full blocks, at most
// MaxBlocks of them, and returns the extended slice. model (the model or
// LoRA adapter name) seeds the chain, because a server caches each
// adapter's blocks separately. A partial trailing block is not hashed.
func (h Hasher) Hash(dst []uint64, model, prompt string) []uint64 {
	n := min(len(prompt)/h.blockChars, h.maxBlocks)
	if n == 0 {
		return dst
	}
	parent := blockHash(h.seed, model)
	for i := range n {
		off := i * h.blockChars
		parent = blockHash(parent, prompt[off:off+h.blockChars])
		dst = append(dst, parent)
	}
	return dst
}

// Mixing constants: odd 64-bit values with well-spread bits.
const (
	m1 uint64 = 0xa0761d6478bd642f
	m2 uint64 = 0xe7037ed1a0b428db
	m3 uint64 = 0x8ebc6af09c88c6e3
	m4 uint64 = 0x589965cc75374cc3
)

// blockHash hashes b, seeded with parent. Two lanes each absorb 8 bytes per
// step with a bijective multiply-xor-rotate round, so no input can erase
// the parent's influence; a final avalanche mixes both lanes. It is fast,
// not cryptographic: fine for cache affinity, not for adversarial inputs.
func blockHash(parent uint64, b string) uint64 {
	n := uint64(len(b))
	a := parent ^ m1
	c := bits.RotateLeft64(parent, 32) ^ m2
	for len(b) >= 16 {
		a = bits.RotateLeft64(a^(load64(b)*m3), 29) * m4
		c = bits.RotateLeft64(c^(load64(b[8:])*m4), 31) * m3
		b = b[16:]
	}
	if len(b) >= 8 {
		a = bits.RotateLeft64(a^(load64(b)*m3), 29) * m4
		b = b[8:]
	}
	var tail uint64
	for i := len(b) - 1; i >= 0; i-- {
		tail = tail<<8 | uint64(b[i])
	}
	c = bits.RotateLeft64(c^(tail*m4), 31) * m3
	return finish(a, c, n)
}

func finish(a, c, n uint64) uint64 {
	h := a ^ bits.RotateLeft64(c, 23) ^ (n * m1)
	h ^= h >> 32
	h *= m2
	h ^= h >> 29
	h *= m3
	h ^= h >> 32
	return h
}

// load64 reads 8 little-endian bytes from the start of s.
func load64(s string) uint64 {
	_ = s[7]
	return uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
		uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
}
