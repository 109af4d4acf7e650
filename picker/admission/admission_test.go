package admission

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// gate is a pool whose capacity the test controls: while open, every
// dispatched request takes one of the free slots.
type gate struct {
	mu    sync.Mutex
	state Capacity
	slots int
}

func (g *gate) capacity() Capacity {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.state == Room && g.slots <= 0 {
		return Full
	}
	return g.state
}

func (g *gate) open(slots int) {
	g.mu.Lock()
	g.state, g.slots = Room, slots
	g.mu.Unlock()
}

func (g *gate) take() {
	g.mu.Lock()
	g.slots--
	g.mu.Unlock()
}

func (g *gate) set(c Capacity) {
	g.mu.Lock()
	g.state = c
	g.mu.Unlock()
}

func run(t *testing.T, q *Queue) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); q.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// waiter queues r and records the order requests are granted in.
type waiter struct {
	mu    sync.Mutex
	order []string
	wg    sync.WaitGroup
	errs  sync.Map
}

func (w *waiter) wait(q *Queue, g *gate, name string, r Request) {
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		tk, err := q.Wait(context.Background(), r)
		if err != nil {
			w.errs.Store(name, err)
			return
		}
		g.take()
		w.mu.Lock()
		w.order = append(w.order, name)
		w.mu.Unlock()
		tk.Done()
	}()
}

func waitLen(t *testing.T, q *Queue, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for q.Len() != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue length %d, want %d", q.Len(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHigherBandsGoFirst(t *testing.T) {
	g := &gate{}
	q := New("p", Config{}, g.capacity)
	run(t, q)
	w := &waiter{}
	w.wait(q, g, "low-1", Request{Priority: -1})
	waitLen(t, q, 1)
	w.wait(q, g, "mid", Request{Priority: 0})
	waitLen(t, q, 2)
	w.wait(q, g, "high", Request{Priority: 5})
	waitLen(t, q, 3)
	w.wait(q, g, "low-2", Request{Priority: -1})
	waitLen(t, q, 4)
	g.open(4)
	w.wg.Wait()
	if fmt.Sprint(w.order) != "[high mid low-1 low-2]" {
		t.Fatalf("dispatch order %v", w.order)
	}
	if s := q.Stats(); s.Dispatched != 4 || s.Enqueued != 4 || len(s.Waiting) != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// Fairness within a band: a flow that queued 6 requests and one that
// queued 2 alternate (round-robin), or the one with fewer tokens served
// goes first (tokens).
func TestFairnessBetweenFlows(t *testing.T) {
	for _, tc := range []struct {
		fairness Fairness
		want     string
	}{
		{FairRoundRobin, "[a1 b1 a2 b2 a3 a4 a5 a6]"},
		// Tokens: a's requests are 4x b's, so b gets two turns while a
		// catches up.
		{FairTokens, "[a1 b1 b2 a2 a3 a4 a5 a6]"},
	} {
		t.Run(string(tc.fairness), func(t *testing.T) {
			g := &gate{}
			q := New("p", Config{Fairness: tc.fairness}, g.capacity)
			run(t, q)
			w := &waiter{}
			n := 0
			for i := 1; i <= 6; i++ {
				w.wait(q, g, fmt.Sprintf("a%d", i), Request{Flow: "a", Tokens: 400})
				n++
				waitLen(t, q, n)
				if i <= 2 {
					w.wait(q, g, fmt.Sprintf("b%d", i), Request{Flow: "b", Tokens: 100})
					n++
					waitLen(t, q, n)
				}
			}
			g.open(8)
			w.wg.Wait()
			if got := fmt.Sprint(w.order); got != tc.want {
				t.Fatalf("order %s, want %s", got, tc.want)
			}
		})
	}
}

func TestTTLAndNoEndpoint(t *testing.T) {
	g := &gate{}
	q := New("p", Config{TTL: 50 * time.Millisecond, NoEndpointWait: 20 * time.Millisecond}, g.capacity)
	run(t, q)
	start := time.Now()
	_, err := q.Wait(context.Background(), Request{})
	var rej *Rejection
	if !errors.As(err, &rej) || rej.Reason != ReasonTTL || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("after %v: %v, want a TTL rejection after 50ms", time.Since(start), err)
	}
	g.set(NoEndpoint)
	_, err = q.Wait(context.Background(), Request{})
	if !errors.As(err, &rej) || rej.Reason != ReasonNoEndpoint {
		t.Fatalf("no endpoint: %v", err)
	}
	if s := q.Stats(); s.Rejected[ReasonTTL] != 1 || s.Rejected[ReasonNoEndpoint] != 1 || s.Wait[WaitKey{Outcome: OutcomeTTL}].Count != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestOverflowEvictsTheLowestBandFirst(t *testing.T) {
	g := &gate{}
	q := New("p", Config{MaxQueued: 2, MaxQueuedBytes: 1 << 20}, g.capacity)
	run(t, q)
	w := &waiter{}
	w.wait(q, g, "low", Request{Priority: -1})
	waitLen(t, q, 1)
	w.wait(q, g, "mid", Request{Priority: 0})
	waitLen(t, q, 2)
	w.wait(q, g, "high", Request{Priority: 1}) // evicts "low"
	waitLen(t, q, 2)
	// Same band as the lowest left, queue full: rejected itself.
	if _, err := q.Wait(context.Background(), Request{Priority: 0}); err == nil {
		t.Fatal("a request beyond the bound was queued")
	}
	// Bytes bound the same way.
	if _, err := q.Wait(context.Background(), Request{Priority: 0, Bytes: 2 << 20}); err == nil {
		t.Fatal("a body beyond the byte bound was queued")
	}
	g.open(2)
	w.wg.Wait()
	v, ok := w.errs.Load("low")
	var rej *Rejection
	if !ok || !errors.As(v.(error), &rej) || rej.Reason != ReasonOverflow {
		t.Fatalf("low: %v, want evicted for overflow", v)
	}
	if fmt.Sprint(w.order) != "[high mid]" {
		t.Fatalf("order %v", w.order)
	}
}

func TestCancelledWhileWaiting(t *testing.T) {
	g := &gate{}
	q := New("p", Config{}, g.capacity)
	run(t, q)
	ctx, cancel := context.WithCancel(context.Background())
	var err atomic.Value
	done := make(chan struct{})
	go func() {
		_, e := q.Wait(ctx, Request{Bytes: 10})
		err.Store(e)
		close(done)
	}()
	waitLen(t, q, 1)
	cancel()
	<-done
	if !errors.Is(err.Load().(error), ErrCancelled) || q.Len() != 0 || q.Bytes() != 0 {
		t.Fatalf("err %v, len %d, bytes %d", err.Load(), q.Len(), q.Bytes())
	}
}

// A reload (Configure) keeps what waits.
func TestConfigureKeepsWaitingRequests(t *testing.T) {
	g := &gate{}
	q := New("p", Config{}, g.capacity)
	run(t, q)
	w := &waiter{}
	w.wait(q, g, "a", Request{})
	waitLen(t, q, 1)
	q.Configure(Config{Fairness: FairRoundRobin, TTL: time.Minute})
	if q.Len() != 1 {
		t.Fatal("configure dropped a waiting request")
	}
	g.open(1)
	w.wg.Wait()
	if fmt.Sprint(w.order) != "[a]" {
		t.Fatalf("order %v", w.order)
	}
}

// A reload that shortens the waits applies them to what arrives next:
// requests already waiting keep the TTL and no-endpoint wait they
// arrived under.
func TestConfigureKeepsWaitingRequestsBounds(t *testing.T) {
	for _, c := range []struct {
		name   string
		state  Capacity
		reason string
		cfg    func(d time.Duration) Config
	}{
		{"ttl", Full, ReasonTTL, func(d time.Duration) Config { return Config{TTL: d} }},
		{"no-endpoint", NoEndpoint, ReasonNoEndpoint, func(d time.Duration) Config { return Config{NoEndpointWait: d} }},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := &gate{}
			g.set(c.state)
			q := New("p", c.cfg(time.Minute), g.capacity)
			run(t, q)
			w := &waiter{}
			w.wait(q, g, "a", Request{})
			waitLen(t, q, 1)
			w.wait(q, g, "b", Request{})
			waitLen(t, q, 2)
			q.Configure(c.cfg(50 * time.Millisecond))
			start := time.Now()
			_, err := q.Wait(context.Background(), Request{})
			var rej *Rejection
			if !errors.As(err, &rej) || rej.Reason != c.reason || time.Since(start) < 50*time.Millisecond {
				t.Fatalf("a request arriving after the reload: %v after %v, want %s after 50ms", err, time.Since(start), c.reason)
			}
			// The two older ones waited longer than the new bound, yet wait on.
			if q.Len() != 2 {
				w.errs.Range(func(k, v any) bool { t.Errorf("%s: %v", k, v); return true })
				t.Fatalf("%d waiting after the reload, want the 2 that arrived before it", q.Len())
			}
			g.open(2)
			w.wg.Wait()
			if fmt.Sprint(w.order) != "[a b]" {
				t.Fatalf("order %v", w.order)
			}
		})
	}
}

// Flows that stopped sending are forgotten once their attained service
// has decayed away, so memory follows the flows waiting now.
func TestIdleFlowsAreForgotten(t *testing.T) {
	t.Parallel()
	g := &gate{}
	g.open(1000)
	q := New("p", Config{}, g.capacity)
	now := time.Unix(1000, 0)
	q.now = func() time.Time { return now }
	run(t, q)
	for i := range 50 {
		tk, err := q.Wait(context.Background(), Request{Flow: fmt.Sprintf("tenant-%d", i), Tokens: 100})
		if err != nil {
			t.Fatal(err)
		}
		tk.Done()
	}
	q.mu.Lock()
	q.forget(now)
	q.mu.Unlock()
	if n := q.Flows(); n != 50 {
		t.Fatalf("flows right after serving = %d, want 50 (their service is remembered)", n)
	}
	q.mu.Lock()
	q.forget(now.Add(10 * attainedHalfLife)) // 100 tokens decay below 1
	q.mu.Unlock()
	if n := q.Flows(); n != 0 {
		t.Fatalf("flows after they decayed = %d, want 0", n)
	}
}

// The queue reports what each flow was dispatched, requests and tokens.
func TestFlowStats(t *testing.T) {
	t.Parallel()
	g := &gate{}
	g.open(100)
	q := New("p", Config{}, g.capacity)
	run(t, q)
	for i, r := range []Request{{Flow: "a", Tokens: 10}, {Flow: "a", Tokens: 5}, {Flow: "b", Tokens: 7, Priority: 1}} {
		tk, err := q.Wait(context.Background(), r)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		tk.Done()
	}
	got := fmt.Sprint(q.Stats().Flows)
	if want := "[{1 b 1 7} {0 a 2 15}]"; got != want {
		t.Errorf("flows %s, want %s", got, want)
	}
}
