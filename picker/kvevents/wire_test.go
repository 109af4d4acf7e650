package kvevents

import (
	"encoding/hex"
	"os"
	"reflect"
	"strings"
	"testing"
)

func readHex(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	p, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// vLLM 0.32 (this repository's real-vLLM build) publishes positional
// batches of events as maps tagged "type"; the payloads were captured from
// it serving the tiny model: a 93-token prompt on the base model, then on
// the LoRA adapter "ad" (two full 32-token blocks each).
func TestDecodeVLLM032Payloads(t *testing.T) {
	prefix := []uint32{0, 270, 70, 222, 1984, 1983, 1981, 222, 81, 83, 80, 78, 81, 85, 1442, 296}
	for _, c := range []struct {
		file   string
		hashes []uint64
		lora   string
		loraID int64
	}{
		{"vllm-0.32-batch0.hex", []uint64{15038156178473281638, 7365179239417798033}, "", 0},
		{"vllm-0.32-batch1.hex", []uint64{7133596324815835821, 7816956141967337912}, "ad", 1},
	} {
		var b Batch
		unknown, err := DecodeBatch(readHex(t, c.file), &b)
		if err != nil || unknown != 0 {
			t.Fatalf("%s: %v (unknown %d)", c.file, err, unknown)
		}
		if b.TS < 1.7e9 || b.DPRank != 0 || len(b.Events) != 1 {
			t.Fatalf("%s: batch %+v", c.file, b)
		}
		e := b.Events[0]
		if e.Kind != BlockStored || !reflect.DeepEqual(e.Hashes, c.hashes) || e.HasParent || e.BlockSize != 32 ||
			len(e.Tokens) != 64 || !reflect.DeepEqual(e.Tokens[:16], prefix) || e.Medium != MediumGPU || e.LoRAName != c.lora || e.Group != 0 {
			t.Fatalf("%s: event %+v", c.file, e)
		}
		if c.lora == "" {
			if e.HasLoRAID || len(e.Extra) != 2 || e.Extra[0] != 0 || e.Extra[1] != 0 {
				t.Fatalf("%s: base model event has adapter data: %+v", c.file, e)
			}
			continue
		}
		// Each block's extra keys are the tuple ("ad",): the digest a
		// request for the adapter computes.
		if !e.HasLoRAID || e.LoRAID != c.loraID || len(e.Extra) != 2 || e.Extra[0] != StringsDigest("ad") || e.Extra[1] != e.Extra[0] {
			t.Fatalf("%s: adapter event %+v", c.file, e)
		}
	}
}

// Every format round-trips every event kind, with and without parents,
// adapters, media and extra keys.
func TestEncodeDecodeFormats(t *testing.T) {
	events := []EncodeEvent{
		{Event: Event{Kind: BlockStored, Hashes: []uint64{1, 1 << 63, 42}, Tokens: seqTokens(0, 12), BlockSize: 4, Medium: MediumGPU}},
		{Event: Event{Kind: BlockStored, Hashes: []uint64{7}, Parent: 42, HasParent: true, Tokens: []uint32{9, 8, 7, 1 << 20}, BlockSize: 4,
			LoRAName: "sql", LoRAID: 3, HasLoRAID: true, Medium: "CPU"}, ExtraKeys: [][]string{{"sql", "salt"}}},
		{Event: Event{Kind: BlockRemoved, Hashes: []uint64{1, 2}, Medium: MediumGPU}},
		{Event: Event{Kind: BlockRemoved, Hashes: []uint64{3}}},
		{Event: Event{Kind: AllBlocksCleared}},
	}
	for _, f := range []Format{FormatArray, FormatTagged, FormatMap} {
		t.Run(f.String(), func(t *testing.T) {
			payload := AppendBatch(nil, 1234.5, 2, events, f)
			var b Batch
			if _, err := DecodeBatch(payload, &b); err != nil {
				t.Fatal(err)
			}
			if b.TS != 1234.5 || b.DPRank != 2 || len(b.Events) != len(events) {
				t.Fatalf("batch %+v", b)
			}
			for i, want := range events {
				got := b.Events[i]
				w := want.Event
				if want.ExtraKeys != nil {
					w.Extra = []uint64{StringsDigest(want.ExtraKeys[0]...)}
				}
				normalize := func(e *Event) {
					if len(e.Hashes) == 0 {
						e.Hashes = nil
					}
					if len(e.Tokens) == 0 {
						e.Tokens = nil
					}
					if len(e.Extra) == 0 {
						e.Extra = nil
					}
				}
				normalize(&got)
				normalize(&w)
				if !reflect.DeepEqual(got, w) {
					t.Errorf("event %d:\n got %+v\nwant %+v", i, got, w)
				}
			}
		})
	}
}

func TestDecodeSkipsUnknownEvents(t *testing.T) {
	// A future event type, in both shapes, between two known ones.
	var p []byte
	p = mpAppendArrayLen(p, 3)
	p = mpAppendFloat(p, 1)
	p = mpAppendArrayLen(p, 4)
	p = appendEvent(p, &EncodeEvent{Event: Event{Kind: AllBlocksCleared}}, FormatTagged)
	p = mpAppendArrayLen(p, 2)
	p = mpAppendString(p, "BlockPinned")
	p = mpAppendArrayLen(p, 1)
	p = mpAppendUint(p, 5)
	p = mpAppendMapLen(p, 2)
	p = mpAppendString(p, "type")
	p = mpAppendString(p, "BlockPinned")
	p = mpAppendString(p, "block_hashes")
	p = mpAppendArrayLen(p, 1)
	p = mpAppendUint(p, 5)
	p = appendEvent(p, &EncodeEvent{Event: Event{Kind: BlockRemoved, Hashes: []uint64{9}}}, FormatArray)
	p = mpAppendNil(p)
	var b Batch
	unknown, err := DecodeBatch(p, &b)
	if err != nil || unknown != 2 || len(b.Events) != 2 || b.Events[0].Kind != AllBlocksCleared || b.Events[1].Kind != BlockRemoved || b.DPRank != -1 {
		t.Fatalf("unknown %d, err %v, batch %+v", unknown, err, b)
	}
}

// Malformed payloads fail the whole batch, never panic.
func TestDecodeRejectsMalformed(t *testing.T) {
	good := AppendBatch(nil, 1, 0, []EncodeEvent{{Event: Event{Kind: BlockStored, Hashes: []uint64{1}, Tokens: seqTokens(0, 4), BlockSize: 4}}}, FormatTagged)
	var b Batch
	for i := range good {
		if _, err := DecodeBatch(good[:i], &b); err == nil {
			t.Fatalf("truncated at %d of %d bytes: no error", i, len(good))
		}
	}
	for name, p := range map[string][]byte{
		"string":        mpAppendString(nil, "x"),
		"trailing":      append(append([]byte{}, good...), 0xc0),
		"no block size": AppendBatch(nil, 1, 0, []EncodeEvent{{Event: Event{Kind: BlockStored, Hashes: []uint64{1}}}}, FormatMap),
		"huge array":    {0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
	} {
		if _, err := DecodeBatch(p, &b); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add(AppendBatch(nil, 1, 0, []EncodeEvent{
		{Event: Event{Kind: BlockStored, Hashes: []uint64{1, 2}, Tokens: seqTokens(0, 8), BlockSize: 4, LoRAName: "a"}, ExtraKeys: [][]string{{"a"}, nil}},
		{Event: Event{Kind: BlockRemoved, Hashes: []uint64{1}}},
	}, FormatArray))
	f.Add(AppendBatch(nil, 1, 0, []EncodeEvent{{Event: Event{Kind: AllBlocksCleared}}}, FormatMap))
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		if _, err := DecodeBatch(p, &b); err != nil {
			return
		}
		// What decodes applies without panicking.
		x := NewIndex()
		x.Server("s").Apply(&b, testNow)
	})
}

func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}
