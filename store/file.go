package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
)

// bbolt's on-disk meta page, as documented by its file format: a 16-byte
// page header, then magic, version, page size, flags (uint32 each), the
// root bucket (root page id, sequence), the freelist page id, the page
// high-water mark, the transaction id (uint64 each) and an FNV-64a checksum
// of everything before it, in the machine's byte order. Page 0 and page 1
// hold the two alternating copies.
const (
	boltMagic        = 0xED0CDAED
	boltVersion      = 2
	boltPageHeader   = 16
	boltMetaSize     = 64
	boltChecksumOff  = 56
	boltNoFreelist   = ^uint64(0)
	minBoltPageSize  = 512
	maxBoltPageSize  = 1 << 20
	boltMetaReadSize = boltPageHeader + boltMetaSize
)

type boltMeta struct {
	pageSize uint32
	root     uint64
	freelist uint64
	pgid     uint64
	txid     uint64
}

// readBoltMeta reads and verifies the meta page at off.
func readBoltMeta(f *os.File, off int64) (boltMeta, error) {
	buf := make([]byte, boltMetaReadSize)
	if _, err := f.ReadAt(buf, off); err != nil {
		if errors.Is(err, io.EOF) {
			return boltMeta{}, errors.New("file ends before the meta page")
		}
		return boltMeta{}, err
	}
	m := buf[boltPageHeader:]
	ne := binary.NativeEndian
	if ne.Uint32(m[0:]) != boltMagic {
		return boltMeta{}, errors.New("no bbolt magic number")
	}
	if v := ne.Uint32(m[4:]); v != boltVersion {
		return boltMeta{}, fmt.Errorf("bbolt format version %d, want %d", v, boltVersion)
	}
	h := fnv.New64a()
	h.Write(m[:boltChecksumOff])
	if h.Sum64() != ne.Uint64(m[boltChecksumOff:]) {
		return boltMeta{}, errors.New("meta page checksum mismatch")
	}
	return boltMeta{
		pageSize: ne.Uint32(m[8:]),
		root:     ne.Uint64(m[16:]),
		freelist: ne.Uint64(m[32:]),
		pgid:     ne.Uint64(m[40:]),
		txid:     ne.Uint64(m[48:]),
	}, nil
}

// checkHeader reports why f (of the given size) cannot be a healthy bbolt
// file, or nil. It catches what would otherwise crash bbolt while mapping
// the file: garbage, a foreign format, truncation.
func checkHeader(f *os.File, size int64) error {
	m0, err0 := readBoltMeta(f, 0)
	off1 := int64(os.Getpagesize())
	if err0 == nil {
		off1 = int64(m0.pageSize)
	}
	m1, err1 := readBoltMeta(f, off1)
	var m boltMeta
	switch {
	case err0 != nil && err1 != nil:
		return fmt.Errorf("not a bbolt database: meta page 0: %v; meta page 1: %v", err0, err1)
	case err0 != nil:
		m = m1
	case err1 != nil:
		m = m0
	case m1.txid > m0.txid:
		m = m1
	default:
		m = m0
	}
	if m.pageSize < minBoltPageSize || m.pageSize > maxBoltPageSize || m.pageSize&(m.pageSize-1) != 0 {
		return fmt.Errorf("bbolt meta page has implausible page size %d", m.pageSize)
	}
	if m.pgid < 4 || m.root >= m.pgid || (m.freelist >= m.pgid && m.freelist != boltNoFreelist) {
		return fmt.Errorf("bbolt meta page is inconsistent (root %d, freelist %d, high-water %d)", m.root, m.freelist, m.pgid)
	}
	if need := int64(m.pgid) * int64(m.pageSize); size < need {
		return fmt.Errorf("file is truncated: bbolt needs %d bytes, file has %d", need, size)
	}
	return nil
}

// guard runs fn, turning panics and memory faults (a bbolt page that points
// past the end of a damaged file) into errors.
func guard(fn func() error) (err error) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("damaged file: %v", r)
		}
	}()
	return fn()
}

// syncDir fsyncs the directory holding path so a rename survives a crash.
func syncDir(path string) {
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return
	}
	_ = d.Sync()
	_ = d.Close()
}
