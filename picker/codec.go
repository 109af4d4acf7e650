package picker

import (
	"fmt"
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// codec is the ext_proc server's gRPC codec: protobuf like gRPC's default
// one, with buffers from its own pool. gRPC's default pool rounds a
// 200 KiB message up to a 1 MiB buffer and zeroes all of it on every Get,
// for every request body received (materialised for proto.Unmarshal) and
// every body chunk streamed back (marshalled): a third of the CPU of a
// 200 KiB exchange went to clearing memory that was then overwritten.
// Marshalling writes every byte it sends and unmarshalling reads only the
// bytes copied in, so this pool's power-of-two buffers are reused as they
// are.
type codec struct {
	pool *bufferPool
}

func newCodec() codec { return codec{pool: newBufferPool()} }

// Name is the content-subtype gRPC negotiates: this replaces "proto".
func (codec) Name() string { return "proto" }

// Marshal implements encoding.CodecV2.
func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal: %T is not a proto.Message", v)
	}
	// UseCachedSize is safe right after Size, on a message nobody mutates
	// meanwhile (gRPC's own codec relies on the same).
	size := proto.Size(m)
	opts := proto.MarshalOptions{UseCachedSize: true}
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := opts.Marshal(m)
		if err != nil {
			return nil, fmt.Errorf("marshal %T: %w", v, err)
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	}
	buf := c.pool.Get(size)
	b, err := opts.MarshalAppend((*buf)[:0], m)
	if err != nil {
		c.pool.Put(buf)
		return nil, fmt.Errorf("marshal %T: %w", v, err)
	}
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, c.pool)}, nil
}

// Unmarshal implements encoding.CodecV2. A message that arrived in one
// buffer is decoded in place; a larger one is gathered into a pooled
// buffer first (proto.Unmarshal copies what it keeps, so the buffer goes
// straight back).
func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal: %T is not a proto.Message", v)
	}
	if len(data) == 1 {
		return proto.Unmarshal(data[0].ReadOnlyData(), m)
	}
	buf := c.pool.Get(data.Len())
	data.CopyTo(*buf)
	err := proto.Unmarshal(*buf, m)
	c.pool.Put(buf)
	return err
}

// Pooled buffer sizes: powers of two from 4 KiB to 16 MiB. Larger messages
// (bodies close to MaxBodyBytes) are allocated and left to the collector.
const (
	minPoolShift = 12
	maxPoolShift = 24
)

// bufferPool is a mem.BufferPool of power-of-two buffers that are not
// cleared between uses: every user here overwrites what it reads.
type bufferPool struct {
	tiers [maxPoolShift - minPoolShift + 1]sync.Pool // tier i holds 1<<(minPoolShift+i) byte buffers
}

func newBufferPool() *bufferPool { return &bufferPool{} }

// Get returns a buffer of length n, its contents undefined.
func (p *bufferPool) Get(n int) *[]byte {
	shift := max(bits.Len(uint(max(n, 1)-1)), minPoolShift)
	if shift > maxPoolShift {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.tiers[shift-minPoolShift].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<shift)
	return &b
}

// Put returns a buffer obtained from Get (or a prefix of one).
func (p *bufferPool) Put(b *[]byte) {
	c := cap(*b)
	if c < 1<<minPoolShift || c > 1<<maxPoolShift || c&(c-1) != 0 {
		return // not one of ours
	}
	p.tiers[bits.Len(uint(c))-1-minPoolShift].Put(b)
}
