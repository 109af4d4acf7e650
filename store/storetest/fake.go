// Package storetest provides Fake, an in-memory store.Store for the unit
// tests of the components that persist through a store.
package storetest

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
)

// Fake is an in-memory store.Store. Like store.File, saves are pending
// until Flush (or Close) makes them durable, and Load returns only what is
// durable, so a test can tell a save from a flush. Unlike File it applies
// no size limits besides store.DefaultMaxPrefixBlob per prefix blob, and
// drops only expired sessions. The zero value is not usable; call New.
type Fake struct {
	mu       sync.Mutex
	now      func() time.Time
	durable  snapshot
	pending  snapshot
	dirty    bool
	closed   bool
	flushes  int
	lastErr  error
	flushErr error
	closeErr error
	// usage is durable as soon as it is added, as store.File's journal
	// makes it.
	usage map[store.UsageKey]store.UsageCounts
}

// snapshot is the fake's own copy of a store's content; a nil map or
// state means "unchanged" in the pending copy.
type snapshot struct {
	state    *registry.State
	metrics  map[store.EndpointKey]store.Metrics
	health   map[store.EndpointKey]store.Health
	sessions []store.Session
	prefix   map[store.EndpointKey][]byte // pending: nil value deletes
	consul   map[string]uint64            // pending: 0 deletes
	created  time.Time
}

var _ store.Store = (*Fake)(nil)

// New returns an empty fake store, as if a new file had been created.
func New() *Fake {
	return &Fake{
		now: time.Now,
		durable: snapshot{
			metrics: map[store.EndpointKey]store.Metrics{},
			health:  map[store.EndpointKey]store.Health{},
			prefix:  map[store.EndpointKey][]byte{},
			consul:  map[string]uint64{},
			created: time.Now().UTC(),
		},
	}
}

// NewFrom returns a fake store holding what snap holds, as if a previous
// run had left it: use it to test warm starts.
func NewFrom(snap *store.Snapshot) *Fake {
	f := New()
	d := &f.durable
	d.state = snap.State()
	d.metrics = maps.Clone(snap.Metrics)
	d.health = maps.Clone(snap.Health)
	for k, b := range snap.Prefix {
		d.prefix[k] = append([]byte(nil), b...)
	}
	d.sessions = append([]store.Session(nil), snap.Sessions...)
	d.consul = maps.Clone(snap.ConsulIndexes)
	if !snap.CreatedAt.IsZero() {
		d.created = snap.CreatedAt
	}
	return f
}

// SetClock sets the clock used for session expiry (time.Now by default).
func (f *Fake) SetClock(now func() time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = now
}

// FailFlushes makes every later Flush (and the final flush of Close) fail
// with err, keeping the saves pending, until it is called with nil.
func (f *Fake) FailFlushes(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.flushErr = err
}

// Flushes returns how many flushes have committed something.
func (f *Fake) Flushes() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.flushes
}

// Closed reports whether Close was called.
func (f *Fake) Closed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.closed
}

// Load implements store.Store: it returns a copy of what is durable.
func (f *Fake) Load() (*store.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, store.ErrClosed
	}
	d := &f.durable
	sn := store.NewSnapshot()
	sn.SetState(d.state)
	maps.Copy(sn.Metrics, d.metrics)
	maps.Copy(sn.Health, d.health)
	for k, b := range d.prefix {
		sn.Prefix[k] = append([]byte(nil), b...)
	}
	now := f.now()
	for _, s := range d.sessions {
		if s.Expires.After(now) {
			sn.Sessions = append(sn.Sessions, s)
		}
	}
	maps.Copy(sn.ConsulIndexes, d.consul)
	sn.CreatedAt = d.created
	return sn, nil
}

// record applies fn to the pending saves unless the fake is closed.
func (f *Fake) record(fn func(p *snapshot)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.closed {
		fn(&f.pending)
		f.dirty = true
	}
}

// SaveState implements store.Store; st must not be modified afterwards.
func (f *Fake) SaveState(st *registry.State) {
	if st != nil {
		f.record(func(p *snapshot) { p.state = st })
	}
}

// SaveMetrics implements store.Store.
func (f *Fake) SaveMetrics(m map[store.EndpointKey]store.Metrics) {
	cp := maps.Clone(m)
	if cp == nil {
		cp = map[store.EndpointKey]store.Metrics{}
	}
	f.record(func(p *snapshot) { p.metrics = cp })
}

// SaveHealth implements store.Store.
func (f *Fake) SaveHealth(h map[store.EndpointKey]store.Health) {
	cp := maps.Clone(h)
	if cp == nil {
		cp = map[store.EndpointKey]store.Health{}
	}
	f.record(func(p *snapshot) { p.health = cp })
}

// SavePrefix implements store.Store; a nil or empty blob deletes.
func (f *Fake) SavePrefix(pool, endpoint string, blob []byte) error {
	if pool == "" || endpoint == "" {
		return fmt.Errorf("storetest: empty prefix key %q/%q", pool, endpoint)
	}
	if len(blob) > store.DefaultMaxPrefixBlob {
		return fmt.Errorf("storetest: prefix blob for %s/%s is %d bytes: %w", pool, endpoint, len(blob), store.ErrTooLarge)
	}
	if f.Closed() {
		return store.ErrClosed
	}
	var cp []byte
	if len(blob) > 0 {
		cp = append([]byte(nil), blob...)
	}
	f.record(func(p *snapshot) {
		if p.prefix == nil {
			p.prefix = map[store.EndpointKey][]byte{}
		}
		p.prefix[store.EndpointKey{Pool: pool, Address: endpoint}] = cp
	})
	return nil
}

// SaveSessions implements store.Store.
func (f *Fake) SaveSessions(sessions []store.Session) {
	cp := append([]store.Session{}, sessions...)
	f.record(func(p *snapshot) { p.sessions = cp })
}

// SaveConsulIndex implements store.Store; index 0 deletes.
func (f *Fake) SaveConsulIndex(key string, index uint64) {
	f.record(func(p *snapshot) {
		if p.consul == nil {
			p.consul = map[string]uint64{}
		}
		p.consul[key] = index
	})
}

// Flush implements store.Store.
func (f *Fake) Flush(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return store.ErrClosed
	}
	return f.flushLocked()
}

func (f *Fake) flushLocked() error {
	if !f.dirty {
		return nil
	}
	if f.flushErr != nil {
		f.lastErr = f.flushErr
		return f.flushErr
	}
	f.lastErr = nil
	p, d := &f.pending, &f.durable
	if p.state != nil {
		d.state = p.state
	}
	if p.metrics != nil {
		d.metrics = p.metrics
	}
	if p.health != nil {
		d.health = p.health
	}
	if p.sessions != nil {
		d.sessions = p.sessions
	}
	for k, b := range p.prefix {
		if b == nil {
			delete(d.prefix, k)
		} else {
			d.prefix[k] = b
		}
	}
	for k, idx := range p.consul {
		if idx == 0 {
			delete(d.consul, k)
		} else {
			d.consul[k] = idx
		}
	}
	f.pending, f.dirty = snapshot{}, false
	f.flushes++
	return nil
}

// LastError implements store.Store.
func (f *Fake) LastError() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastErr
}

// Close implements store.Store: it flushes what is pending. Calling it
// again returns the same result.
func (f *Fake) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return f.closeErr
	}
	if err := f.flushLocked(); err != nil {
		f.closeErr = fmt.Errorf("storetest: final flush: %w", err)
	}
	f.closed = true
	return f.closeErr
}

// AddUsage implements store.Store: the usage is durable at once (File
// journals it).
func (f *Fake) AddUsage(t time.Time, tenant, model string, c store.UsageCounts) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return store.ErrClosed
	}
	if f.usage == nil {
		f.usage = map[store.UsageKey]store.UsageCounts{}
	}
	k := store.UsageKey{Hour: store.UsageHour(t), Tenant: tenant, Model: model}
	sum := f.usage[k]
	sum.Requests += c.Requests
	sum.Errors += c.Errors
	sum.PromptTokens += c.PromptTokens
	sum.CachedTokens += c.CachedTokens
	sum.CompletionTokens += c.CompletionTokens
	f.usage[k] = sum
	return nil
}

// Usage implements store.Store.
func (f *Fake) Usage(from, to time.Time) ([]store.UsageRow, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, store.ErrClosed
	}
	from = store.UsageHour(from)
	var rows []store.UsageRow
	for k, c := range f.usage {
		if !k.Hour.Before(from) && k.Hour.Before(to) {
			rows = append(rows, store.UsageRow{UsageKey: k, UsageCounts: c})
		}
	}
	store.SortUsage(rows)
	return rows, nil
}
