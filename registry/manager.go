package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"sync"
	"time"
)

// Default debounce settings: a burst of updates is published once things
// have been quiet for DefaultHoldoff, and never later than DefaultMaxDelay
// after the first update of the burst.
const (
	DefaultHoldoff  = 100 * time.Millisecond
	DefaultMaxDelay = time.Second
)

// Manager runs sources, merges their latest contributions into one State,
// validates it and publishes it with Version+1 whenever its content changes.
// A failed refresh or a merged state that does not validate never replaces
// the last good state; the problem is logged and kept for LastError.
type Manager struct {
	pub      *Publisher
	rules    SchedulingRules
	log      *slog.Logger
	holdoff  time.Duration
	maxDelay time.Duration

	mu      sync.Mutex
	sources []*sourceState
	started bool
	version uint64
	last    *State
	// base is the state the publisher held when Run started (restored by
	// a warm restart): the guard compares the first merge against it.
	base     *State
	guard    *guard
	guardAt  time.Time // when an active hold ends: apply again then
	applyErr error
	warnings []string
	pubTime  time.Time
}

type sourceState struct {
	name    string
	src     Source
	have    bool // a good contribution has arrived
	contrib Update
	err     error
	updated time.Time
}

// ManagerOption configures a Manager.
type ManagerOption func(*Manager)

// WithDebounce sets how long the Manager waits for a burst of updates to
// settle (holdoff, restarted by each update) and the longest it delays a
// publish (maxDelay, counted from the first update of the burst; 0 means
// holdoff). Zero holdoff publishes every update immediately, which tests
// use.
func WithDebounce(holdoff, maxDelay time.Duration) ManagerOption {
	return func(m *Manager) {
		m.holdoff, m.maxDelay = holdoff, maxDelay
		if m.maxDelay <= 0 {
			m.maxDelay = m.holdoff
		}
	}
}

// WithInitialVersion sets the version of the last state published by a
// previous run (persisted by the store); the first state this Manager
// publishes gets v+1, so versions never repeat across restarts.
func WithInitialVersion(v uint64) ManagerOption {
	return func(m *Manager) { m.version = v }
}

// WithSchedulingRules sets the rules pools' scheduling blocks are judged
// by (the picker's sched.Rules); without it they are not judged here.
func WithSchedulingRules(r SchedulingRules) ManagerOption {
	return func(m *Manager) { m.rules = r }
}

// WithLogger sets the logger (slog.Default() otherwise).
func WithLogger(l *slog.Logger) ManagerOption {
	return func(m *Manager) { m.log = l }
}

// NewManager returns a Manager that publishes through pub. Register sources
// with AddSource, then call Run.
func NewManager(pub *Publisher, opts ...ManagerOption) *Manager {
	m := &Manager{pub: pub, log: slog.Default(), holdoff: DefaultHoldoff, maxDelay: DefaultMaxDelay}
	for _, o := range opts {
		o(m)
	}
	m.guard = newGuard(m.log)
	return m
}

// AddSource registers s under name. Sources merge in registration order:
// when two sources supply the same endpoint, the earlier one wins. It must
// be called before Run.
func (m *Manager) AddSource(name string, s Source) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.started {
		return fmt.Errorf("registry: add source %q: manager already running", name)
	}
	for _, st := range m.sources {
		if st.name == name {
			return fmt.Errorf("registry: add source %q: name already registered", name)
		}
	}
	m.sources = append(m.sources, &sourceState{name: name, src: s})
	return nil
}

// Reload asks every source that implements Reloader to re-read its input
// (SIGHUP).
func (m *Manager) Reload() {
	m.mu.Lock()
	srcs := slices.Clone(m.sources)
	m.mu.Unlock()
	for _, st := range srcs {
		if r, ok := st.src.(Reloader); ok {
			r.Reload()
		}
	}
}

type taggedUpdate struct {
	idx int
	u   Update
}

// Run starts every source and publishes merged states until ctx is
// cancelled; then it waits for the sources to return and returns nil. The
// first state is published only once every source has sent a good
// contribution, so consumers never see a half-loaded registry.
func (m *Manager) Run(ctx context.Context) error {
	m.mu.Lock()
	if m.started {
		m.mu.Unlock()
		return errors.New("registry: manager already running")
	}
	m.started = true
	srcs := slices.Clone(m.sources)
	if st, _ := m.pub.Current(); st != nil && st.Version > 0 {
		m.base = st
	}
	m.mu.Unlock()
	if len(srcs) == 0 {
		return errors.New("registry: no sources registered")
	}

	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()

	in := make(chan taggedUpdate)
	for i, st := range srcs {
		ch := make(chan Update)
		wg.Add(2)
		go func() {
			defer wg.Done()
			st.src.Run(ctx, ch)
			if ctx.Err() == nil {
				m.log.Warn("registry source stopped", "source", st.name)
			}
		}()
		go func() {
			defer wg.Done()
			for {
				select {
				case u := <-ch:
					select {
					case in <- taggedUpdate{i, u}:
					case <-ctx.Done():
						return
					}
				case <-ctx.Done():
					return
				}
			}
		}()
	}

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	// guardTimer fires when a discovery-guard hold ends, to apply again.
	guardTimer := time.NewTimer(time.Hour)
	guardTimer.Stop()
	defer guardTimer.Stop()
	var (
		pending    bool
		burstStart time.Time
	)
	armGuard := func() {
		guardTimer.Stop()
		if at := m.guardDeadline(); !at.IsZero() {
			guardTimer.Reset(max(time.Until(at), 0))
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-guardTimer.C:
			m.apply(srcs)
			armGuard()
		case tu := <-in:
			if !m.receive(srcs[tu.idx], tu.u) {
				continue
			}
			now := time.Now()
			if !pending {
				pending, burstStart = true, now
			}
			wait := min(m.holdoff, burstStart.Add(m.maxDelay).Sub(now))
			if wait <= 0 {
				pending = false
				timer.Stop()
				m.apply(srcs)
				armGuard()
				continue
			}
			timer.Reset(wait)
		case <-timer.C:
			pending = false
			m.apply(srcs)
			armGuard()
		}
	}
}

func (m *Manager) guardDeadline() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.guardAt
}

// receive records an update; it reports whether the merged state may have
// changed.
func (m *Manager) receive(st *sourceState, u Update) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	st.updated = time.Now()
	if u.Err != nil {
		if st.err == nil || st.err.Error() != u.Err.Error() {
			m.log.Error("registry source refresh failed; keeping its last good contribution", "source", st.name, "err", u.Err)
		}
		st.err = u.Err
		return false
	}
	if st.err != nil {
		m.log.Info("registry source recovered", "source", st.name)
	}
	u.Source = st.name
	st.err, st.have, st.contrib = nil, true, u
	return true
}

func (m *Manager) apply(srcs []*sourceState) {
	m.mu.Lock()
	defer m.mu.Unlock()
	updates := make([]Update, 0, len(srcs))
	for _, st := range srcs {
		if !st.have {
			m.log.Debug("registry waiting for source", "source", st.name)
			return
		}
		updates = append(updates, st.contrib)
	}
	s, warnings, err := Merge(updates)
	if !slices.Equal(warnings, m.warnings) {
		for _, w := range warnings {
			m.log.Warn("registry merge", "warning", w)
		}
	}
	m.warnings = warnings
	if err == nil {
		err = Validate(s, m.rules)
	}
	if err == nil {
		prev := m.last
		if prev == nil {
			prev = m.base
		}
		m.guardAt = m.guard.apply(prev, s, time.Now())
	}
	if err != nil {
		if m.applyErr == nil || m.applyErr.Error() != err.Error() {
			m.log.Error("registry state rejected; keeping the last good state", "version", m.version, "err", err)
		}
		m.applyErr = err
		return
	}
	m.applyErr = nil
	if m.last != nil && sameContent(m.last, s) {
		m.log.Debug("registry state unchanged", "version", m.version)
		return
	}
	m.version++
	s.Version = m.version
	m.last = s
	m.pubTime = time.Now()
	m.pub.Publish(s)
	m.log.Info("registry state published", "version", s.Version, "pools", len(s.Pools), "models", len(s.Models), "listeners", len(s.Listeners))
}

func sameContent(a, b *State) bool {
	ac, bc := *a, *b
	ac.Version, bc.Version = 0, 0
	return reflect.DeepEqual(&ac, &bc)
}

// LastError returns why the registry is not serving the sources' latest
// input, or nil: failed source refreshes (each prefixed with the source
// name) and the merge/validation error of the latest attempt, joined.
func (m *Manager) LastError() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, st := range m.sources {
		if st.err != nil {
			errs = append(errs, fmt.Errorf("source %q: %w", st.name, st.err))
		}
	}
	if m.applyErr != nil {
		errs = append(errs, m.applyErr)
	}
	return errors.Join(errs...)
}

// SourceStatus describes one registered source.
type SourceStatus struct {
	Name string
	// Ready is true once the source has sent a good contribution.
	Ready bool
	// Err is the source's latest refresh error (nil when fine).
	Err error
	// Updated is when the source last sent anything.
	Updated time.Time
}

// Status is a snapshot of the Manager for status pages.
type Status struct {
	// Version is the version of the last published state (or the initial
	// version when nothing was published yet).
	Version uint64
	// Published is when Version was published (zero if not yet).
	Published time.Time
	Sources   []SourceStatus
	// Err is the merge/validation error of the latest attempt.
	Err error
	// Warnings are the merge warnings of the latest attempt (dropped
	// endpoints).
	Warnings []string
	// Guards are the pools whose discovery guard holds endpoints now.
	Guards []GuardStatus
	// GuardActivations counts the holds started per pool since start.
	GuardActivations map[string]uint64
}

// Status returns a snapshot of the Manager's state.
func (m *Manager) Status() Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := Status{Version: m.version, Published: m.pubTime, Err: m.applyErr, Warnings: slices.Clone(m.warnings),
		Guards: m.guard.status(), GuardActivations: maps.Clone(m.guard.activations)}
	for _, s := range m.sources {
		st.Sources = append(st.Sources, SourceStatus{Name: s.name, Ready: s.have, Err: s.err, Updated: s.updated})
	}
	return st
}
