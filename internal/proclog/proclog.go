// Package proclog owns the log lines switchyard does not write itself:
// what libraries print through Go's standard logger or report through
// their process-wide hooks (OpenTelemetry's error handler and logger,
// gRPC's logger). It turns each into a record of the process's
// slog.Handler, so that -log-format json holds for every line, and
// limits each kind of line to one per interval: a collector that is down
// makes the OpenTelemetry SDK report a failed export every few seconds,
// and an operator needs to know that it fails, not each time.
//
// The package sets no hook itself: the command wires the hooks once, at
// start (see cmd/switchyard).
package proclog

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// SuppressedKey is the attribute of a line that stands for several held
// back by a Limiter: how many lines of its kind the window held (the
// line's own text is the latest of them).
const SuppressedKey = "suppressed"

// maxKinds bounds the kinds a Limiter tracks; past it, lines of new kinds
// share one window, so varied text cannot grow memory without bound.
const maxKinds = 256

// overflowKind is the kind of every line past maxKinds.
const overflowKind = "\x00other"

// Limiter is a slog.Handler that passes records to the handler it wraps,
// at most one of each kind per interval. The first record of a kind goes
// through at once and opens a window of one interval; records of that
// kind arriving in the window are held back, and when it closes the
// latest of them goes through with SuppressedKey set to how many were
// held (that line opens the next window). A kind is the text of the
// message up to its first ": ", with that of the record's "err"
// attribute when it has one: "traces export: exporter export timeout:
// ..." and "traces export: context deadline exceeded" are one kind.
//
// Handlers derived with WithAttrs and WithGroup share their parent's
// windows.
type Limiter struct {
	next slog.Handler
	s    *limits
}

// limits is the state a Limiter and the handlers derived from it share.
type limits struct {
	every time.Duration
	// now and afterFunc are the clock and timers (tests replace them).
	now       func() time.Time
	afterFunc func(time.Duration, func()) func() bool

	mu    sync.Mutex
	kinds map[string]*window
}

// window is one kind's current window.
type window struct {
	until time.Time // when the window closes
	held  int       // records held back in it
	// last is the latest record held back, and next the handler it came
	// through (with its attributes and groups).
	last slog.Record
	next slog.Handler
	// stop cancels the timer that closes the window; nil while none runs.
	stop func() bool
}

// NewLimiter returns a Limiter passing at most one record of each kind
// per interval every to next.
func NewLimiter(next slog.Handler, every time.Duration) *Limiter {
	return &Limiter{next: next, s: &limits{
		every: every, now: time.Now, kinds: map[string]*window{},
		afterFunc: func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop },
	}}
}

// Enabled implements slog.Handler.
func (l *Limiter) Enabled(ctx context.Context, level slog.Level) bool {
	return l.next.Enabled(ctx, level)
}

// WithAttrs implements slog.Handler.
func (l *Limiter) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Limiter{next: l.next.WithAttrs(attrs), s: l.s}
}

// WithGroup implements slog.Handler.
func (l *Limiter) WithGroup(name string) slog.Handler {
	return &Limiter{next: l.next.WithGroup(name), s: l.s}
}

// Handle implements slog.Handler: it passes r on, or holds it back while
// its kind's window is open.
func (l *Limiter) Handle(ctx context.Context, r slog.Record) error {
	s := l.s
	s.mu.Lock()
	now := s.now()
	k := s.kindLocked(kindOf(r), now)
	w := s.kinds[k]
	switch {
	case w == nil || (!now.Before(w.until) && w.held == 0):
		// A new kind, or a window that closed with nothing held.
		s.kinds[k] = &window{until: now.Add(s.every)}
		s.mu.Unlock()
		return l.next.Handle(ctx, r)
	case !now.Before(w.until):
		// The window closed but its timer has not run yet: r goes
		// through now, standing for what the window held too.
		n := w.held + 1
		if w.stop != nil {
			w.stop()
		}
		s.kinds[k] = &window{until: now.Add(s.every)}
		s.mu.Unlock()
		emit(l.next, r, n, now)
		return nil
	}
	w.held++
	w.last, w.next = r.Clone(), l.next
	if w.stop == nil {
		w.stop = s.afterFunc(w.until.Sub(now), func() { s.close(k, w) })
	}
	s.mu.Unlock()
	return nil
}

// kindLocked returns the key k is tracked under, making room when the
// map is full by forgetting windows that closed with nothing held.
func (s *limits) kindLocked(k string, now time.Time) string {
	if _, ok := s.kinds[k]; ok || len(s.kinds) < maxKinds {
		return k
	}
	for key, w := range s.kinds {
		if w.held == 0 && !now.Before(w.until) {
			delete(s.kinds, key)
		}
	}
	if len(s.kinds) < maxKinds {
		return k
	}
	return overflowKind
}

// close ends kind k's window w: the latest record it held goes through
// with the count, and opens the next window.
func (s *limits) close(k string, w *window) {
	s.mu.Lock()
	if s.kinds[k] != w || w.held == 0 {
		s.mu.Unlock()
		return
	}
	now := s.now()
	s.kinds[k] = &window{until: now.Add(s.every)}
	s.mu.Unlock()
	emit(w.next, w.last, w.held, now)
}

// Flush lets every held-back record through now, each with its count,
// and stops the timers; the windows stay open. Call it before the
// process exits, so the counts of the last windows are not lost.
func (l *Limiter) Flush() {
	s := l.s
	type out struct {
		next slog.Handler
		r    slog.Record
		n    int
	}
	var pending []out
	s.mu.Lock()
	now := s.now()
	for _, w := range s.kinds {
		if w.stop != nil {
			w.stop()
			w.stop = nil
		}
		if w.held > 0 {
			pending = append(pending, out{w.next, w.last, w.held})
			w.held, w.last, w.next = 0, slog.Record{}, nil
		}
	}
	s.mu.Unlock()
	for _, p := range pending {
		emit(p.next, p.r, p.n, now)
	}
}

// emit passes r, the latest of n held-back records, to next, timed now:
// a line is never older than the one before it in the log.
func emit(next slog.Handler, r slog.Record, n int, now time.Time) {
	out := slog.NewRecord(now, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(a)
		return true
	})
	out.AddAttrs(slog.Int(SuppressedKey, n))
	_ = next.Handle(context.Background(), out)
}

// kindOf returns r's kind: its message, and its "err" attribute, each up
// to the first ": ".
func kindOf(r slog.Record) string {
	k := head(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		if a.Key != "err" {
			return true
		}
		k += "\x00" + head(a.Value.String())
		return false
	})
	return k
}

// head returns s up to its first ": " (the operation of a wrapped
// error, the prefix of a library's log line).
func head(s string) string {
	if i := strings.Index(s, ": "); i >= 0 {
		return s[:i]
	}
	return s
}
