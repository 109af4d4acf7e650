package decisions

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Defaults of Options.
const (
	DefaultSize          = 1000
	DefaultMaxCandidates = 256
	// fileQueue bounds the records waiting for the file writer; when it
	// is full (the disk is slower than the requests) records skip the
	// file and are counted as dropped.
	fileQueue = 4096
)

// Options configure a Recorder.
type Options struct {
	// Size is how many records the ring keeps (default 1000).
	Size int
	// Sample is the share of requests recorded, in [0, 1]. A Recorder made
	// by New with the zero Options records every request; set Disabled to
	// record none.
	Sample   float64
	Disabled bool
	// MaxCandidates bounds the candidates kept per record, best totals
	// first (default 256).
	MaxCandidates int
}

// Recorder keeps the latest decision records. It is safe for concurrent
// use; Add costs one atomic store (and one channel send with a file).
type Recorder struct {
	opts  Options
	slots []atomic.Pointer[Record]
	seq   atomic.Uint64

	// file is where RunFile writes, nil without one.
	file    atomic.Pointer[chan *Record]
	dropped atomic.Uint64
}

// New returns a Recorder. Options.Sample 0 means 1 (every request) unless
// Disabled is set.
func New(opts Options) *Recorder {
	if opts.Size <= 0 {
		opts.Size = DefaultSize
	}
	if opts.MaxCandidates <= 0 {
		opts.MaxCandidates = DefaultMaxCandidates
	}
	if opts.Sample <= 0 || opts.Sample > 1 {
		opts.Sample = 1
	}
	return &Recorder{opts: opts, slots: make([]atomic.Pointer[Record], opts.Size)}
}

// Options returns the recorder's options with defaults applied.
func (r *Recorder) Options() Options { return r.opts }

// Sample reports whether the next request is to be recorded.
func (r *Recorder) Sample() bool {
	if r == nil || r.opts.Disabled {
		return false
	}
	return r.opts.Sample >= 1 || rand.Float64() < r.opts.Sample
}

// MaxCandidates is how many candidates a record keeps.
func (r *Recorder) MaxCandidates() int { return r.opts.MaxCandidates }

// Add numbers rec and publishes it; rec must not change afterwards.
func (r *Recorder) Add(rec *Record) {
	rec.Seq = r.seq.Add(1)
	r.slots[(rec.Seq-1)%uint64(len(r.slots))].Store(rec)
	if ch := r.file.Load(); ch != nil {
		select {
		case *ch <- rec:
		default:
			r.dropped.Add(1)
		}
	}
}

// Stats are a recorder's counters.
type Stats struct {
	// Recorded counts records added since start; FileDropped those that
	// skipped the file because its writer fell behind.
	Recorded, FileDropped uint64
	// Kept is how many records the ring holds (the latest Kept of
	// Recorded), Size how many it can hold.
	Kept, Size int
	Sample     float64
}

// Stats returns the recorder's counters.
func (r *Recorder) Stats() Stats {
	seq := r.seq.Load()
	s := Stats{Recorded: seq, FileDropped: r.dropped.Load(), Kept: int(min(seq, uint64(len(r.slots)))), Size: len(r.slots), Sample: r.opts.Sample}
	if r.opts.Disabled {
		s.Sample = 0
	}
	return s
}

// Filter selects records: every set field must match.
type Filter struct {
	// Model matches the client's model name or the rewrite target.
	Model string
	Pool  string
	// Endpoint matches the picked, a fallback or the served endpoint.
	Endpoint string
	// Status is an HTTP status ("200", "0" for requests that got no
	// answer) or a class ("2xx", "4xx", "5xx").
	Status string
	// Limit caps the answer (newest first; default 100).
	Limit int
}

// ParseFilter reads a Filter from query parameters model, pool, endpoint,
// status and limit.
func ParseFilter(q url.Values) (Filter, error) {
	f := Filter{Model: q.Get("model"), Pool: q.Get("pool"), Endpoint: q.Get("endpoint"), Status: q.Get("status"), Limit: 100}
	if s := f.Status; s != "" {
		if _, err := strconv.Atoi(s); err != nil && !(len(s) == 3 && s[0] >= '1' && s[0] <= '5' && strings.EqualFold(s[1:], "xx")) {
			return Filter{}, fmt.Errorf("status %q: want a status code such as 429 or a class such as 5xx", s)
		}
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n <= 0 {
			return Filter{}, fmt.Errorf("limit %q: want a positive number", l)
		}
		f.Limit = n
	}
	return f, nil
}

func (f Filter) match(r *Record) bool {
	if f.Model != "" && r.Model != f.Model && r.Target != f.Model {
		return false
	}
	if f.Pool != "" && r.Pool != f.Pool {
		return false
	}
	if f.Endpoint != "" && r.Picked != f.Endpoint && r.Served != f.Endpoint && !slices.Contains(r.Fallbacks, f.Endpoint) {
		return false
	}
	if s := f.Status; s != "" {
		if len(s) == 3 && (s[1] == 'x' || s[1] == 'X') {
			if r.Status/100 != int(s[0]-'0') {
				return false
			}
		} else if strconv.Itoa(r.Status) != s {
			return false
		}
	}
	return true
}

// Query returns the records kept that match f, newest first.
func (r *Recorder) Query(f Filter) []*Record {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	last := r.seq.Load()
	out := []*Record{}
	n := uint64(len(r.slots))
	oldest := uint64(1) // the oldest number a slot can still hold
	if last > n {
		oldest = last - n + 1
	}
	for i := uint64(0); i < n && i < last && len(out) < f.Limit; i++ {
		rec := r.slots[(last-1-i)%n].Load()
		// A slot may already hold a newer record (added meanwhile), or
		// not yet the one numbered: skip what is out of order.
		if rec == nil || rec.Seq > last || rec.Seq < oldest {
			continue
		}
		if f.match(rec) {
			out = append(out, rec)
		}
	}
	slices.SortFunc(out, func(a, b *Record) int { return cmp.Compare(b.Seq, a.Seq) }) // newest first
	return out
}

// RunFile appends every record added from now on to path as one JSON
// object per line, until ctx ends; the file is flushed at least every
// second. Records that arrive faster than the file takes them are
// dropped from the file (Stats.FileDropped), never from the ring.
func (r *Recorder) RunFile(ctx context.Context, path string, logger *slog.Logger) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		return fmt.Errorf("decision records file: %w", err)
	}
	ch := make(chan *Record, fileQueue)
	r.file.Store(&ch)
	defer r.file.Store(nil)
	w := bufio.NewWriterSize(f, 64<<10)
	enc := json.NewEncoder(w)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var werr error
	write := func(rec *Record) {
		if werr != nil {
			return
		}
		if werr = enc.Encode(rec); werr != nil {
			logger.Error("decision records file: write failed; no more records go to it", "path", path, "err", werr)
		}
	}
	for {
		select {
		case rec := <-ch:
			write(rec)
		case <-tick.C:
			if werr == nil {
				if werr = w.Flush(); werr != nil {
					logger.Error("decision records file: write failed; no more records go to it", "path", path, "err", werr)
				}
			}
		case <-ctx.Done():
			// Write what is queued, then close.
			for drained := false; !drained; {
				select {
				case rec := <-ch:
					write(rec)
				default:
					drained = true
				}
			}
			return errors.Join(werr, w.Flush(), f.Close())
		}
	}
}
