package prefix

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
)

// EndpointDump is one endpoint's LRU, most recently used hash first.
type EndpointDump struct {
	Endpoint string
	Capacity int
	Hashes   []uint64
}

// Dump is a serialisable copy of an Index. Fingerprint should be the
// Hasher's (Hasher.Fingerprint), so a reader can reject hashes made with a
// different scheme.
type Dump struct {
	Fingerprint uint64
	Endpoints   []EndpointDump // sorted by Endpoint
}

// Export copies every endpoint's LRU in order (most recent first), each
// one as ExportEndpoint does: the dump is consistent per endpoint, not
// across endpoints.
func (x *Index) Export(fingerprint uint64) Dump {
	names := x.Endpoints()
	d := Dump{Fingerprint: fingerprint, Endpoints: make([]EndpointDump, 0, len(names))}
	var sc ExportScratch
	for _, name := range names {
		if e, _, ok := x.ExportEndpoint(name, 0, nil, &sc); ok {
			d.Endpoints = append(d.Endpoints, e)
		}
	}
	return d
}

// ExportScratch is memory ExportEndpoint reuses between calls; the zero
// value is ready. One scratch serves one goroutine at a time.
type ExportScratch struct {
	nodes []lruNode
}

// Version returns a number that changes whenever endpoint's LRU changes
// (its entries, their order or its capacity), and false for an endpoint
// the Index does not track. Versions are unique within the Index across
// endpoints and time, so an exporter can skip endpoints whose version it
// already exported.
func (x *Index) Version(endpoint string) (uint64, bool) {
	ep := x.lookup(endpoint, false)
	if ep == nil {
		return 0, false
	}
	return ep.version.Load(), true
}

// ExportEndpoint appends endpoint's most recently used limit hashes (all
// when limit <= 0), most recent first, to hashes and returns them in an
// EndpointDump with the endpoint's capacity and version (see Version);
// false for an unknown endpoint. The endpoint's lock is held only while
// its slot array is copied into sc (one memmove), never for the walk in
// LRU order, which follows the copy's links; picks recorded meanwhile do
// not wait for it (see Add) and are not in this copy.
func (x *Index) ExportEndpoint(endpoint string, limit int, hashes []uint64, sc *ExportScratch) (EndpointDump, uint64, bool) {
	ep := x.lookup(endpoint, false)
	if ep == nil {
		return EndpointDump{}, 0, false
	}
	var (
		head, capacity, n int
		version           uint64
	)
	for {
		ep.mu.Lock()
		if ep.removed {
			x.unlock(ep)
			return EndpointDump{}, 0, false
		}
		if size := len(ep.nodes); cap(sc.nodes) < size {
			x.unlock(ep) // allocate outside the lock, then copy
			sc.nodes = make([]lruNode, 0, size+size/8)
			continue
		}
		sc.nodes = append(sc.nodes[:0], ep.nodes...)
		head, capacity, n, version = int(ep.head), ep.capacity, ep.slots.n, ep.version.Load()
		x.unlock(ep)
		break
	}

	if limit > 0 {
		n = min(n, limit)
	}
	hashes = slices.Grow(hashes, n)
	nodes := sc.nodes
	for s := int32(head); s >= 0 && n > 0; s = nodes[s].next {
		hashes = append(hashes, nodes[s].hash)
		n--
	}
	return EndpointDump{Endpoint: endpoint, Capacity: capacity, Hashes: hashes}, version, true
}

// Import loads a Dump into the Index: each dumped endpoint gets the dumped
// capacity, and its hashes become its most recent entries in the dumped
// order. Endpoints not in the dump are untouched.
func (x *Index) Import(d Dump) {
	for _, e := range d.Endpoints {
		x.SetCapacity(e.Endpoint, e.Capacity)
		// Least recent first, so the first dumped hash ends up most recent.
		x.Add(e.Endpoint, e.Hashes)
	}
}

var dumpMagic = [4]byte{'S', 'Y', 'P', 'X'}

const dumpVersion = 1

// ErrBadDump is returned for data that is not a valid encoded Dump.
var ErrBadDump = errors.New("invalid prefix index dump")

// MarshalBinary encodes d as: magic "SYPX", version byte, fingerprint
// (8 bytes LE), endpoint count, then per endpoint its name, capacity, hash
// count (uvarints) and hashes (8 bytes LE each).
func (d Dump) MarshalBinary() ([]byte, error) {
	return d.AppendBinary(make([]byte, 0, d.BinarySize()))
}

// BinarySize is an upper bound of the encoding's length.
func (d Dump) BinarySize() int {
	n := 4 + 1 + 8 + binary.MaxVarintLen64
	for _, e := range d.Endpoints {
		n += 3*binary.MaxVarintLen64 + len(e.Endpoint) + 8*len(e.Hashes)
	}
	return n
}

// AppendBinary appends MarshalBinary's encoding of d to b.
func (d Dump) AppendBinary(b []byte) ([]byte, error) {
	b = slices.Grow(b, d.BinarySize())
	b = append(b, dumpMagic[:]...)
	b = append(b, dumpVersion)
	b = binary.LittleEndian.AppendUint64(b, d.Fingerprint)
	b = binary.AppendUvarint(b, uint64(len(d.Endpoints)))
	for _, e := range d.Endpoints {
		b = binary.AppendUvarint(b, uint64(len(e.Endpoint)))
		b = append(b, e.Endpoint...)
		b = binary.AppendUvarint(b, uint64(max(e.Capacity, 0)))
		b = binary.AppendUvarint(b, uint64(len(e.Hashes)))
		for _, h := range e.Hashes {
			b = binary.LittleEndian.AppendUint64(b, h)
		}
	}
	return b, nil
}

// UnmarshalBinary decodes what MarshalBinary produced.
func (d *Dump) UnmarshalBinary(data []byte) error {
	dd, err := ReadDump(bufio.NewReader(&sliceReader{b: data}))
	if err != nil {
		return err
	}
	*d = dd
	return nil
}

type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// Limits that keep a corrupt dump from allocating without bound.
const (
	maxDumpName   = 4096
	maxDumpHashes = 1 << 24
)

// ReadDump decodes one Dump from r.
func ReadDump(r io.ByteReader) (Dump, error) {
	var d Dump
	fail := func(what string, err error) (Dump, error) {
		if err == nil || errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return Dump{}, fmt.Errorf("%w: %s: %w", ErrBadDump, what, err)
	}
	var hdr [13]byte
	for i := range hdr {
		c, err := r.ReadByte()
		if err != nil {
			return fail("header", err)
		}
		hdr[i] = c
	}
	if [4]byte(hdr[:4]) != dumpMagic {
		return Dump{}, fmt.Errorf("%w: bad magic %q", ErrBadDump, hdr[:4])
	}
	if hdr[4] != dumpVersion {
		return Dump{}, fmt.Errorf("%w: unsupported version %d", ErrBadDump, hdr[4])
	}
	d.Fingerprint = binary.LittleEndian.Uint64(hdr[5:])
	count, err := binary.ReadUvarint(r)
	if err != nil {
		return fail("endpoint count", err)
	}
	if count > MaxEndpoints {
		return Dump{}, fmt.Errorf("%w: %d endpoints", ErrBadDump, count)
	}
	for i := uint64(0); i < count; i++ {
		var e EndpointDump
		nl, err := binary.ReadUvarint(r)
		if err != nil {
			return fail("name length", err)
		}
		if nl > maxDumpName {
			return Dump{}, fmt.Errorf("%w: name of %d bytes", ErrBadDump, nl)
		}
		name := make([]byte, nl)
		for j := range name {
			if name[j], err = r.ReadByte(); err != nil {
				return fail("name", err)
			}
		}
		e.Endpoint = string(name)
		c, err := binary.ReadUvarint(r)
		if err != nil {
			return fail("capacity", err)
		}
		e.Capacity = int(min(c, uint64(DefaultMaxCapacity)*64))
		hn, err := binary.ReadUvarint(r)
		if err != nil {
			return fail("hash count", err)
		}
		if hn > maxDumpHashes {
			return Dump{}, fmt.Errorf("%w: %d hashes", ErrBadDump, hn)
		}
		e.Hashes = make([]uint64, 0, min(hn, 1<<16))
		var buf [8]byte
		for j := uint64(0); j < hn; j++ {
			for k := range buf {
				if buf[k], err = r.ReadByte(); err != nil {
					return fail("hashes", err)
				}
			}
			e.Hashes = append(e.Hashes, binary.LittleEndian.Uint64(buf[:]))
		}
		d.Endpoints = append(d.Endpoints, e)
	}
	return d, nil
}
