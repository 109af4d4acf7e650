package peers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
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

// Reading is one endpoint's metrics reading, made by the replica that
// reads the endpoint for the others: when it was read and what it found
// (picker/metrics' binary form of its Reading; opaque here).
type Reading struct {
	Pool, Endpoint string
	// At is when the page was read, on the clock of the process holding
	// the Reading: a receiver gets it as the sender's age of the reading
	// when it sent it, counted back from its own arrival time, so the
	// hosts' clocks need not agree (the transit counts as no time).
	At   time.Time
	Data []byte
}

// shareView is what a replica that shares readings announces on its
// streams, again every heartbeat: whether it reads endpoints for the
// others, and which replicas it counts as sharing with it now.
type shareView struct {
	reads bool
	live  []string
}

// event is one message element: a pick, the end of one (Pick with only
// ID set and done true), a reading or a view.
type event struct {
	pick    Pick
	done    bool
	reading *Reading
	view    *shareView
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
//	       0x03 view: byte flags (1: reads endpoints for the others),
//	       uvarint n, n x string replica ID
//	       0x04 reading: string pool, string endpoint, uvarint age in
//	       nanoseconds when sent, uvarint n, n bytes (the reading)
//	string: uvarint length, bytes
//	report (the answer to Ask): 0x02, string id, byte ready (0 or 1),
//	       uvarint n, n x (string type, string version), uvarint
//	       features (bit 0: takes views and readings); a reader ignores
//	       bytes after what it knows (fields added later)
//
// Views and readings came later than the rest: a replica that does not
// know them ends a stream that carries one, so they are sent only to a
// replica whose report announces FeatureReadings. An older report has no
// features: it gets picks only.
const (
	wireVersion = 1

	msgHello  = 0x00
	msgBatch  = 0x01
	msgReport = 0x02

	evPick    = 0x01
	evDone    = 0x02
	evView    = 0x03
	evReading = 0x04

	// maxHashes bounds one pick's hashes (a 2M-token prompt in 16-token
	// blocks); maxString bounds names, maxData a reading, maxView a
	// view's replicas.
	maxHashes = 1 << 17
	maxString = 4096
	maxEvents = 1 << 16
	maxData   = 1 << 20
	maxView   = 1 << 12
)

// FeatureReadings in a Report says the replica takes views and readings
// on its streams (it shares scrapes).
const FeatureReadings = 1

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
		switch {
		case e.view != nil:
			b = append(b, evView)
			flags := byte(0)
			if e.view.reads {
				flags = 1
			}
			b = append(b, flags)
			b = binary.AppendUvarint(b, uint64(len(e.view.live)))
			for _, id := range e.view.live {
				b = appendString(b, id)
			}
			continue
		case e.reading != nil:
			r := e.reading
			b = append(b, evReading)
			b = appendString(b, r.Pool)
			b = appendString(b, r.Endpoint)
			b = binary.AppendUvarint(b, uint64(max(sent.Sub(r.At), 0)))
			b = binary.AppendUvarint(b, uint64(len(r.Data)))
			b = append(b, r.Data...)
			continue
		}
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
// A reading's At is its age when sent, counted back from arrived.
func decodeBatch(b []byte, evs []event) (time.Time, []event, error) {
	return decodeBatchAt(b, evs, time.Now())
}

func decodeBatchAt(b []byte, evs []event, arrived time.Time) (time.Time, []event, error) {
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
		case evView:
			v := &shareView{reads: r.byte()&1 != 0}
			n := r.uvarint()
			if r.err == nil && (n > maxView || n > uint64(len(r.b))) {
				r.fail(fmt.Errorf("peers: view of %d replicas", n))
			}
			for j := uint64(0); j < n && r.err == nil; j++ {
				v.live = append(v.live, r.string())
			}
			evs = append(evs, event{view: v})
		case evReading:
			rd := &Reading{Pool: r.string(), Endpoint: r.string()}
			age := r.uvarint()
			rd.At = arrived.Add(-time.Duration(min(age, math.MaxInt64)))
			n := r.uvarint()
			if r.err == nil && (n > maxData || n > uint64(len(r.b))) {
				r.fail(fmt.Errorf("peers: reading of %d bytes", n))
			}
			if r.err == nil {
				rd.Data = append([]byte(nil), r.b[:n]...)
				r.b = r.b[n:]
			}
			evs = append(evs, event{reading: rd})
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
	return binary.AppendUvarint(b, r.Features)
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
	if r.err == nil && len(r.b) > 0 {
		// Added later: absent from older replicas' reports.
		rep.Features = r.uvarint()
	}
	if r.err != nil {
		return Report{}, r.err
	}
	return rep, nil
}
