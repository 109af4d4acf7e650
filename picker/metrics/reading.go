package metrics

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
)

// Reading's binary form, what one replica sends the others (picker/peers
// carries it as opaque bytes, with the reading's time). Version 1:
//
//	byte 1 (version), byte flags (1 failed, 2 models, 4 TTFT histogram)
//	uvarint interval ns, uvarint cost ns, uvarint page bytes, byte filter
//	failed: string error
//	else:   varint waiting, varint running, f64 KV usage,
//	        uvarint block size, uvarint blocks, uvarint max LoRAs,
//	        strings running adapters, strings waiting adapters,
//	        strings missing,
//	        uvarint n, n x (f64 sum, f64 count) histograms (HistKind order),
//	        TTFT: uvarint n, n x f64 bounds, n x f64 cumulative, f64 count,
//	        f64 sum
//	models: strings
//	string: uvarint length, bytes; strings: uvarint n, n x string;
//	f64: 8 bytes little-endian IEEE 754
//
// A reader ignores bytes after these (fields a later version appends)
// and histogram kinds it does not know; a new version number is for a
// change old readers cannot skip.
const (
	readingVersion = 1

	readingFailed = 1
	readingModels = 2
	readingTTFT   = 4

	maxReadingString  = 1 << 16
	maxReadingStrings = 1 << 14
	maxReadingBounds  = 1 << 10
)

// AppendBinary appends r's binary form (without At, which the carrier
// sends relative to its own clock) to b.
func (r Reading) AppendBinary(b []byte) ([]byte, error) {
	flags := byte(0)
	if r.Err != "" {
		flags |= readingFailed
	}
	if r.Models != nil {
		flags |= readingModels
	}
	if r.Err == "" && r.Values.TTFT != nil {
		flags |= readingTTFT
	}
	b = append(b, readingVersion, flags)
	b = binary.AppendUvarint(b, uint64(max(r.Interval, 0)))
	b = binary.AppendUvarint(b, uint64(max(r.Cost, 0)))
	b = binary.AppendUvarint(b, uint64(max(r.PageBytes, 0)))
	b = append(b, byte(r.Filter))
	if r.Err != "" {
		b = appendStr(b, r.Err)
	} else {
		v := &r.Values
		b = binary.AppendVarint(b, int64(v.Waiting))
		b = binary.AppendVarint(b, int64(v.Running))
		b = appendF64(b, v.KVUsage)
		b = binary.AppendUvarint(b, uint64(max(v.BlockSize, 0)))
		b = binary.AppendUvarint(b, uint64(max(v.NumBlocks, 0)))
		b = binary.AppendUvarint(b, uint64(max(v.MaxLoras, 0)))
		b = appendStrs(b, v.RunningAdapters)
		b = appendStrs(b, v.WaitingAdapters)
		b = appendStrs(b, v.Missing)
		b = binary.AppendUvarint(b, uint64(NumHists))
		for _, h := range v.Hists {
			b = appendF64(appendF64(b, h.Sum), h.Count)
		}
		if h := v.TTFT; h != nil {
			if len(h.Cumulative) != len(h.Bounds) {
				return b, errors.New("TTFT histogram with bounds and buckets of different lengths")
			}
			b = binary.AppendUvarint(b, uint64(len(h.Bounds)))
			for _, x := range h.Bounds {
				b = appendF64(b, x)
			}
			for _, x := range h.Cumulative {
				b = appendF64(b, x)
			}
			b = appendF64(appendF64(b, h.Count), h.Sum)
		}
	}
	if r.Models != nil {
		b = appendStrs(b, r.Models)
	}
	return b, nil
}

// UnmarshalBinary sets r from its binary form (At is left as it is).
func (r *Reading) UnmarshalBinary(b []byte) error {
	d := &decoder{b: b}
	if v := d.byte(); d.err == nil && v != readingVersion {
		return fmt.Errorf("reading version %d, want %d", v, readingVersion)
	}
	flags := d.byte()
	out := Reading{At: r.At}
	out.Interval = time.Duration(min(d.uvarint(), math.MaxInt64))
	out.Cost = time.Duration(min(d.uvarint(), math.MaxInt64))
	out.PageBytes = int(min(d.uvarint(), math.MaxInt32))
	out.Filter = FilterState(d.byte())
	if out.Filter > FilterRejected {
		out.Filter = FilterUnknown
	}
	if flags&readingFailed != 0 {
		out.Err = d.str()
		if d.err == nil && out.Err == "" {
			d.fail(errors.New("failed reading without an error"))
		}
	} else {
		v := &out.Values
		v.Waiting = int(d.varint())
		v.Running = int(d.varint())
		v.KVUsage = d.f64()
		v.BlockSize = int(min(d.uvarint(), math.MaxInt32))
		v.NumBlocks = int(min(d.uvarint(), math.MaxInt32))
		v.MaxLoras = int(min(d.uvarint(), math.MaxInt32))
		v.RunningAdapters = d.strs()
		v.WaitingAdapters = d.strs()
		v.Missing = d.strs()
		n := d.uvarint()
		if d.err == nil && n > maxReadingBounds {
			d.fail(fmt.Errorf("reading with %d histograms", n))
		}
		for i := uint64(0); i < n && d.err == nil; i++ {
			sum, count := d.f64(), d.f64()
			if i < uint64(NumHists) {
				v.Hists[i] = Hist{Sum: sum, Count: count}
			}
		}
		if flags&readingTTFT != 0 {
			nb := d.uvarint()
			if d.err == nil && (nb > maxReadingBounds || nb*16 > uint64(len(d.b))) {
				d.fail(fmt.Errorf("TTFT histogram with %d buckets", nb))
			}
			if d.err == nil {
				h := &Histogram{Bounds: make([]float64, nb), Cumulative: make([]float64, nb)}
				for i := range h.Bounds {
					h.Bounds[i] = d.f64()
				}
				for i := range h.Cumulative {
					h.Cumulative[i] = d.f64()
				}
				h.Count, h.Sum = d.f64(), d.f64()
				v.TTFT = h
			}
		}
	}
	if flags&readingModels != 0 {
		out.Models = d.strs()
		if out.Models == nil && d.err == nil {
			out.Models = []string{}
		}
	}
	if d.err != nil {
		return fmt.Errorf("reading: %w", d.err)
	}
	*r = out
	return nil
}

func appendStr(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendStrs(b []byte, ss []string) []byte {
	b = binary.AppendUvarint(b, uint64(len(ss)))
	for _, s := range ss {
		b = appendStr(b, s)
	}
	return b
}

func appendF64(b []byte, x float64) []byte {
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(x))
}

var errTruncated = errors.New("truncated")

// decoder reads the binary form, remembering the first error.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

func (d *decoder) byte() byte {
	if d.err != nil || len(d.b) == 0 {
		d.fail(errTruncated)
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail(errTruncated)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail(errTruncated)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) f64() float64 {
	if d.err != nil || len(d.b) < 8 {
		d.fail(errTruncated)
		return 0
	}
	x := math.Float64frombits(binary.LittleEndian.Uint64(d.b))
	d.b = d.b[8:]
	return x
}

func (d *decoder) str() string {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n > maxReadingString || n > uint64(len(d.b)) {
		d.fail(fmt.Errorf("string of %d bytes", n))
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// strs returns nil for an empty list.
func (d *decoder) strs() []string {
	n := d.uvarint()
	if d.err == nil && (n > maxReadingStrings || n > uint64(len(d.b))) {
		d.fail(fmt.Errorf("list of %d strings", n))
	}
	if d.err != nil || n == 0 {
		return nil
	}
	out := make([]string, 0, n)
	for i := uint64(0); i < n && d.err == nil; i++ {
		out = append(out, d.str())
	}
	return out
}
