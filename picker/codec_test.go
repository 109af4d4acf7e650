package picker

import (
	"bytes"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// TestCodecRoundTrip marshals messages small and large through the codec,
// with the pool's buffers dirty from earlier use, and checks the bytes are
// protobuf's own and decode back, from one buffer or from many.
func TestCodecRoundTrip(t *testing.T) {
	c := newCodec()
	// Dirty every tier the test uses.
	for _, n := range []int{5000, 70000, 300000} {
		b := c.pool.Get(n)
		for i := range *b {
			(*b)[i] = 0xAA
		}
		c.pool.Put(b)
	}
	for _, size := range []int{0, 10, 5000, 64 << 10, 200 << 10} {
		body := bytes.Repeat([]byte{'x'}, size)
		msg := newStreamedChunk(true, body, true)
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		data, err := c.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		if got := data.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("%d-byte body: marshalled %d bytes differ from protobuf's %d", size, len(got), len(want))
		}
		for _, pieces := range []int{1, 3} {
			var in mem.BufferSlice
			for i := range pieces {
				in = append(in, mem.SliceBuffer(want[len(want)*i/pieces:len(want)*(i+1)/pieces]))
			}
			var back extprocv3.ProcessingResponse
			if err := c.Unmarshal(in, &back); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&back, msg) {
				t.Fatalf("%d-byte body in %d pieces: decoded message differs", size, pieces)
			}
		}
		data.Free()
	}
	if _, err := c.Marshal("not a message"); err == nil {
		t.Error("marshalled a string")
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{0xff})}, &extprocv3.ProcessingRequest{}); err == nil {
		t.Error("decoded garbage")
	}
}

func TestBufferPoolTiers(t *testing.T) {
	p := newBufferPool()
	for _, tc := range []struct{ n, cap int }{
		{1, 4 << 10}, {4 << 10, 4 << 10}, {4<<10 + 1, 8 << 10}, {200 << 10, 256 << 10}, {16 << 20, 16 << 20}, {16<<20 + 1, 16<<20 + 1},
	} {
		b := p.Get(tc.n)
		if len(*b) != tc.n || cap(*b) != tc.cap {
			t.Errorf("Get(%d): len %d cap %d, want cap %d", tc.n, len(*b), cap(*b), tc.cap)
		}
		p.Put(b)
	}
	// A buffer comes back from its tier, whatever its length was.
	b := p.Get(100 << 10)
	(*b)[0] = 42
	p.Put(b)
	if again := p.Get(70 << 10); cap(*again) != 128<<10 {
		t.Errorf("tier of 70 KiB has cap %d", cap(*again))
	}
	// Foreign buffers are not pooled.
	odd := make([]byte, 5000)
	p.Put(&odd)
	if got := p.Get(5000); cap(*got) != 8<<10 {
		t.Errorf("an odd-sized buffer was pooled: cap %d", cap(*got))
	}
}
