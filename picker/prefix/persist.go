package prefix

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sort"
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

// Export copies every endpoint's LRU in order (most recent first). Each
// endpoint is copied under its own lock; the dump is consistent per
// endpoint, not across endpoints.
func (x *Index) Export(fingerprint uint64) Dump {
	t := x.table.Load()
	d := Dump{Fingerprint: fingerprint, Endpoints: make([]EndpointDump, 0, len(t.byName))}
	for name, ep := range t.byName {
		ep.mu.Lock()
		if !ep.removed {
			e := EndpointDump{Endpoint: name, Capacity: ep.capacity, Hashes: make([]uint64, 0, ep.slots.n)}
			for s := ep.head; s >= 0; s = ep.nodes[s].next {
				e.Hashes = append(e.Hashes, ep.nodes[s].hash)
			}
			d.Endpoints = append(d.Endpoints, e)
		}
		ep.mu.Unlock()
	}
	sort.Slice(d.Endpoints, func(i, j int) bool { return d.Endpoints[i].Endpoint < d.Endpoints[j].Endpoint })
	return d
}

// Import loads a Dump into the Index: each dumped endpoint gets the dumped
// capacity, and its hashes become its most recent entries in the dumped
// order. Endpoints not in the dump are untouched.
func (x *Index) Import(d Dump) {
	for _, e := range d.Endpoints {
		x.SetCapacity(e.Endpoint, e.Capacity)
		for {
			ep := x.lookup(e.Endpoint, true)
			if ep == nil {
				return
			}
			ep.mu.Lock()
			if ep.removed {
				ep.mu.Unlock()
				continue
			}
			// Least recent first, so the first dumped hash ends up most recent.
			for i := len(e.Hashes) - 1; i >= 0; i-- {
				x.touch(ep, e.Hashes[i])
			}
			ep.mu.Unlock()
			break
		}
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
	n := 4 + 1 + 8 + binary.MaxVarintLen64
	for _, e := range d.Endpoints {
		n += 3*binary.MaxVarintLen64 + len(e.Endpoint) + 8*len(e.Hashes)
	}
	b := make([]byte, 0, n)
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
