// Package usage owns the tenants' usage accounting outside the request
// path: the Ledger receives each request's usage from the picker, counts
// it in hourly buckets (persisted through store.Store, or in memory
// without a store), keeps per tenant and model counters for Prometheus,
// and serves /api/usage (JSON, or CSV for billing).
package usage

import (
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/store"
)

// Ledger counts usage. Its methods are safe for concurrent use.
type Ledger struct {
	st  store.Store // nil: buckets kept in memory
	log *slog.Logger
	now func() time.Time

	mu sync.Mutex
	// mem holds the hourly buckets without a store.
	mem map[store.UsageKey]store.UsageCounts
	// totals since start, per tenant and model (Prometheus counters).
	totals map[series]store.UsageCounts
	// storeErrors counts records the store could not journal.
	storeErrors atomic.Int64
}

type series struct{ tenant, model string }

var _ tenant.Recorder = (*Ledger)(nil)

// New returns a Ledger persisting through st (nil: memory only, lost on
// restart).
func New(st store.Store, log *slog.Logger) *Ledger {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Ledger{st: st, log: log, now: time.Now, mem: map[store.UsageKey]store.UsageCounts{}, totals: map[series]store.UsageCounts{}}
}

func counts(u tenant.Usage) store.UsageCounts {
	return store.UsageCounts{Requests: u.Requests, Errors: u.Errors,
		PromptTokens: u.PromptTokens, CachedTokens: u.CachedTokens, CompletionTokens: u.CompletionTokens}
}

func add(dst *store.UsageCounts, c store.UsageCounts) {
	dst.Requests += c.Requests
	dst.Errors += c.Errors
	dst.PromptTokens += c.PromptTokens
	dst.CachedTokens += c.CachedTokens
	dst.CompletionTokens += c.CompletionTokens
}

// Record implements tenant.Recorder: it counts u in its hourly bucket
// (durable when it returns, with a store) and in the totals.
func (l *Ledger) Record(u tenant.Usage) {
	c := counts(u)
	if l.st != nil {
		if err := l.st.AddUsage(u.Time, u.Tenant, u.Model, c); err != nil {
			// Still counted in memory by the store; say so once in a while.
			if l.storeErrors.Add(1)%1000 == 1 {
				l.log.Warn("usage not journaled; it is committed with the store's next write", "err", err)
			}
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.st == nil {
		k := store.UsageKey{Hour: store.UsageHour(u.Time), Tenant: u.Tenant, Model: u.Model}
		sum := l.mem[k]
		add(&sum, c)
		l.mem[k] = sum
	}
	s := series{u.Tenant, u.Model}
	sum := l.totals[s]
	add(&sum, c)
	l.totals[s] = sum
}

// Query returns the hourly buckets starting in [from, to) (from rounded
// down to its hour), sorted by hour, tenant and model.
func (l *Ledger) Query(from, to time.Time) ([]store.UsageRow, error) {
	if l.st != nil {
		return l.st.Usage(from, to)
	}
	from = store.UsageHour(from)
	l.mu.Lock()
	defer l.mu.Unlock()
	var rows []store.UsageRow
	for k, c := range l.mem {
		if !k.Hour.Before(from) && k.Hour.Before(to) {
			rows = append(rows, store.UsageRow{UsageKey: k, UsageCounts: c})
		}
	}
	store.SortUsage(rows)
	return rows, nil
}

// Total is one tenant and model's usage over some period.
type Total struct {
	Tenant, Model string
	store.UsageCounts
}

// Sum adds rows up per tenant and model, sorted by tenant and model.
func Sum(rows []store.UsageRow) []Total {
	m := map[series]store.UsageCounts{}
	for _, r := range rows {
		s := series{r.Tenant, r.Model}
		sum := m[s]
		add(&sum, r.UsageCounts)
		m[s] = sum
	}
	return sorted(m)
}

func sorted(m map[series]store.UsageCounts) []Total {
	keys := slices.SortedFunc(maps.Keys(m), func(a, b series) int {
		if c := strings.Compare(a.tenant, b.tenant); c != 0 {
			return c
		}
		return strings.Compare(a.model, b.model)
	})
	out := make([]Total, 0, len(keys))
	for _, k := range keys {
		out = append(out, Total{Tenant: k.tenant, Model: k.model, UsageCounts: m[k]})
	}
	return out
}

// SinceStart returns the totals counted since this process started.
func (l *Ledger) SinceStart() []Total {
	l.mu.Lock()
	defer l.mu.Unlock()
	return sorted(maps.Clone(l.totals))
}

// Today returns each tenant and model's usage since midnight UTC (from
// the buckets, so with a store it includes what earlier runs counted).
func (l *Ledger) Today() ([]Total, error) {
	now := l.now().UTC()
	rows, err := l.Query(now.Truncate(24*time.Hour), now.Add(time.Hour))
	if err != nil {
		return nil, err
	}
	return Sum(rows), nil
}
