// Package tenant owns the picker's view of tenants: reading a request's
// API key (Authorization: Bearer, x-api-key), finding its tenant by
// comparing the key's SHA-256 digest in constant time with the configured
// hashes, which models the tenant may use, and its request and token
// budgets (sliding-window limiters that survive configuration reloads and
// are split evenly among the replicas). It also defines the usage record
// the picker reports for every request of a tenant.
//
// The picker builds a Table from every registry state (Set.Build) and reads
// it per request; the Table is immutable, the limiters behind it are
// guarded per tenant.
package tenant

import (
	"crypto/subtle"
	"encoding/binary"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/registry"
)

// Window lengths and their slot counts (precision: a charge is counted for
// its window plus at most one slot).
const (
	minuteSlots = 60   // 1 s slots
	daySlots    = 1440 // 1 min slots
)

// Set keeps each tenant's limiter across configuration reloads (keyed by
// tenant name), and builds Tables.
type Set struct {
	mu       sync.Mutex
	limiters map[string]*limiter
}

// NewSet returns an empty Set.
func NewSet() *Set { return &Set{limiters: map[string]*limiter{}} }

// Table is one configuration's tenants: immutable, read by every request.
type Table struct {
	tenants map[string]*Tenant
	// byPrefix indexes key digests by their first 4 bytes; candidates are
	// then compared in full in constant time.
	byPrefix map[uint32][]keyEntry
	// Hide answers a forbidden model with 404 instead of 403.
	Hide bool
	// Replicas is how many replicas the budgets are split among.
	Replicas int
}

type keyEntry struct {
	d apikey.Digest
	t *Tenant
}

// Tenant is one tenant of a Table.
type Tenant struct {
	Name string
	// Priority is the tenant's default admission priority (nil: none).
	Priority *int
	// models the tenant may request (nil: every model).
	models map[string]bool
	// Limits as configured (for the whole fleet), and the share this
	// replica enforces.
	Limits registry.Limits
	local  registry.Limits
	lim    *limiter
}

// Build returns the Table of st's tenants, or nil when st has none (then
// nothing is authenticated). Limiters of tenants that still exist keep
// their counts; replicas is the number of replicas serving st (at least 1).
func (s *Set) Build(st *registry.State, replicas int) *Table {
	if st == nil || len(st.Tenants) == 0 {
		return nil
	}
	replicas = max(replicas, 1)
	s.mu.Lock()
	defer s.mu.Unlock()
	t := &Table{tenants: make(map[string]*Tenant, len(st.Tenants)), byPrefix: map[uint32][]keyEntry{},
		Hide: st.TenantSettings.HideForbiddenModels, Replicas: replicas}
	for _, name := range st.TenantNames() {
		rt := st.Tenants[name]
		lim := s.limiters[name]
		if lim == nil {
			lim = newLimiter()
			s.limiters[name] = lim
		}
		tn := &Tenant{Name: name, Priority: rt.Priority, Limits: rt.Limits, local: split(rt.Limits, replicas), lim: lim}
		if len(rt.Models) > 0 {
			tn.models = make(map[string]bool, len(rt.Models))
			for _, m := range rt.Models {
				tn.models[m] = true
			}
		}
		t.tenants[name] = tn
		for _, h := range rt.KeyHashes {
			d, err := apikey.ParseHash(h)
			if err != nil {
				continue // the configuration source checked it
			}
			p := binary.BigEndian.Uint32(d[:4])
			t.byPrefix[p] = append(t.byPrefix[p], keyEntry{d: d, t: tn})
		}
	}
	for name := range s.limiters {
		if _, ok := st.Tenants[name]; !ok {
			delete(s.limiters, name)
		}
	}
	return t
}

// split returns each replica's share of l: every budget divided by the
// replicas, rounded up (so small budgets never round to zero).
func split(l registry.Limits, replicas int) registry.Limits {
	div := func(v int64) int64 {
		if v <= 0 {
			return v
		}
		return (v + int64(replicas) - 1) / int64(replicas)
	}
	l.RequestsPerMinute, l.TokensPerMinute, l.TokensPerDay = div(l.RequestsPerMinute), div(l.TokensPerMinute), div(l.TokensPerDay)
	return l
}

// Authenticate returns the tenant whose API key is key, or nil. The
// digest of key is compared in constant time with every configured digest
// sharing its first 4 bytes; which digests are looked at depends only on
// the digest of what the client sent, which tells it nothing about the
// configured keys.
func (t *Table) Authenticate(key []byte) *Tenant {
	if t == nil || len(key) == 0 {
		return nil
	}
	d := apikey.Sum(key)
	var found *Tenant
	for _, e := range t.byPrefix[binary.BigEndian.Uint32(d[:4])] {
		if subtle.ConstantTimeCompare(e.d[:], d[:]) == 1 {
			found = e.t
		}
	}
	return found
}

// Tenant returns the named tenant (nil if not in the table).
func (t *Table) Tenant(name string) *Tenant {
	if t == nil {
		return nil
	}
	return t.tenants[name]
}

// Names returns the table's tenant names (unsorted).
func (t *Table) Names() []string {
	if t == nil {
		return nil
	}
	out := make([]string, 0, len(t.tenants))
	for n := range t.tenants {
		out = append(out, n)
	}
	return out
}

// Allows reports whether the tenant may request model.
func (tn *Tenant) Allows(model string) bool { return tn.models == nil || tn.models[model] }

// Lists reports whether the tenant's models list names model (false when
// it has none).
func (tn *Tenant) Lists(model string) bool { return tn.models[model] }

// Reservation is what Admit charged for one request; Settle corrects it
// once the response tells the real usage.
type Reservation struct {
	At     time.Time
	Tokens int64
}

// Denial says why Admit refused a request.
type Denial struct {
	// Limit names the budget: "requests_per_minute", "tokens_per_minute"
	// or "tokens_per_day".
	Limit string
	// Configured is that budget for the whole fleet, Local this replica's
	// share, Used what this replica counts now, Need the request's charge.
	Configured, Local, Used, Need int64
	// RetryAfter is when the request would fit.
	RetryAfter time.Duration
}

// limiter is a tenant's windows, guarded by mu.
type limiter struct {
	mu                   sync.Mutex
	reqMinute, tokMinute *window
	tokDay               *window
}

func newLimiter() *limiter {
	return &limiter{
		reqMinute: newWindow(time.Minute, minuteSlots),
		tokMinute: newWindow(time.Minute, minuteSlots),
		tokDay:    newWindow(24*time.Hour, daySlots),
	}
}

// budget pairs a window with this replica's limit for it.
type budget struct {
	name  string
	w     *window
	local int64
	conf  int64
}

func (tn *Tenant) budgets(tokens bool) []budget {
	l, c := tn.local, tn.Limits
	out := make([]budget, 0, 3)
	if l.RequestsPerMinute > 0 {
		out = append(out, budget{"requests_per_minute", tn.lim.reqMinute, l.RequestsPerMinute, c.RequestsPerMinute})
	}
	if tokens && l.TokensPerMinute > 0 {
		out = append(out, budget{"tokens_per_minute", tn.lim.tokMinute, l.TokensPerMinute, c.TokensPerMinute})
	}
	if tokens && l.TokensPerDay > 0 {
		out = append(out, budget{"tokens_per_day", tn.lim.tokDay, l.TokensPerDay, c.TokensPerDay})
	}
	return out
}

// Admit charges one request and tokens (the request's estimated prompt
// plus its max_tokens) against every budget the tenant has, or, when one
// would be exceeded, charges nothing and says which. A request larger than
// a whole token budget is admitted only when nothing else is counted in
// that window (else it could never pass).
func (tn *Tenant) Admit(now time.Time, tokens int64) (Reservation, *Denial) {
	if !tn.local.Any() {
		return Reservation{At: now}, nil
	}
	tn.lim.mu.Lock()
	defer tn.lim.mu.Unlock()
	bs := tn.budgets(true)
	for _, b := range bs {
		need := tokens
		if b.w == tn.lim.reqMinute {
			need = 1
		}
		used := b.w.used(now)
		if used+need <= b.local || (used == 0 && need > b.local) {
			continue
		}
		return Reservation{}, &Denial{Limit: b.name, Configured: b.conf, Local: b.local, Used: used, Need: need,
			RetryAfter: b.w.waitFor(now, min(need, b.local), b.local)}
	}
	for _, b := range bs {
		if b.w == tn.lim.reqMinute {
			b.w.add(now, now, 1)
		} else {
			b.w.add(now, now, tokens)
		}
	}
	return Reservation{At: now, Tokens: tokens}, nil
}

// Settle replaces a reservation's token charge with actual: a refund goes
// back where the reservation was charged (while that is still counted),
// an extra charge is counted now.
func (tn *Tenant) Settle(now time.Time, r Reservation, actual int64) {
	delta := actual - r.Tokens
	if delta == 0 || !tn.local.Any() {
		return
	}
	tn.lim.mu.Lock()
	defer tn.lim.mu.Unlock()
	for _, b := range tn.budgets(true) {
		if b.w == tn.lim.reqMinute {
			continue
		}
		if delta < 0 {
			b.w.add(now, r.At, delta)
		} else {
			b.w.add(now, now, delta)
		}
	}
}

// MaxHeaders is how many rate-limit headers Headers may produce.
const MaxHeaders = 9

// Headers is a set of rate-limit headers built without an allocation per
// header: Key(i) and Value(i) for i < Len().
type Headers struct {
	n    int
	keys [MaxHeaders]string
	ends [MaxHeaders]int
	buf  []byte
}

// Len is the number of headers.
func (h *Headers) Len() int { return h.n }

// Key returns header i's name.
func (h *Headers) Key(i int) string { return h.keys[i] }

// Value returns header i's value (it aliases the set's buffer).
func (h *Headers) Value(i int) []byte {
	start := 0
	if i > 0 {
		start = h.ends[i-1]
	}
	return h.buf[start:h.ends[i]:h.ends[i]]
}

func (h *Headers) add(key string, appendValue func([]byte) []byte) {
	h.buf = appendValue(h.buf)
	h.keys[h.n], h.ends[h.n] = key, len(h.buf)
	h.n++
}

// Header names, per budget: limit, remaining, reset.
var headerNames = map[string][3]string{
	"requests_per_minute": {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"},
	"tokens_per_minute":   {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"},
	"tokens_per_day":      {"x-ratelimit-limit-tokens-per-day", "x-ratelimit-remaining-tokens-per-day", "x-ratelimit-reset-tokens-per-day"},
}

// Headers fills h with OpenAI's rate-limit headers for the tenant at now:
// x-ratelimit-limit-*, x-ratelimit-remaining-* and x-ratelimit-reset-*
// for requests and tokens (per minute), and the same with a
// "-tokens-per-day" suffix for the day budget; only for budgets the
// tenant has. Limits are the configured (fleet-wide) ones; remaining is
// this replica's remaining share times the replicas, an estimate of the
// fleet's; reset is when this replica's window would be empty.
func (tn *Tenant) Headers(now time.Time, replicas int, h *Headers) {
	h.n, h.buf = 0, h.buf[:0]
	if !tn.local.Any() {
		return
	}
	tn.lim.mu.Lock()
	defer tn.lim.mu.Unlock()
	for _, b := range tn.budgets(true) {
		names := headerNames[b.name]
		remaining := min(max(b.local-b.w.used(now), 0)*int64(max(replicas, 1)), b.conf)
		reset := b.w.reset(now)
		h.add(names[0], func(d []byte) []byte { return strconv.AppendInt(d, b.conf, 10) })
		h.add(names[1], func(d []byte) []byte { return strconv.AppendInt(d, remaining, 10) })
		h.add(names[2], func(d []byte) []byte { return AppendReset(d, reset) })
	}
}

// Used returns what this replica counts now against each budget the
// tenant has, keyed by budget name (for status pages).
func (tn *Tenant) Used(now time.Time) map[string]int64 {
	tn.lim.mu.Lock()
	defer tn.lim.mu.Unlock()
	out := map[string]int64{}
	for _, b := range tn.budgets(true) {
		out[b.name] = b.w.used(now)
	}
	return out
}

// Local returns this replica's share of the tenant's limits.
func (tn *Tenant) Local() registry.Limits { return tn.local }

// FormatReset renders a duration as OpenAI's reset headers do: "1s",
// "6m0s", "0.5s", rounded up to the millisecond.
func FormatReset(d time.Duration) string { return string(AppendReset(nil, d)) }

// AppendReset appends FormatReset(d) to b.
func AppendReset(b []byte, d time.Duration) []byte {
	if d <= 0 {
		return append(b, "0s"...)
	}
	d = (d + time.Millisecond - 1).Truncate(time.Millisecond)
	if d < time.Second {
		return append(strconv.AppendFloat(b, d.Seconds(), 'f', -1, 64), 's')
	}
	if d%time.Second == 0 && d < time.Minute {
		return append(strconv.AppendInt(b, int64(d/time.Second), 10), 's')
	}
	return append(b, d.String()...)
}

// RetryAfterSeconds is the retry-after header value for d: whole seconds,
// rounded up, at least 1.
func RetryAfterSeconds(d time.Duration) string {
	return strconv.FormatInt(max(int64(math.Ceil(d.Seconds())), 1), 10)
}

// SetBuffer gives the set a buffer for its values to start with (the
// values are appended to it, growing it if needed).
func (h *Headers) SetBuffer(b []byte) { h.buf = b }
