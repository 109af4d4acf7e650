package peers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"
)

// Pick is one replica's routing decision, as the other replicas learn it:
// which endpoint of which pool got a request, its estimated prompt tokens,
// and the prompt's prefix-block hashes (so the others' prefix indexes learn
// where the prompt is now cached). ID is unique per sender and stream.
type Pick struct {
	ID       uint64
	Pool     string
	Endpoint string
	Tokens   int64
	Hashes   []uint64
	// Session is the request's session key ("" none), so a conversation
	// keeps its endpoint whichever replica sees the next turn.
	Session string
}

// event is one message element: a pick, or the end of one (Pick with only
// ID set and done true).
type event struct {
	pick Pick
	done bool
}

// Wire format (version 1). Every message is a protobuf BytesValue whose
// bytes are:
//
//	hello (first message of a stream): 0x00, uvarint version, string sender
//	batch: 0x01, varint unix-nanos sent, uvarint count, events
//	event: 0x01 pick: uvarint id, string pool, string endpoint,
//	       varint tokens, uvarint n, n x 8-byte little-endian hashes,
//	       string session
//	       0x02 done: uvarint id
//	string: uvarint length, bytes
//	report (the answer to Ask): 0x02, string id, byte ready (0 or 1),
//	       uvarint n, n x (string type, string version); a reader
//	       ignores bytes after them (fields added later)
const (
	wireVersion = 1

	msgHello  = 0x00
	msgBatch  = 0x01
	msgReport = 0x02

	evPick = 0x01
	evDone = 0x02

	// maxHashes bounds one pick's hashes (a 2M-token prompt in 16-token
	// blocks); maxString bounds names.
	maxHashes = 1 << 17
	maxString = 4096
	maxEvents = 1 << 16
)

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func encodeHello(sender string) []byte {
	b := []byte{msgHello}
	b = binary.AppendUvarint(b, wireVersion)
	return appendString(b, sender)
}

func encodeBatch(b []byte, sent time.Time, evs []event) []byte {
	b = append(b, msgBatch)
	b = binary.AppendVarint(b, sent.UnixNano())
	b = binary.AppendUvarint(b, uint64(len(evs)))
	for _, e := range evs {
		if e.done {
			b = append(b, evDone)
			b = binary.AppendUvarint(b, e.pick.ID)
			continue
		}
		p := e.pick
		b = append(b, evPick)
		b = binary.AppendUvarint(b, p.ID)
		b = appendString(b, p.Pool)
		b = appendString(b, p.Endpoint)
		b = binary.AppendVarint(b, p.Tokens)
		b = binary.AppendUvarint(b, uint64(len(p.Hashes)))
		for _, h := range p.Hashes {
			b = binary.LittleEndian.AppendUint64(b, h)
		}
		b = appendString(b, p.Session)
	}
	return b
}

var errShort = errors.New("peers: message truncated")

// reader decodes the wire format, remembering the first error.
type reader struct {
	b   []byte
	err error
}

func (r *reader) byte() byte {
	if r.err != nil || len(r.b) == 0 {
		r.fail(errShort)
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(errShort)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail(errShort)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) string() string {
	n := r.uvarint()
	if r.err != nil {
		return ""
	}
	if n > maxString || n > uint64(len(r.b)) {
		r.fail(fmt.Errorf("peers: string of %d bytes", n))
		return ""
	}
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *reader) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}

// decodeHello returns the sender of a stream's first message.
func decodeHello(b []byte) (string, error) {
	r := &reader{b: b}
	if r.byte() != msgHello {
		return "", errors.New("peers: stream does not start with hello")
	}
	if v := r.uvarint(); r.err == nil && v != wireVersion {
		return "", fmt.Errorf("peers: wire version %d, want %d", v, wireVersion)
	}
	s := r.string()
	if r.err == nil && len(r.b) != 0 {
		r.fail(errors.New("peers: trailing bytes after hello"))
	}
	return s, r.err
}

// decodeBatch returns a batch's send time and events, appending to evs.
func decodeBatch(b []byte, evs []event) (time.Time, []event, error) {
	r := &reader{b: b}
	if r.byte() != msgBatch {
		return time.Time{}, evs, errors.New("peers: not a batch")
	}
	sent := time.Unix(0, r.varint())
	n := r.uvarint()
	if r.err == nil && n > maxEvents {
		r.fail(fmt.Errorf("peers: batch of %d events", n))
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		switch r.byte() {
		case evDone:
			evs = append(evs, event{pick: Pick{ID: r.uvarint()}, done: true})
		case evPick:
			var p Pick
			p.ID = r.uvarint()
			p.Pool = r.string()
			p.Endpoint = r.string()
			p.Tokens = r.varint()
			nh := r.uvarint()
			if r.err == nil && (nh > maxHashes || nh*8 > uint64(len(r.b))) {
				r.fail(fmt.Errorf("peers: pick with %d hashes", nh))
			}
			if r.err == nil && nh > 0 {
				p.Hashes = make([]uint64, nh)
				for j := range p.Hashes {
					p.Hashes[j] = binary.LittleEndian.Uint64(r.b[8*j:])
				}
				r.b = r.b[8*nh:]
			}
			p.Session = r.string()
			evs = append(evs, event{pick: p})
		default:
			r.fail(errors.New("peers: unknown event"))
		}
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail(errors.New("peers: trailing bytes after batch"))
	}
	return sent, evs, r.err
}

func encodeReport(r Report) []byte {
	b := []byte{msgReport}
	b = appendString(b, r.ID)
	ready := byte(0)
	if r.Ready {
		ready = 1
	}
	b = append(b, ready)
	b = binary.AppendUvarint(b, uint64(len(r.Versions)))
	for _, k := range slices.Sorted(maps.Keys(r.Versions)) {
		b = appendString(b, k)
		b = appendString(b, r.Versions[k])
	}
	return b
}

// maxVersions bounds a report's versions (xDS has a handful of types).
const maxVersions = 64

// decodeReport returns the Report encoded in b.
func decodeReport(b []byte) (Report, error) {
	r := &reader{b: b}
	if r.byte() != msgReport {
		return Report{}, errors.New("peers: not a report")
	}
	var rep Report
	rep.ID = r.string()
	rep.Ready = r.byte() == 1
	n := r.uvarint()
	if r.err == nil && n > maxVersions {
		r.fail(fmt.Errorf("peers: report with %d versions", n))
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		if rep.Versions == nil {
			rep.Versions = map[string]string{}
		}
		k := r.string()
		rep.Versions[k] = r.string()
	}
	if r.err != nil {
		return Report{}, r.err
	}
	return rep, nil
}
