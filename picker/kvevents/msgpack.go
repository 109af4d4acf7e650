package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// The subset of MessagePack (https://github.com/msgpack/msgpack/blob/master/spec.md)
// the engines' event batches use, read in place: nil, booleans, integers,
// floats, strings, binaries, arrays and maps (extension values are
// skipped). Reading allocates nothing; strings and binaries alias the
// payload.

// errShort is returned when a value runs past the end of the payload.
var errShort = errors.New("msgpack: truncated value")

// mpType is the kind of a MessagePack value.
type mpType uint8

const (
	mpNil mpType = iota
	mpBool
	mpInt  // negative or small integers (int64)
	mpUint // unsigned integers that may exceed int64 (uint64)
	mpFloat
	mpStr
	mpBin
	mpArray
	mpMap
	mpExt
)

func (t mpType) String() string {
	return [...]string{"nil", "bool", "int", "uint", "float", "str", "bin", "array", "map", "ext"}[t]
}

// mpReader reads MessagePack values from b.
type mpReader struct {
	b   []byte
	off int
}

func (r *mpReader) need(n int) error {
	if n < 0 || len(r.b)-r.off < n {
		return errShort
	}
	return nil
}

// peek returns the type of the next value without consuming it.
func (r *mpReader) peek() (mpType, error) {
	if err := r.need(1); err != nil {
		return 0, err
	}
	c := r.b[r.off]
	switch {
	case c <= 0x7f, c >= 0xe0, c >= 0xd0 && c <= 0xd3:
		return mpInt, nil
	case c >= 0xcc && c <= 0xcf:
		return mpUint, nil
	case c >= 0x80 && c <= 0x8f, c == 0xde, c == 0xdf:
		return mpMap, nil
	case c >= 0x90 && c <= 0x9f, c == 0xdc, c == 0xdd:
		return mpArray, nil
	case c >= 0xa0 && c <= 0xbf, c >= 0xd9 && c <= 0xdb:
		return mpStr, nil
	case c == 0xc0:
		return mpNil, nil
	case c == 0xc2, c == 0xc3:
		return mpBool, nil
	case c >= 0xc4 && c <= 0xc6:
		return mpBin, nil
	case c == 0xca, c == 0xcb:
		return mpFloat, nil
	case c >= 0xc7 && c <= 0xc9, c >= 0xd4 && c <= 0xd8:
		return mpExt, nil
	}
	return 0, fmt.Errorf("msgpack: unknown format byte 0x%02x", c)
}

func (r *mpReader) byte1() byte {
	c := r.b[r.off]
	r.off++
	return c
}

func (r *mpReader) uintN(n int) (uint64, error) {
	if err := r.need(n); err != nil {
		return 0, err
	}
	var v uint64
	switch n {
	case 1:
		v = uint64(r.b[r.off])
	case 2:
		v = uint64(binary.BigEndian.Uint16(r.b[r.off:]))
	case 4:
		v = uint64(binary.BigEndian.Uint32(r.b[r.off:]))
	case 8:
		v = binary.BigEndian.Uint64(r.b[r.off:])
	}
	r.off += n
	return v, nil
}

// isNil consumes a nil and reports true, or consumes nothing.
func (r *mpReader) isNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// readUint64 reads any integer as its 64-bit two's complement pattern
// (a negative int64 keeps its bits), which is how a block hash is kept.
func (r *mpReader) readUint64() (uint64, error) {
	if err := r.need(1); err != nil {
		return 0, err
	}
	c := r.b[r.off]
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), nil
	case c >= 0xe0:
		r.off++
		return uint64(int64(int8(c))), nil
	}
	r.off++
	switch c {
	case 0xcc:
		return r.uintN(1)
	case 0xcd:
		return r.uintN(2)
	case 0xce:
		return r.uintN(4)
	case 0xcf:
		return r.uintN(8)
	case 0xd0:
		v, err := r.uintN(1)
		return uint64(int64(int8(v))), err
	case 0xd1:
		v, err := r.uintN(2)
		return uint64(int64(int16(v))), err
	case 0xd2:
		v, err := r.uintN(4)
		return uint64(int64(int32(v))), err
	case 0xd3:
		return r.uintN(8)
	}
	r.off--
	return 0, fmt.Errorf("msgpack: want an integer, got format byte 0x%02x", c)
}

// readInt reads an integer that must fit an int64.
func (r *mpReader) readInt() (int64, error) {
	t, err := r.peek()
	if err != nil {
		return 0, err
	}
	v, err := r.readUint64()
	if err != nil {
		return 0, err
	}
	if t == mpUint && v > math.MaxInt64 {
		return 0, fmt.Errorf("msgpack: integer %d overflows int64", v)
	}
	return int64(v), nil
}

// readFloat reads a float or an integer as a float64.
func (r *mpReader) readFloat() (float64, error) {
	if err := r.need(1); err != nil {
		return 0, err
	}
	switch r.b[r.off] {
	case 0xca:
		r.off++
		v, err := r.uintN(4)
		return float64(math.Float32frombits(uint32(v))), err
	case 0xcb:
		r.off++
		v, err := r.uintN(8)
		return math.Float64frombits(v), err
	}
	v, err := r.readInt()
	return float64(v), err
}

// readBytes reads a string or a binary; the result aliases the payload.
func (r *mpReader) readBytes() ([]byte, error) {
	if err := r.need(1); err != nil {
		return nil, err
	}
	c := r.byte1()
	var n uint64
	var err error
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = uint64(c & 0x1f)
	case c == 0xd9 || c == 0xc4:
		n, err = r.uintN(1)
	case c == 0xda || c == 0xc5:
		n, err = r.uintN(2)
	case c == 0xdb || c == 0xc6:
		n, err = r.uintN(4)
	default:
		r.off--
		return nil, fmt.Errorf("msgpack: want a string or binary, got format byte 0x%02x", c)
	}
	if err != nil {
		return nil, err
	}
	if err := r.need(int(n)); err != nil {
		return nil, err
	}
	s := r.b[r.off : r.off+int(n) : r.off+int(n)]
	r.off += int(n)
	return s, nil
}

// readString is readBytes as a string (a copy).
func (r *mpReader) readString() (string, error) {
	b, err := r.readBytes()
	return string(b), err
}

// readArrayLen reads an array header.
func (r *mpReader) readArrayLen() (int, error) {
	return r.readLen(0x90, 0xdc, 0xdd, "array")
}

// readMapLen reads a map header (the number of key/value pairs).
func (r *mpReader) readMapLen() (int, error) {
	return r.readLen(0x80, 0xde, 0xdf, "map")
}

func (r *mpReader) readLen(fix, l16, l32 byte, what string) (int, error) {
	if err := r.need(1); err != nil {
		return 0, err
	}
	c := r.byte1()
	var n uint64
	var err error
	switch {
	case c&0xf0 == fix:
		n = uint64(c & 0x0f)
	case c == l16:
		n, err = r.uintN(2)
	case c == l32:
		n, err = r.uintN(4)
	default:
		r.off--
		return 0, fmt.Errorf("msgpack: want an %s, got format byte 0x%02x", what, c)
	}
	if err != nil {
		return 0, err
	}
	// Every element takes at least one byte: a count past the payload's
	// end is corrupt, and must not size an allocation.
	if n > uint64(len(r.b)-r.off) {
		return 0, errShort
	}
	return int(n), nil
}

// skip consumes one value of any type.
func (r *mpReader) skip() error {
	t, err := r.peek()
	if err != nil {
		return err
	}
	switch t {
	case mpNil, mpBool:
		r.off++
		return nil
	case mpInt, mpUint:
		_, err = r.readUint64()
		return err
	case mpFloat:
		_, err = r.readFloat()
		return err
	case mpStr, mpBin:
		_, err = r.readBytes()
		return err
	case mpArray:
		n, err := r.readArrayLen()
		if err != nil {
			return err
		}
		for range n {
			if err := r.skip(); err != nil {
				return err
			}
		}
		return nil
	case mpMap:
		n, err := r.readMapLen()
		if err != nil {
			return err
		}
		for range 2 * n {
			if err := r.skip(); err != nil {
				return err
			}
		}
		return nil
	}
	// Extension: fixext 1/2/4/8/16 or ext 8/16/32, then a type byte.
	c := r.byte1()
	var n uint64
	switch c {
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		n = 1 << (c - 0xd4)
	case 0xc7:
		n, err = r.uintN(1)
	case 0xc8:
		n, err = r.uintN(2)
	case 0xc9:
		n, err = r.uintN(4)
	}
	if err != nil {
		return err
	}
	if err := r.need(int(n) + 1); err != nil {
		return err
	}
	r.off += int(n) + 1
	return nil
}

// The writer half: append-style encoders, the shortest form for each
// value as msgspec writes them.

func mpAppendNil(b []byte) []byte { return append(b, 0xc0) }

func mpAppendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func mpAppendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return mpAppendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func mpAppendFloat(b []byte, v float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(v))
}

func mpAppendString(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= 31:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

func mpAppendBin(b []byte, p []byte) []byte {
	n := len(p)
	switch {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xc5), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xc6), uint32(n))
	}
	return append(b, p...)
}

func mpAppendArrayLen(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func mpAppendMapLen(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}
