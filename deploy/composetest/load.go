package composetest

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Load sends requests from a fixed number of workers, one after another
// each, until stopped, and counts the answers: the steady load a fault is
// injected under.
type Load struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// draining stops the workers from sending more (Drain).
	draining chan struct{}
	drainOne sync.Once

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every finished request
	done     int
	failures []Failure
}

// Failure is one failed request.
type Failure struct {
	Seq   int       // the request's number, in the order they finished
	Start time.Time // when it was sent
	At    time.Time // when it finished
	Err   string
}

// Send sends one request and returns nil when it succeeded.
type Send func(ctx context.Context) error

// StartLoad starts workers that call send in a loop.
func StartLoad(workers int, send Send) *Load {
	ctx, cancel := context.WithCancel(context.Background())
	l := &Load{cancel: cancel, changed: make(chan struct{}), draining: make(chan struct{})}
	for range workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for ctx.Err() == nil {
				select {
				case <-l.draining:
					return
				default:
				}
				start := time.Now()
				err := send(ctx)
				if ctx.Err() != nil {
					return // stopped mid-request: not counted
				}
				l.mu.Lock()
				l.done++
				if err != nil {
					l.failures = append(l.failures, Failure{Seq: l.done, Start: start, At: time.Now(), Err: err.Error()})
				}
				close(l.changed)
				l.changed = make(chan struct{})
				l.mu.Unlock()
			}
		}()
	}
	return l
}

// Done returns how many requests finished so far.
func (l *Load) Done() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done
}

// WaitDone waits until n requests have finished, or ctx ends.
func (l *Load) WaitDone(ctx context.Context, n int) error {
	for {
		l.mu.Lock()
		done, ch := l.done, l.changed
		l.mu.Unlock()
		if done >= n {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("%d of %d requests finished: %w", done, n, ctx.Err())
		}
	}
}

// Result is what a load saw.
type Result struct {
	Requests int
	Failures []Failure
}

// Stop stops the workers (a request in progress is abandoned, not
// counted) and returns the result.
func (l *Load) Stop() Result {
	l.cancel()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return Result{Requests: l.done, Failures: append([]Failure(nil), l.failures...)}
}

// Drain stops the workers from sending more requests, waits for the
// requests in flight to finish (each within its own deadline: send must
// bound it) and counts them, then returns the result. Unlike Stop it
// abandons nothing: a request hanging on a host that vanished is counted
// when its deadline fails it.
func (l *Load) Drain() Result {
	l.drainOne.Do(func() { close(l.draining) })
	l.wg.Wait()
	l.cancel()
	l.mu.Lock()
	defer l.mu.Unlock()
	return Result{Requests: l.done, Failures: append([]Failure(nil), l.failures...)}
}

// String summarises r: "1 of 200 failed (first: ...)".
func (r Result) String() string {
	s := fmt.Sprintf("%d of %d failed", len(r.Failures), r.Requests)
	if len(r.Failures) > 0 {
		s += fmt.Sprintf(" (first: #%d %s)", r.Failures[0].Seq, r.Failures[0].Err)
	}
	return s
}
