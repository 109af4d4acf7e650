package kvevents

// Encoding: what an engine publishes, for the simulator (cmd/vllm-sim)
// and tests. It writes what msgspec writes for vLLM's structs in each
// Format.

// EncodeEvent is what AppendBatch needs of one event: Event's fields plus
// the extra keys themselves (the decoder keeps only their digests).
type EncodeEvent struct {
	Event
	// ExtraKeys are the stored blocks' extra-key tuples, one per block
	// (nil: the event carries none; a nil entry: that block has none).
	ExtraKeys [][]string
}

// AppendBatch appends the encoding of a batch of events in format f to dst.
func AppendBatch(dst []byte, ts float64, dpRank int, events []EncodeEvent, f Format) []byte {
	if f == FormatMap {
		dst = mpAppendMapLen(dst, 3)
		dst = mpAppendString(dst, "ts")
		dst = mpAppendFloat(dst, ts)
		dst = mpAppendString(dst, "events")
	} else {
		dst = mpAppendArrayLen(dst, 3)
		dst = mpAppendFloat(dst, ts)
	}
	dst = mpAppendArrayLen(dst, len(events))
	for i := range events {
		dst = appendEvent(dst, &events[i], f)
	}
	if f == FormatMap {
		dst = mpAppendString(dst, "data_parallel_rank")
	}
	return mpAppendInt(dst, int64(dpRank))
}

func appendEvent(b []byte, e *EncodeEvent, f Format) []byte {
	positional := f == FormatArray
	field := func(name string) {
		if !positional {
			b = mpAppendString(b, name)
		}
	}
	hashes := func() {
		b = mpAppendArrayLen(b, len(e.Hashes))
		for _, h := range e.Hashes {
			b = mpAppendUint(b, h)
		}
	}
	medium := func() {
		if e.Medium == "" {
			b = mpAppendNil(b)
		} else {
			b = mpAppendString(b, e.Medium)
		}
	}
	n := 0
	switch e.Kind {
	case BlockStored:
		n = 9
		if e.ExtraKeys != nil || positional {
			n++ // a positional event keeps extra_keys' place
		}
	case BlockRemoved:
		n = 4
	default:
		n = 1
	}
	if positional {
		b = mpAppendArrayLen(b, n)
		b = mpAppendString(b, e.Kind.String())
	} else {
		b = mpAppendMapLen(b, n)
		b = mpAppendString(b, "type")
		b = mpAppendString(b, e.Kind.String())
	}
	switch e.Kind {
	case BlockStored:
		field("block_hashes")
		hashes()
		field("parent_block_hash")
		if e.HasParent {
			b = mpAppendUint(b, e.Parent)
		} else {
			b = mpAppendNil(b)
		}
		field("token_ids")
		b = mpAppendArrayLen(b, len(e.Tokens))
		for _, t := range e.Tokens {
			b = mpAppendUint(b, uint64(t))
		}
		field("block_size")
		b = mpAppendInt(b, int64(e.BlockSize))
		field("lora_id")
		if e.HasLoRAID {
			b = mpAppendInt(b, e.LoRAID)
		} else {
			b = mpAppendNil(b)
		}
		field("medium")
		medium()
		field("lora_name")
		if e.LoRAName == "" {
			b = mpAppendNil(b)
		} else {
			b = mpAppendString(b, e.LoRAName)
		}
		if e.ExtraKeys == nil && positional {
			b = mpAppendNil(b)
		}
		if e.ExtraKeys != nil {
			field("extra_keys")
			b = mpAppendArrayLen(b, len(e.ExtraKeys))
			for _, t := range e.ExtraKeys {
				if t == nil {
					b = mpAppendNil(b)
					continue
				}
				b = mpAppendArrayLen(b, len(t))
				for _, s := range t {
					b = mpAppendString(b, s)
				}
			}
		}
		field("group_idx")
		b = mpAppendInt(b, int64(e.Group))
	case BlockRemoved:
		field("block_hashes")
		hashes()
		field("medium")
		medium()
		field("group_idx")
		b = mpAppendInt(b, int64(e.Group))
	}
	return b
}
