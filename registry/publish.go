package registry

import (
	"context"
	"sync"
)

// View is what consumers of registry state depend on: the current state and
// a way to wait for the next one. Consumers only ever see the latest state,
// never a backlog of intermediate ones.
type View interface {
	// Current returns the latest state and a channel that is closed once a
	// newer state has been published.
	Current() (*State, <-chan struct{})
}

// Publisher holds the latest State and wakes every waiter when it changes.
// The zero value is not usable; use NewPublisher.
type Publisher struct {
	mu      sync.Mutex
	cur     *State
	changed chan struct{}
}

var _ View = (*Publisher)(nil)

// NewPublisher returns a Publisher whose current state is initial (Empty()
// when nil).
func NewPublisher(initial *State) *Publisher {
	if initial == nil {
		initial = Empty()
	}
	return &Publisher{cur: initial, changed: make(chan struct{})}
}

// Current implements View.
func (p *Publisher) Current() (*State, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur, p.changed
}

// Publish makes s the current state and wakes every waiter. The caller must
// not modify s afterwards.
func (p *Publisher) Publish(s *State) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cur = s
	close(p.changed)
	p.changed = make(chan struct{})
}

// WaitFor blocks until the view's state satisfies ok, or ctx ends. It returns
// the state that satisfied ok.
func WaitFor(ctx context.Context, v View, ok func(*State) bool) (*State, error) {
	for {
		s, changed := v.Current()
		if ok(s) {
			return s, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return s, ctx.Err()
		}
	}
}
