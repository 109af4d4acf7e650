package drain

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

type result struct {
	interrupted bool
	err         error
}

// start runs d in a goroutine; the channel delivers its result.
func start(d *Drainer, stopped <-chan error) <-chan result {
	out := make(chan result, 1)
	go func() {
		i, err := d.Run(stopped)
		out <- result{i, err}
	}()
	return out
}

func await(t *testing.T, res <-chan result) result {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
		return result{}
	}
}

func TestHooksReportNotReady(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var calls []string
	hook := func(name string) func() {
		return func() { mu.Lock(); calls = append(calls, name); mu.Unlock() }
	}
	d := New(Options{}, func() int64 { return 0 })
	d.OnDrain(hook("picker"))
	d.OnDrain(hook("xds"))
	if d.Draining() || len(calls) != 0 {
		t.Fatalf("before Run: draining %v, hooks called %v", d.Draining(), calls)
	}
	if r := await(t, start(d, nil)); r.interrupted || r.err != nil {
		t.Errorf("Run = %+v, want a clean drain", r)
	}
	if !d.Draining() || !slices.Equal(calls, []string{"picker", "xds"}) {
		t.Errorf("after Run: draining %v, hooks called %v, want picker then xds", d.Draining(), calls)
	}
	// A component that starts late (a Consul registration) still learns.
	d.OnDrain(hook("late"))
	if !slices.Equal(calls, []string{"picker", "xds", "late"}) {
		t.Errorf("a hook registered after the drain began was not called at once: %v", calls)
	}
}

// TestWaitsForRequestsInFlight: after the delay, Run returns once the
// last request finished, not before.
func TestWaitsForRequestsInFlight(t *testing.T) {
	t.Parallel()
	var inFlight, polls atomic.Int64
	inFlight.Store(2)
	d := New(Options{Timeout: time.Hour, Poll: time.Millisecond}, func() int64 { polls.Add(1); return inFlight.Load() })
	res := start(d, nil)
	testutil.Eventually(t, 10*time.Second, "in-flight requests polled", func() error {
		if polls.Load() < 5 {
			return errors.New("not polled yet")
		}
		return nil
	})
	select {
	case r := <-res:
		t.Fatalf("Run returned %+v with 2 requests in flight", r)
	default:
	}
	inFlight.Store(0)
	if r := await(t, res); r.interrupted || r.err != nil {
		t.Errorf("Run = %+v, want a clean drain", r)
	}
}

// TestGivesUpAfterTimeout: requests that never finish do not hold the
// process past the timeout.
func TestGivesUpAfterTimeout(t *testing.T) {
	t.Parallel()
	d := New(Options{Timeout: 10 * time.Millisecond, Poll: time.Millisecond}, func() int64 { return 1 })
	if r := await(t, start(d, nil)); r.interrupted || r.err != nil {
		t.Errorf("Run = %+v, want a drain that gave up on the request", r)
	}
}

// TestStoppedComponentInterrupts: a component failing during the delay or
// the wait ends the drain at once with its error.
func TestStoppedComponentInterrupts(t *testing.T) {
	t.Parallel()
	boom := errors.New("xds-server: listen: address in use")
	cases := []struct {
		desc     string
		opts     Options
		inFlight int64
	}{
		// With nothing in flight, only the delay keeps Run from returning.
		{"during the delay", Options{Delay: time.Hour}, 0},
		{"while waiting for requests", Options{Timeout: time.Hour, Poll: time.Millisecond}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			stopped := make(chan error, 1)
			d := New(tc.opts, func() int64 { return tc.inFlight })
			res := start(d, stopped)
			stopped <- boom
			if r := await(t, res); !r.interrupted || !errors.Is(r.err, boom) {
				t.Errorf("Run = %+v, want interrupted with %v", r, boom)
			}
		})
	}
}
