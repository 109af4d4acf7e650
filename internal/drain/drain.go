// Package drain takes a running switchyard out of service before it stops,
// so that a replica stopped for an upgrade fails no request: it reports
// itself not ready (the hooks registered with OnDrain: the picker's and
// the ADS server's gRPC health, the Consul registration; Draining for
// /readyz), keeps serving for a delay while Envoys' health checks and the
// other replicas notice, then waits, up to a timeout, for the requests in
// flight to finish.
package drain

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultPoll is how often Run looks at the requests in flight.
const DefaultPoll = 50 * time.Millisecond

// Options configure a Drainer.
type Options struct {
	// Delay is how long the process keeps serving after it reported
	// itself not ready.
	Delay time.Duration
	// Timeout bounds the wait for the requests in flight, after Delay.
	Timeout time.Duration
	// Poll is how often the requests in flight are counted (DefaultPoll
	// when 0).
	Poll time.Duration
	// Logger receives the start and the end of the drain (discarded when
	// nil).
	Logger *slog.Logger
}

// Drainer runs the drain sequence once.
type Drainer struct {
	opts     Options
	inFlight func() int64

	mu       sync.Mutex
	hooks    []func()
	draining atomic.Bool
}

// New returns a Drainer that waits for inFlight (the requests still being
// served) to reach zero.
func New(opts Options, inFlight func() int64) *Drainer {
	if opts.Poll <= 0 {
		opts.Poll = DefaultPoll
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Drainer{opts: opts, inFlight: inFlight}
}

// OnDrain registers fn to be called when the drain begins, after the hooks
// registered before it; one registered once the drain has begun is called
// at once. Hooks report the process not ready and must not block.
func (d *Drainer) OnDrain(fn func()) {
	d.mu.Lock()
	if !d.draining.Load() {
		d.hooks = append(d.hooks, fn)
		d.mu.Unlock()
		return
	}
	d.mu.Unlock()
	fn()
}

// Draining reports whether the drain has begun.
func (d *Drainer) Draining() bool { return d.draining.Load() }

// Run drains: it calls the hooks, keeps serving for Delay, then waits up
// to Timeout until no request is in flight. A value on stopped means a
// component stopped meanwhile (the process is failing): Run then returns
// at once with interrupted set and that value. Call Run once.
func (d *Drainer) Run(stopped <-chan error) (interrupted bool, err error) {
	start := time.Now()
	d.mu.Lock()
	d.draining.Store(true)
	hooks := d.hooks
	d.hooks = nil
	d.mu.Unlock()
	for _, fn := range hooks {
		fn()
	}
	d.opts.Logger.Info("draining: reported not ready; still serving", "delay", d.opts.Delay, "in_flight", d.inFlight())

	// wait sleeps for dur unless a component stops first.
	wait := func(dur time.Duration) bool {
		t := time.NewTimer(dur)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case err = <-stopped:
			return false
		}
	}
	if !wait(d.opts.Delay) {
		return true, err
	}
	deadline := time.Now().Add(d.opts.Timeout)
	for d.inFlight() > 0 && time.Now().Before(deadline) {
		if !wait(d.opts.Poll) {
			return true, err
		}
	}
	d.opts.Logger.Info("drained", "in_flight_left", d.inFlight(), "took", time.Since(start).Round(time.Millisecond))
	return false, nil
}
