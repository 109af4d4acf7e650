package kvevents

import (
	"encoding/binary"
	"math"
	"math/bits"
)

// Block keys: the router's own names for an engine's cache blocks.
//
// An engine's block hash cannot be recomputed by the router (vLLM hashes
// a serialisation of its own objects, and older versions seed it per
// process), so every stored block is re-keyed from what its BlockStored
// event carries: its tokens, the key of its parent and a digest of its
// extra keys (LoRA adapter, cache salt, ...). A request's prompt, once
// tokenized the way the engine tokenizes it, is keyed the same way, so a
// key names the same tokens at the same place behind the same prefix on
// every server of a pool. Keys are deterministic (fixed constants), so
// they mean the same in every replica and across restarts.

// rootKey is the parent of a prompt's first block.
const rootKey uint64 = 0x243f6a8885a308d3

// Mixing constants (odd, well spread).
const (
	k1 uint64 = 0x9e3779b97f4a7c15
	k2 uint64 = 0xbf58476d1ce4e5b9
	k3 uint64 = 0x94d049bb133111eb
	k4 uint64 = 0xd6e8feb86659fd93
)

// blockKey keys one full block of tokens chained on parent, with extra the
// digest of the block's extra keys (0: none). Two lanes absorb two tokens
// per step with a bijective multiply-rotate round, so no token can cancel
// the parent; a final avalanche mixes them. Fast, not cryptographic.
func blockKey(parent, extra uint64, tokens []uint32) uint64 {
	a := parent ^ k1
	c := bits.RotateLeft64(parent, 29) ^ extra ^ k2
	i := 0
	for ; i+4 <= len(tokens); i += 4 {
		a = bits.RotateLeft64(a^((uint64(tokens[i])|uint64(tokens[i+1])<<32)*k3), 31) * k4
		c = bits.RotateLeft64(c^((uint64(tokens[i+2])|uint64(tokens[i+3])<<32)*k4), 27) * k3
	}
	for ; i < len(tokens); i++ {
		a = bits.RotateLeft64(a^(uint64(tokens[i])*k3), 31) * k4
	}
	return finalize(a ^ bits.RotateLeft64(c, 17) ^ uint64(len(tokens))*k1)
}

func finalize(h uint64) uint64 {
	h ^= h >> 30
	h *= k2
	h ^= h >> 27
	h *= k3
	h ^= h >> 31
	return h
}

// AppendKeys appends to dst the keys of tokens' full blocks of blockSize,
// at most maxBlocks of them (<= 0: all), each block's extra digest taken
// from extra(i) (nil: none), and returns the extended slice.
func AppendKeys(dst []uint64, tokens []uint32, blockSize, maxBlocks int, extra func(block int) uint64) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	if maxBlocks > 0 {
		n = min(n, maxBlocks)
	}
	parent := rootKey
	for i := range n {
		var x uint64
		if extra != nil {
			x = extra(i)
		}
		parent = blockKey(parent, x, tokens[i*blockSize:(i+1)*blockSize])
		dst = append(dst, parent)
	}
	return dst
}

// Extra-key digests. vLLM publishes, per stored block, the extra keys its
// block hash covers as a tuple of untagged values: the adapter name (every
// block of an adapter's request), (multimodal identifier, offset) pairs,
// the cache salt (the first block only) and prompt-embedding digests. The
// digest walks that tuple; the router builds the same from a request
// (RequestExtra).

const (
	tagNil   = 'n'
	tagStr   = 's'
	tagBin   = 'b'
	tagInt   = 'i'
	tagFloat = 'f'
	tagBool  = 't'
	tagArray = 'a'
	tagMap   = 'm'
)

type digest struct{ h uint64 }

func newDigest() digest { return digest{h: 0x13198a2e03707344} }

func (d *digest) byte1(c byte) {
	d.h = (d.h ^ uint64(c)) * 0x100000001b3
}

func (d *digest) word(v uint64) {
	d.h = finalize(d.h ^ v*k1 ^ bits.RotateLeft64(d.h, 23))
}

func (d *digest) bytes(tag byte, b []byte) {
	d.byte1(tag)
	d.word(uint64(len(b)))
	for len(b) >= 8 {
		d.word(binary.LittleEndian.Uint64(b))
		b = b[8:]
	}
	var tail uint64
	for i := len(b) - 1; i >= 0; i-- {
		tail = tail<<8 | uint64(b[i])
	}
	d.word(tail)
}

func (d *digest) sum() uint64 {
	if d.h == 0 {
		return 1 // 0 means "no extra keys"
	}
	return d.h
}

// extraDigestOf reads one entry of a BlockStored's extra_keys (nil or a
// tuple) and returns its digest (0 for nil or an empty tuple).
func extraDigestOf(r *mpReader) (uint64, error) {
	if r.isNil() {
		return 0, nil
	}
	n, err := r.readArrayLen()
	if err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, nil
	}
	d := newDigest()
	d.byte1(tagArray)
	d.word(uint64(n))
	for range n {
		if err := digestValue(r, &d); err != nil {
			return 0, err
		}
	}
	return d.sum(), nil
}

// digestValue feeds one MessagePack value into d.
func digestValue(r *mpReader, d *digest) error {
	t, err := r.peek()
	if err != nil {
		return err
	}
	switch t {
	case mpNil:
		r.off++
		d.byte1(tagNil)
	case mpBool:
		d.byte1(tagBool)
		d.byte1(r.byte1())
	case mpInt, mpUint:
		v, err := r.readUint64()
		if err != nil {
			return err
		}
		d.byte1(tagInt)
		d.word(v)
	case mpFloat:
		v, err := r.readFloat()
		if err != nil {
			return err
		}
		d.byte1(tagFloat)
		d.word(math.Float64bits(v))
	case mpStr:
		b, err := r.readBytes()
		if err != nil {
			return err
		}
		d.bytes(tagStr, b)
	case mpBin:
		b, err := r.readBytes()
		if err != nil {
			return err
		}
		d.bytes(tagBin, b)
	case mpArray:
		n, err := r.readArrayLen()
		if err != nil {
			return err
		}
		d.byte1(tagArray)
		d.word(uint64(n))
		for range n {
			if err := digestValue(r, d); err != nil {
				return err
			}
		}
	case mpMap:
		n, err := r.readMapLen()
		if err != nil {
			return err
		}
		d.byte1(tagMap)
		d.word(uint64(n))
		for range 2 * n {
			if err := digestValue(r, d); err != nil {
				return err
			}
		}
	default:
		return r.skip()
	}
	return nil
}

// StringsDigest is the digest of an extra-keys tuple of strings, as a
// BlockStored carries it (extraDigestOf); none gives 0.
func StringsDigest(items ...string) uint64 {
	if len(items) == 0 {
		return 0
	}
	d := newDigest()
	d.byte1(tagArray)
	d.word(uint64(len(items)))
	for _, s := range items {
		d.bytes(tagStr, []byte(s))
	}
	return d.sum()
}

// RequestExtra returns the per-block extra-key digests of a request for
// adapter (the LoRA adapter's name, "" for the base model) with cache salt
// salt ("" none), as vLLM computes them: the adapter on every block, the
// salt on the first. The result suits AppendKeys.
func RequestExtra(adapter, salt string) func(block int) uint64 {
	switch {
	case adapter == "" && salt == "":
		return nil
	case salt == "":
		d := StringsDigest(adapter)
		return func(int) uint64 { return d }
	}
	first := StringsDigest(salt)
	rest := uint64(0)
	if adapter != "" {
		first = StringsDigest(adapter, salt)
		rest = StringsDigest(adapter)
	}
	return func(i int) uint64 {
		if i == 0 {
			return first
		}
		return rest
	}
}

// legacyExtra is the digest a BlockStored without extra_keys stands for:
// older engines put only the adapter into the block hash, by name, or by
// its numeric id before names were published (which no request can
// match: such adapters' blocks are tracked but never matched).
func legacyExtra(e *Event) uint64 {
	switch {
	case e.LoRAName != "":
		return StringsDigest(e.LoRAName)
	case e.HasLoRAID:
		d := newDigest()
		d.bytes(tagStr, []byte("lora-id"))
		d.word(uint64(e.LoRAID))
		return d.sum()
	}
	return 0
}
