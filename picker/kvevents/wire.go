package kvevents

import (
	"errors"
	"fmt"
	"hash/maphash"
	"math"
)

// Kind is the type of a KV-cache event.
type Kind uint8

// The event kinds vLLM (and SGLang) publish.
const (
	// BlockStored: a run of full blocks, each chained on the one before,
	// entered the prefix cache.
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks left the prefix cache (evicted).
	BlockRemoved
	// AllBlocksCleared: the whole prefix cache was reset (vLLM's
	// /reset_prefix_cache, or a weight update).
	AllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// MediumGPU is the medium of blocks in the engine's own KV cache; an event
// without a medium means it too.
const MediumGPU = "GPU"

// Event is one decoded KV-cache event.
type Event struct {
	Kind Kind
	// Hashes are the engine's block hashes (BlockStored, BlockRemoved):
	// 64-bit integers as published (vLLM's default), or a 64-bit digest of
	// a byte-string hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
	Hashes []uint64
	// Parent is the hash of the block the run chains on; HasParent is
	// false for a run starting at a prompt's first block.
	Parent    uint64
	HasParent bool
	// Tokens are the token ids of the stored blocks, BlockSize per block.
	Tokens    []uint32
	BlockSize int
	// LoRAName names the adapter the blocks were computed with ("" the
	// base model); LoRAID is vLLM's deprecated numeric adapter id
	// (HasLoRAID false when null).
	LoRAName  string
	LoRAID    int64
	HasLoRAID bool
	// Medium is where the blocks live ("GPU", "CPU", ...; "" unspecified,
	// which means GPU).
	Medium string
	// Extra holds, per stored block, a digest of the extra keys the
	// engine's block hash covers (adapter name, cache salt, multimodal
	// identifiers); nil when the event carries none (older engines). A
	// zero entry means the block has none.
	Extra []uint64
	// Group is the KV-cache group (hybrid models); 0 for plain attention.
	Group int
}

// IsGPU reports whether the event's blocks are in the engine's own KV
// cache (medium "GPU" or unspecified).
func (e *Event) IsGPU() bool { return e.Medium == "" || e.Medium == MediumGPU }

// Batch is one published message: the events of one engine step.
type Batch struct {
	// TS is the engine's wall clock when the batch was made (Unix seconds).
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank that published it (-1: unset).
	DPRank int
}

// Format selects how a batch is encoded. vLLM has used three: positional
// arrays throughout (before PR 42892), positional batches of events as maps
// tagged "type" (vLLM 0.32), and maps throughout; a decoder accepts all.
type Format uint8

const (
	// FormatArray: [ts, [event...], dp_rank], each event
	// ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
	// lora_name, extra_keys, group_idx].
	FormatArray Format = iota
	// FormatTagged: [ts, [event...], dp_rank], each event a map whose
	// "type" key names it (vLLM 0.32's msgspec tagged structs).
	FormatTagged
	// FormatMap: {"ts", "events", "data_parallel_rank"} with events as in
	// FormatTagged.
	FormatMap
)

// ParseFormat reads a format name: "array", "tagged" or "map".
func ParseFormat(s string) (Format, error) {
	switch s {
	case "array":
		return FormatArray, nil
	case "tagged":
		return FormatTagged, nil
	case "map":
		return FormatMap, nil
	}
	return 0, fmt.Errorf("unknown KV-events format %q: want \"array\", \"tagged\" or \"map\"", s)
}

func (f Format) String() string {
	switch f {
	case FormatArray:
		return "array"
	case FormatTagged:
		return "tagged"
	case FormatMap:
		return "map"
	}
	return fmt.Sprintf("Format(%d)", uint8(f))
}

// ErrUnknownEvent marks an event whose tag the decoder does not know; the
// batch's other events are still decoded (see DecodeBatch).
var ErrUnknownEvent = errors.New("unknown event type")

// DecodeBatch decodes a published payload in any Format into b, reusing
// b's slices. Events of an unknown type are skipped and counted in
// unknown; any other malformation fails the whole batch (its events must
// not be half applied).
func DecodeBatch(payload []byte, b *Batch) (unknown int, err error) {
	r := mpReader{b: payload}
	b.TS, b.DPRank = 0, -1
	events := b.Events[:0]
	defer func() { b.Events = events }()
	t, err := r.peek()
	if err != nil {
		return 0, fmt.Errorf("batch: %w", err)
	}
	readEvents := func() error {
		n, err := r.readArrayLen()
		if err != nil {
			return fmt.Errorf("batch events: %w", err)
		}
		for i := range n {
			if cap(events) > len(events) {
				events = events[:len(events)+1]
			} else {
				events = append(events, Event{})
			}
			e := &events[len(events)-1]
			if err := decodeEvent(&r, e); err != nil {
				if errors.Is(err, ErrUnknownEvent) {
					unknown++
					events = events[:len(events)-1]
					continue
				}
				return fmt.Errorf("batch event %d: %w", i, err)
			}
		}
		return nil
	}
	readRank := func() error {
		if r.isNil() {
			return nil
		}
		v, err := r.readInt()
		if err != nil {
			return fmt.Errorf("batch data_parallel_rank: %w", err)
		}
		b.DPRank = int(v)
		return nil
	}
	switch t {
	case mpArray:
		n, _ := r.readArrayLen()
		if n < 2 {
			return 0, fmt.Errorf("batch: array of %d elements, want at least 2", n)
		}
		if b.TS, err = r.readFloat(); err != nil {
			return 0, fmt.Errorf("batch ts: %w", err)
		}
		if err := readEvents(); err != nil {
			return unknown, err
		}
		if n >= 3 {
			if err := readRank(); err != nil {
				return unknown, err
			}
		}
		for range n - 3 {
			if err := r.skip(); err != nil {
				return unknown, fmt.Errorf("batch: %w", err)
			}
		}
	case mpMap:
		n, _ := r.readMapLen()
		sawEvents := false
		for range n {
			k, err := r.readBytes()
			if err != nil {
				return unknown, fmt.Errorf("batch key: %w", err)
			}
			switch string(k) {
			case "ts":
				if b.TS, err = r.readFloat(); err != nil {
					return unknown, fmt.Errorf("batch ts: %w", err)
				}
			case "events":
				sawEvents = true
				if err := readEvents(); err != nil {
					return unknown, err
				}
			case "data_parallel_rank", "attn_dp_rank":
				if err := readRank(); err != nil {
					return unknown, err
				}
			default:
				if err := r.skip(); err != nil {
					return unknown, fmt.Errorf("batch %s: %w", k, err)
				}
			}
		}
		if !sawEvents {
			return unknown, errors.New("batch: map without events")
		}
	default:
		return 0, fmt.Errorf("batch: want an array or a map, got %v", t)
	}
	if r.off != len(r.b) {
		return unknown, fmt.Errorf("batch: %d trailing bytes", len(r.b)-r.off)
	}
	return unknown, nil
}

// eventFields are BlockStored's positional fields after the tag, in
// order; BlockRemoved's are hashes, medium, group.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

// decodeEvent reads one event, positional or tagged map, into e.
func decodeEvent(r *mpReader, e *Event) error {
	*e = Event{Hashes: e.Hashes[:0], Tokens: e.Tokens[:0], Extra: e.Extra[:0]}
	t, err := r.peek()
	if err != nil {
		return err
	}
	switch t {
	case mpArray:
		n, _ := r.readArrayLen()
		if n == 0 {
			return errors.New("empty event array")
		}
		tag, err := r.readBytes()
		if err != nil {
			return fmt.Errorf("event tag: %w", err)
		}
		e.Kind = kindOf(tag)
		var fields []string
		switch e.Kind {
		case BlockStored:
			fields = storedFields
		case BlockRemoved:
			fields = removedFields
		case 0:
			for range n - 1 {
				if err := r.skip(); err != nil {
					return err
				}
			}
			return fmt.Errorf("%w %q", ErrUnknownEvent, tag)
		}
		for i := 1; i < n; i++ {
			name := ""
			if i-1 < len(fields) {
				name = fields[i-1]
			}
			if err := decodeField(r, e, name); err != nil {
				return err
			}
		}
	case mpMap:
		n, _ := r.readMapLen()
		// Fields decode the same whatever the kind, so they are read in
		// the map's order; the tag need not come first.
		for i := range n {
			k, err := r.readBytes()
			if err != nil {
				return fmt.Errorf("event key: %w", err)
			}
			if string(k) != "type" {
				if err := decodeField(r, e, string(k)); err != nil {
					return err
				}
				continue
			}
			tag, err := r.readBytes()
			if err != nil {
				return fmt.Errorf("event type: %w", err)
			}
			if e.Kind = kindOf(tag); e.Kind == 0 {
				for range 2 * (n - i - 1) {
					if err := r.skip(); err != nil {
						return err
					}
				}
				return fmt.Errorf("%w %q", ErrUnknownEvent, tag)
			}
		}
		if e.Kind == 0 {
			return errors.New("event map without a type")
		}
	default:
		return fmt.Errorf("event: want an array or a map, got %v", t)
	}
	return e.check()
}

// decodeField reads the value of the field called name into e; unknown
// fields are skipped.
func decodeField(r *mpReader, e *Event, name string) error {
	var err error
	switch name {
	case "block_hashes":
		var n int
		if n, err = r.readArrayLen(); err != nil {
			return fmt.Errorf("block_hashes: %w", err)
		}
		for range n {
			h, err := readHash(r)
			if err != nil {
				return fmt.Errorf("block_hashes: %w", err)
			}
			e.Hashes = append(e.Hashes, h)
		}
	case "parent_block_hash":
		if r.isNil() {
			e.HasParent = false
			return nil
		}
		if e.Parent, err = readHash(r); err != nil {
			return fmt.Errorf("parent_block_hash: %w", err)
		}
		e.HasParent = true
	case "token_ids":
		var n int
		if n, err = r.readArrayLen(); err != nil {
			return fmt.Errorf("token_ids: %w", err)
		}
		for range n {
			v, err := r.readInt()
			if err != nil || v < 0 || v > math.MaxUint32 {
				return fmt.Errorf("token_ids: bad token id (%v)", err)
			}
			e.Tokens = append(e.Tokens, uint32(v))
		}
	case "block_size":
		v, err := r.readInt()
		if err != nil || v <= 0 || v > 1<<20 {
			return fmt.Errorf("block_size: bad value (%v)", err)
		}
		e.BlockSize = int(v)
	case "lora_id":
		if r.isNil() {
			return nil
		}
		if e.LoRAID, err = r.readInt(); err != nil {
			return fmt.Errorf("lora_id: %w", err)
		}
		e.HasLoRAID = true
	case "lora_name":
		if r.isNil() {
			return nil
		}
		if e.LoRAName, err = r.readString(); err != nil {
			return fmt.Errorf("lora_name: %w", err)
		}
	case "medium":
		if r.isNil() {
			return nil
		}
		b, err := r.readBytes()
		if err != nil {
			return fmt.Errorf("medium: %w", err)
		}
		if string(b) != MediumGPU { // the common case allocates nothing
			e.Medium = string(b)
		} else {
			e.Medium = MediumGPU
		}
	case "extra_keys":
		if r.isNil() {
			return nil
		}
		var n int
		if n, err = r.readArrayLen(); err != nil {
			return fmt.Errorf("extra_keys: %w", err)
		}
		for range n {
			d, err := extraDigestOf(r)
			if err != nil {
				return fmt.Errorf("extra_keys: %w", err)
			}
			e.Extra = append(e.Extra, d)
		}
	case "group_idx":
		if r.isNil() {
			return nil
		}
		v, err := r.readInt()
		if err != nil {
			return fmt.Errorf("group_idx: %w", err)
		}
		e.Group = int(v)
	default:
		if err := r.skip(); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

// check validates a decoded event's shape.
func (e *Event) check() error {
	if e.Kind != BlockStored {
		return nil
	}
	if e.BlockSize <= 0 {
		return errors.New("BlockStored without a block size")
	}
	if len(e.Extra) > 0 && len(e.Extra) != len(e.Hashes) {
		return fmt.Errorf("BlockStored with %d extra keys for %d blocks", len(e.Extra), len(e.Hashes))
	}
	return nil
}

// hashSeed digests byte-string block hashes; fixed within the process,
// which is the only place such digests are compared.
var hashSeed = maphash.MakeSeed()

// readHash reads a block hash: an integer, or a byte string folded to 64
// bits.
func readHash(r *mpReader) (uint64, error) {
	t, err := r.peek()
	if err != nil {
		return 0, err
	}
	if t == mpBin || t == mpStr {
		b, err := r.readBytes()
		if err != nil {
			return 0, err
		}
		return maphash.Bytes(hashSeed, b), nil
	}
	return r.readUint64()
}
