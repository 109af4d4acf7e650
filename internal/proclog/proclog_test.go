package proclog

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeClock drives a Limiter's windows by hand: timers fire when the test
// says so.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	at      time.Time
	f       func()
	stopped bool
}

func (c *fakeClock) install(l *Limiter) {
	l.s.now = func() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
	l.s.afterFunc = func(d time.Duration, f func()) func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		tm := &fakeTimer{at: c.now.Add(d), f: f}
		c.timers = append(c.timers, tm)
		return func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			was := !tm.stopped
			tm.stopped = true
			return was
		}
	}
}

// advance moves the clock by d and fires the timers then due.
func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []func()
	keep := c.timers[:0]
	for _, tm := range c.timers {
		switch {
		case tm.stopped:
		case !tm.at.After(c.now):
			due = append(due, tm.f)
		default:
			keep = append(keep, tm)
		}
	}
	c.timers = keep
	c.mu.Unlock()
	for _, f := range due {
		f()
	}
}

// lines decodes the JSON lines written to buf.
func lines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("line %q is not JSON: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

func newTestLimiter(every time.Duration) (*Limiter, *fakeClock, *bytes.Buffer) {
	var buf bytes.Buffer
	l := NewLimiter(slog.NewJSONHandler(&buf, nil), every)
	c := &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	c.install(l)
	return l, c, &buf
}

// The first line of a kind goes out at once; the others of the window
// are held and the latest goes out when it closes, with the count; that
// line opens the next window.
func TestLimiterOneLinePerKindPerWindow(t *testing.T) {
	l, c, buf := newTestLimiter(time.Minute)
	log := slog.New(l)
	for i := range 5 {
		log.Error("OpenTelemetry error", "err", fmt.Errorf("traces export: attempt %d: connection refused", i))
		c.advance(5 * time.Second)
	}
	if got := lines(t, buf); len(got) != 1 || got[0]["err"] != "traces export: attempt 0: connection refused" || got[0][SuppressedKey] != nil {
		t.Fatalf("in the first window: %v, want only the first error", got)
	}
	c.advance(35 * time.Second) // the window closes at 60 s
	got := lines(t, buf)
	if len(got) != 2 || got[1]["err"] != "traces export: attempt 4: connection refused" || got[1][SuppressedKey] != float64(4) {
		t.Fatalf("after the window: %v, want the latest held error with suppressed=4", got)
	}
	// The summary opened a window: the next error is held, and goes out
	// when that one closes.
	c.advance(10 * time.Second)
	log.Error("OpenTelemetry error", "err", errors.New("traces export: context deadline exceeded"))
	if got := lines(t, buf); len(got) != 2 {
		t.Fatalf("an error in the window the summary opened went out: %v", got[2:])
	}
	c.advance(50 * time.Second)
	if got := lines(t, buf); len(got) != 3 || got[2][SuppressedKey] != float64(1) || got[2]["err"] != "traces export: context deadline exceeded" {
		t.Fatalf("second window: %v", got)
	}
	// A window that held nothing closes quietly; the next line goes out
	// at once.
	c.advance(2 * time.Minute)
	log.Error("OpenTelemetry error", "err", errors.New("traces export: again"))
	if got := lines(t, buf); len(got) != 4 || got[3][SuppressedKey] != nil {
		t.Fatalf("after a quiet window: %v", got)
	}
}

func TestLimiterKinds(t *testing.T) {
	l, c, buf := newTestLimiter(time.Minute)
	log := slog.New(l)
	log.Error("OpenTelemetry error", "err", errors.New("traces export: exporter export timeout: rpc error"))
	log.Error("OpenTelemetry error", "err", errors.New("traces export: context deadline exceeded")) // same kind
	log.Error("OpenTelemetry error", "err", errors.New("max export queue size reached"))            // another
	log.Warn("http: TLS handshake error from 10.0.0.1:5000: EOF")
	log.Warn("http: TLS handshake error from 10.0.0.2:5001: EOF") // same prefix: same kind
	log.Warn("a line without a colon")
	// Handlers derived from the limiter share its windows.
	slog.New(l.WithAttrs([]slog.Attr{slog.String("component", "x")})).Warn("a line without a colon")
	got := lines(t, buf)
	var msgs []string
	for _, m := range got {
		msgs = append(msgs, fmt.Sprint(m["msg"], " | ", m["err"]))
	}
	want := []string{
		"OpenTelemetry error | traces export: exporter export timeout: rpc error",
		"OpenTelemetry error | max export queue size reached",
		"http: TLS handshake error from 10.0.0.1:5000: EOF | <nil>",
		"a line without a colon | <nil>",
	}
	if strings.Join(msgs, "\n") != strings.Join(want, "\n") {
		t.Fatalf("lines:\n%s\nwant:\n%s", strings.Join(msgs, "\n"), strings.Join(want, "\n"))
	}
	c.advance(time.Minute)
	got = lines(t, buf)[4:]
	if len(got) != 3 {
		t.Fatalf("window ends: %v, want the three held kinds", got)
	}
	for _, m := range got {
		if m[SuppressedKey] != float64(1) {
			t.Errorf("summary %v: want suppressed=1", m)
		}
		if m["msg"] == "a line without a colon" && m["component"] != "x" {
			t.Errorf("summary %v lost the attributes of the handler it came through", m)
		}
	}
}

// Flush lets the held lines out at exit; a timer that fires late finds
// nothing, and a line arriving after a window closed but before its
// timer ran carries the held count.
func TestLimiterFlushAndLateTimer(t *testing.T) {
	l, c, buf := newTestLimiter(time.Minute)
	log := slog.New(l)
	log.Error("e", "err", errors.New("op: 1"))
	log.Error("e", "err", errors.New("op: 2"))
	log.Error("e", "err", errors.New("op: 3"))
	l.Flush()
	got := lines(t, buf)
	if len(got) != 2 || got[1]["err"] != "op: 3" || got[1][SuppressedKey] != float64(2) {
		t.Fatalf("after Flush: %v", got)
	}
	c.advance(time.Minute)
	if got := lines(t, buf); len(got) != 2 {
		t.Fatalf("the stopped timer emitted: %v", got[2:])
	}

	// Late timer: the clock passes the window's end without firing it.
	log.Error("e", "err", errors.New("op: 4")) // opens a window
	log.Error("e", "err", errors.New("op: 5")) // held
	c.mu.Lock()
	c.now = c.now.Add(2 * time.Minute)
	c.mu.Unlock()
	log.Error("e", "err", errors.New("op: 6"))
	got = lines(t, buf)
	if len(got) != 4 || got[3]["err"] != "op: 6" || got[3][SuppressedKey] != float64(2) {
		t.Fatalf("late timer: %v, want op: 6 standing for 2", got)
	}
	c.advance(time.Second) // the late timer fires now: nothing to say
	if got := lines(t, buf); len(got) != 4 {
		t.Fatalf("the late timer emitted: %v", got[4:])
	}
}

// Past maxKinds, new kinds share one window.
func TestLimiterBoundsKinds(t *testing.T) {
	l, _, buf := newTestLimiter(time.Minute)
	log := slog.New(l)
	for i := range maxKinds + 50 {
		log.Warn(fmt.Sprintf("kind %d", i))
	}
	if n := len(lines(t, buf)); n != maxKinds+1 {
		t.Errorf("%d lines, want %d (one per tracked kind, one for the rest)", n, maxKinds+1)
	}
	if n := len(l.s.kinds); n > maxKinds+1 {
		t.Errorf("%d kinds tracked", n)
	}
}

// The real timers close windows too.
func TestLimiterRealTimer(t *testing.T) {
	var buf syncBuffer
	l := NewLimiter(slog.NewJSONHandler(&buf, nil), 20*time.Millisecond)
	log := slog.New(l)
	log.Warn("w: 1")
	log.Warn("w: 2")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(buf.String(), `"suppressed":1`) {
		if time.Now().After(deadline) {
			t.Fatalf("no summary line: %s", buf.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	l.Flush()
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A standard logger writing through the limiter (as serve redirects Go's
// standard logger) makes JSON lines.
func TestStandardLoggerThroughLimiter(t *testing.T) {
	l, _, buf := newTestLimiter(time.Minute)
	std := log.New(slog.NewLogLogger(l, slog.LevelWarn).Writer(), "", 0)
	std.Printf("traces export: exporter export timeout: %s", "rpc error")
	std.Print("multi\nline")
	got := lines(t, buf)
	if len(got) != 2 || got[0]["level"] != "WARN" || got[0]["msg"] != "traces export: exporter export timeout: rpc error" || got[1]["msg"] != "multi\nline" {
		t.Fatalf("%v", got)
	}
}

func TestGRPCLogger(t *testing.T) {
	var buf bytes.Buffer
	g := GRPCLogger(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	g.Infof("connecting to %s", "x")
	g.Warning("a warning")
	g.Errorln("transport:", "too_many_pings")
	if g.V(1) || !g.V(0) {
		t.Errorf("V(1) %v V(0) %v, want false true", g.V(1), g.V(0))
	}
	got := lines(t, &buf)
	if len(got) != 1 || got[0]["level"] != "ERROR" || got[0]["msg"] != "transport: too_many_pings" {
		t.Fatalf("at info level: %v, want the error alone", got)
	}
	buf.Reset()
	g = GRPCLogger(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	g.Infof("connecting to %s", "x")
	g.Warningf("a %s", "warning")
	if got := lines(t, &buf); len(got) != 2 || got[0]["level"] != "DEBUG" || got[1]["msg"] != "a warning" {
		t.Fatalf("at debug level: %v", got)
	}
}
