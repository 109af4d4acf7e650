// Package admission owns the picker's admission queue. When every eligible
// endpoint of a pool is saturated, requests wait here, with their ext_proc
// streams held, instead of piling onto the model servers' first-come-
// first-served queues, and are dispatched one at a time as capacity frees:
// the highest priority band first, fairly between flows (tenants) within a
// band, first come first served within a flow. Every wait is bounded in
// requests, body bytes and time; a request that cannot wait gets a
// Rejection saying why (the picker answers 429 or 503).
//
// One Queue per pool; it outlives configuration reloads (Configure), so
// waiting requests survive them.
package admission

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Fairness names a way to share a band between flows.
type Fairness string

// Fairness policies.
const (
	// FairRoundRobin dispatches the flows of a band in turn.
	FairRoundRobin Fairness = "round-robin"
	// FairTokens dispatches the flow that has received the fewest tokens
	// lately (least attained service, decayed with a 10 s half-life), so
	// a flow of large prompts gets as many tokens as one of small ones,
	// not as many requests.
	FairTokens Fairness = "tokens"
)

// Config is one pool's admission settings. Zero values mean the defaults.
type Config struct {
	// Disabled forwards every request at once, as before admission
	// control existed.
	Disabled bool
	// MaxQueued bounds the waiting requests of the pool (default 1024);
	// MaxQueuedBytes their bodies (default 64 MiB).
	MaxQueued      int
	MaxQueuedBytes int64
	// BandMaxQueued, when > 0, bounds each band.
	BandMaxQueued int
	// TTL is the longest a request waits for capacity (default 30 s).
	TTL time.Duration
	// NoEndpointWait is the longest a request waits when the pool has no
	// ready endpoint at all (default 5 s).
	NoEndpointWait time.Duration
	// Fairness shares a band between flows (default FairTokens).
	Fairness Fairness
	// QueueSheddable queues sheddable requests (priority < 0) in the
	// lowest band when the pool is saturated; by default the picker
	// answers them 429 at once (ReasonShed), as the protocol says.
	QueueSheddable bool
}

// Defaults.
const (
	DefaultMaxQueued      = 1024
	DefaultMaxQueuedBytes = 64 << 20
	DefaultTTL            = 30 * time.Second
	DefaultNoEndpointWait = 5 * time.Second
	DefaultFairness       = FairTokens
)

// WithDefaults fills the zero fields of c.
func (c Config) WithDefaults() Config {
	if c.MaxQueued <= 0 {
		c.MaxQueued = DefaultMaxQueued
	}
	if c.MaxQueuedBytes <= 0 {
		c.MaxQueuedBytes = DefaultMaxQueuedBytes
	}
	if c.TTL <= 0 {
		c.TTL = DefaultTTL
	}
	if c.NoEndpointWait <= 0 {
		c.NoEndpointWait = DefaultNoEndpointWait
	}
	if c.Fairness == "" {
		c.Fairness = DefaultFairness
	}
	return c
}

// Reasons a request is rejected.
const (
	ReasonTTL        = "ttl"         // waited TTL without capacity: 429
	ReasonOverflow   = "overflow"    // queue full (or evicted for a higher band): 429
	ReasonNoEndpoint = "no-endpoint" // no ready endpoint for NoEndpointWait: 503
	ReasonShed       = "shed"        // sheddable and would wait, not QueueSheddable: 429
)

// Rejection is why a request was not admitted.
type Rejection struct {
	Reason string
	// RetryAfter is a hint for the client's retry-after header.
	RetryAfter time.Duration
	msg        string
}

func (r *Rejection) Error() string { return r.msg }

// Request is what the queue knows about one waiting request.
type Request struct {
	// Priority is the request's band: higher goes first.
	Priority int
	// Flow groups requests for fairness (the tenant); "" is one flow.
	Flow string
	// Bytes is the body held while waiting; Tokens the estimated prompt
	// tokens (what FairTokens counts).
	Bytes  int64
	Tokens int64
}

// Capacity is the pool's state as the dispatcher sees it.
type Capacity int

// Capacity values.
const (
	// Full: every endpoint is saturated; requests wait.
	Full Capacity = iota
	// Room: some endpoint can take a request now.
	Room
	// NoEndpoint: the pool has no ready endpoint at all.
	NoEndpoint
)

// Queue is one pool's admission queue. Create it with New and Run its
// dispatcher; Wait from every request that finds the pool saturated.
type Queue struct {
	pool     string
	capacity func() Capacity
	kick     chan struct{}
	now      func() time.Time

	// cfg is read on every request (Config), so it is swapped whole.
	cfg atomic.Pointer[Config]
	// waiting mirrors n for the lock-free Len and Kick.
	waiting atomic.Int64

	mu    sync.Mutex
	bands map[int]*band
	n     int
	bytes int64
	seq   uint64
	stats Stats
	waits *waitHistogram
}

// New returns the queue of pool, whose dispatcher asks capacity whether a
// request may go (the picker's view of the pool, fresh at each call).
func New(pool string, cfg Config, capacity func() Capacity) *Queue {
	q := &Queue{pool: pool, capacity: capacity, kick: make(chan struct{}, 1),
		now: time.Now, bands: map[int]*band{}, waits: newWaitHistogram(), stats: Stats{Rejected: map[string]uint64{}}}
	q.Configure(cfg)
	return q
}

// Configure replaces the settings (a reload); waiting requests stay, and
// new bounds apply to the requests that arrive from now on (a waiting
// request keeps the TTL and NoEndpointWait it arrived under).
func (q *Queue) Configure(cfg Config) {
	cfg = cfg.WithDefaults()
	q.cfg.Store(&cfg)
	q.Kick()
}

// Config returns the settings in force.
func (q *Queue) Config() Config { return *q.cfg.Load() }

// Kick tells the dispatcher that capacity may have freed (a request ended,
// new metrics arrived). It never blocks, and costs an atomic load when
// nothing waits.
func (q *Queue) Kick() {
	if q.waiting.Load() == 0 {
		return
	}
	select {
	case q.kick <- struct{}{}:
	default:
	}
}

// Len returns the requests waiting.
func (q *Queue) Len() int { return int(q.waiting.Load()) }

// item is one waiting request.
type item struct {
	req      Request
	seq      uint64
	enqueued time.Time
	// ttl and noEndpointWait are the bounds in force when it arrived.
	ttl, noEndpointWait time.Duration
	// granted carries nil (go) or the *Rejection; buffered, written once.
	granted chan error
	// picked is closed by the request once it has picked (Ticket.Done),
	// so the dispatcher re-checks capacity with that pick counted.
	picked chan struct{}
	done   bool // granted or rejected (under Queue.mu)
	band   *band
	flow   *flow
	index  int // in flow.items
}

// Ticket is a dispatched request's handle: call Done once it has picked
// its endpoint (or given up), so the dispatcher sees the pick before it
// dispatches the next one.
type Ticket struct{ it *item }

// Done releases the dispatcher.
func (t Ticket) Done() {
	if t.it != nil {
		select {
		case <-t.it.picked:
		default:
			close(t.it.picked)
		}
	}
}

// ErrCancelled is returned by Wait when the request went away first.
var ErrCancelled = errors.New("admission: the request ended while waiting")

// Wait queues r until the dispatcher grants it (a Ticket; call Done after
// picking), rejects it (*Rejection), or ctx ends (ErrCancelled: the client
// or Envoy gave up). While the pool has no ready endpoint at all the
// shorter NoEndpointWait applies instead of TTL.
func (q *Queue) Wait(ctx context.Context, r Request) (Ticket, error) {
	it := &item{req: r, granted: make(chan error, 1), picked: make(chan struct{})}
	if err := q.push(it); err != nil {
		return Ticket{}, err
	}
	q.Kick()
	select {
	case err := <-it.granted:
		if err != nil {
			return Ticket{}, err
		}
		return Ticket{it: it}, nil
	case <-ctx.Done():
		q.mu.Lock()
		if it.done {
			// Granted (or rejected) just now: honour the grant's hand-off.
			q.mu.Unlock()
			if err := <-it.granted; err == nil {
				close(it.picked)
			}
			return Ticket{}, ErrCancelled
		}
		q.remove(it)
		q.stats.Cancelled++
		q.waits.observe(it.req.Priority, OutcomeCancelled, q.now().Sub(it.enqueued))
		q.mu.Unlock()
		return Ticket{}, ErrCancelled
	}
}

// push adds it, evicting from a lower band when the queue is full.
func (q *Queue) push(it *item) error {
	cfg := q.Config()
	q.mu.Lock()
	defer q.mu.Unlock()
	it.enqueued = q.now()
	it.ttl, it.noEndpointWait = cfg.TTL, cfg.NoEndpointWait
	b := q.bands[it.req.Priority]
	bandFull := cfg.BandMaxQueued > 0 && b != nil && b.n >= cfg.BandMaxQueued
	for bandFull || q.n >= cfg.MaxQueued || q.bytes+it.req.Bytes > cfg.MaxQueuedBytes {
		if bandFull || !q.evictBelow(it.req.Priority) {
			q.stats.Rejected[ReasonOverflow]++
			q.waits.observe(it.req.Priority, OutcomeOverflow, 0)
			return &Rejection{Reason: ReasonOverflow, RetryAfter: time.Second,
				msg: fmt.Sprintf("pool %q: the admission queue is full (%d requests, %d bytes waiting)", q.pool, q.n, q.bytes)}
		}
	}
	if b == nil {
		b = &band{priority: it.req.Priority, flows: map[string]*flow{}}
		q.bands[it.req.Priority] = b
	}
	f := b.flows[it.req.Flow]
	if f == nil {
		f = &flow{key: it.req.Flow, lastActive: q.now()}
		b.flows[it.req.Flow] = f
	}
	q.seq++
	it.seq, it.band, it.flow = q.seq, b, f
	it.index = len(f.items)
	f.items = append(f.items, it)
	b.n++
	q.n++
	q.waiting.Add(1)
	q.bytes += it.req.Bytes
	q.stats.Enqueued++
	return nil
}

// evictBelow rejects the newest request of the lowest band below priority
// to make room; false when there is none.
func (q *Queue) evictBelow(priority int) bool {
	lowest := math.MaxInt
	for p, b := range q.bands {
		if b.n > 0 && p < lowest {
			lowest = p
		}
	}
	if lowest == math.MaxInt || lowest >= priority {
		return false
	}
	b := q.bands[lowest]
	var victim *item
	for _, f := range b.flows {
		if n := len(f.items); n > 0 && (victim == nil || f.items[n-1].seq > victim.seq) {
			victim = f.items[n-1]
		}
	}
	q.remove(victim)
	q.finish(victim, OutcomeEvicted, &Rejection{Reason: ReasonOverflow, RetryAfter: time.Second,
		msg: fmt.Sprintf("pool %q: evicted from the admission queue for a higher-priority request", q.pool)})
	q.stats.Rejected[ReasonOverflow]++
	return true
}

// remove takes it out of its flow (under mu).
func (q *Queue) remove(it *item) {
	f := it.flow
	f.items = append(f.items[:it.index], f.items[it.index+1:]...)
	for i := it.index; i < len(f.items); i++ {
		f.items[i].index = i
	}
	it.band.n--
	q.n--
	q.waiting.Add(-1)
	q.bytes -= it.req.Bytes
}

// finish hands it its outcome (under mu).
func (q *Queue) finish(it *item, outcome string, err error) {
	it.done = true
	q.waits.observe(it.req.Priority, outcome, q.now().Sub(it.enqueued))
	it.granted <- err
}

// band is the requests of one priority.
type band struct {
	priority int
	flows    map[string]*flow
	n        int
	rr       uint64 // round-robin position
}

// flow is one tenant's requests within a band, oldest first.
type flow struct {
	key   string
	items []*item
	// attained is the decayed tokens this flow was granted (FairTokens).
	attained   float64
	lastActive time.Time
	served     uint64 // requests dispatched while the flow is remembered
	tokens     uint64 // and their tokens
}

// attainedHalfLife is how fast FairTokens forgets what a flow received.
const attainedHalfLife = 10 * time.Second

func (f *flow) decayed(now time.Time) float64 {
	dt := now.Sub(f.lastActive)
	if dt <= 0 {
		return f.attained
	}
	return f.attained * math.Exp2(-float64(dt)/float64(attainedHalfLife))
}

// next picks the request to dispatch: the highest band with requests,
// then the flow its fairness policy says, then that flow's oldest.
func (q *Queue) next(now time.Time) *item {
	var best *band
	for _, b := range q.bands {
		if b.n > 0 && (best == nil || b.priority > best.priority) {
			best = b
		}
	}
	if best == nil {
		return nil
	}
	var flows []*flow
	for _, f := range best.flows {
		if len(f.items) > 0 {
			flows = append(flows, f)
		}
	}
	sort.Slice(flows, func(i, j int) bool { return flows[i].key < flows[j].key })
	var pick *flow
	switch q.Config().Fairness {
	case FairRoundRobin:
		pick = flows[best.rr%uint64(len(flows))]
		best.rr++
	default: // FairTokens: least attained service; ties by the oldest head
		for _, f := range flows {
			if pick == nil {
				pick = f
				continue
			}
			a, b := f.decayed(now), pick.decayed(now)
			if a < b || (a == b && f.items[0].seq < pick.items[0].seq) {
				pick = f
			}
		}
	}
	it := pick.items[0]
	pick.attained = pick.decayed(now) + float64(max(it.req.Tokens, 1))
	pick.lastActive = now
	pick.served++
	pick.tokens += uint64(max(it.req.Tokens, 0))
	return it
}

// Outcomes of a wait (WaitKey.Outcome, the metrics' outcome label).
const (
	OutcomeDispatched = "dispatched"
	OutcomeTTL        = "rejected_ttl"
	OutcomeNoEndpoint = "rejected_no_endpoint"
	OutcomeOverflow   = "rejected_overflow"
	OutcomeEvicted    = "evicted"
	OutcomeCancelled  = "cancelled"
)

// dispatchTimeout bounds how long the dispatcher waits for a granted
// request to pick before it looks at capacity again.
const dispatchTimeout = 500 * time.Millisecond

// tick is how often the dispatcher looks without a kick (new metrics
// arrive every scrape interval; expiry needs a clock).
const tick = 10 * time.Millisecond

// Run dispatches until ctx ends; then every waiting request is rejected
// (the picker is stopping). While requests wait (or idle flows are still
// remembered) it also looks every tick; otherwise it sleeps until a
// request arrives.
func (q *Queue) Run(ctx context.Context) {
	t := time.NewTimer(tick)
	defer t.Stop()
	defer q.rejectAll()
	for {
		var tickC <-chan time.Time
		if q.busy() {
			t.Reset(tick)
			tickC = t.C
		}
		select {
		case <-ctx.Done():
			return
		case <-q.kick:
		case <-tickC:
		}
		q.expire()
		for {
			it := q.grantNext()
			if it == nil {
				break
			}
			select {
			case <-it.picked:
			case <-time.After(dispatchTimeout):
			case <-ctx.Done():
				return
			}
		}
	}
}

// busy reports whether the dispatcher has timed work: requests waiting,
// or flows remembered that forget must drop.
func (q *Queue) busy() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n > 0 || len(q.bands) > 0
}

// grantNext grants the next request if the pool has room.
func (q *Queue) grantNext() *item {
	q.mu.Lock()
	empty := q.n == 0
	q.mu.Unlock()
	if empty || q.capacity() != Room {
		return nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	it := q.next(q.now())
	if it == nil {
		return nil
	}
	q.remove(it)
	q.stats.Dispatched++
	q.finish(it, OutcomeDispatched, nil)
	return it
}

// expire rejects the requests that waited too long: their TTL, or their
// shorter NoEndpointWait while the pool has no endpoint at all (the
// bounds in force when each arrived).
func (q *Queue) expire() {
	q.mu.Lock()
	empty := q.n == 0
	q.forget(q.now())
	q.mu.Unlock()
	if empty {
		return
	}
	noEndpoint := q.capacity() == NoEndpoint
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.now()
	for _, b := range q.bands {
		for _, f := range b.flows {
			for i := 0; i < len(f.items); {
				it := f.items[i]
				waited := now.Sub(it.enqueued)
				switch {
				case noEndpoint && waited >= it.noEndpointWait:
					q.remove(it)
					q.stats.Rejected[ReasonNoEndpoint]++
					q.finish(it, OutcomeNoEndpoint, &Rejection{Reason: ReasonNoEndpoint, RetryAfter: 5 * time.Second,
						msg: fmt.Sprintf("no ready endpoint in pool %q for %v", q.pool, waited.Round(time.Millisecond))})
				case waited >= it.ttl:
					q.remove(it)
					q.stats.Rejected[ReasonTTL]++
					q.finish(it, OutcomeTTL, &Rejection{Reason: ReasonTTL, RetryAfter: time.Second,
						msg: fmt.Sprintf("pool %q stayed saturated for %v: the request waited its whole admission TTL", q.pool, waited.Round(time.Millisecond))})
				default:
					i++
				}
			}
		}
	}
}

// forgetBelow is the decayed service under which an idle flow is dropped:
// it would be dispatched first anyway, as a new flow is.
const forgetBelow = 1.0

// forget drops idle flows whose attained service has decayed away, and
// empty bands, so memory follows the flows waiting now, not every flow
// ever seen (under mu).
func (q *Queue) forget(now time.Time) {
	for p, b := range q.bands {
		for k, f := range b.flows {
			if len(f.items) == 0 && f.decayed(now) < forgetBelow {
				delete(b.flows, k)
			}
		}
		if b.n == 0 && len(b.flows) == 0 {
			delete(q.bands, p)
		}
	}
}

// Flows returns how many flows the queue remembers (waiting or recently
// served), for tests and status.
func (q *Queue) Flows() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for _, b := range q.bands {
		n += len(b.flows)
	}
	return n
}

// rejectAll rejects every waiting request (shutdown).
func (q *Queue) rejectAll() {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, b := range q.bands {
		for _, f := range b.flows {
			for len(f.items) > 0 {
				it := f.items[0]
				q.remove(it)
				q.finish(it, OutcomeNoEndpoint, &Rejection{Reason: ReasonNoEndpoint, RetryAfter: time.Second,
					msg: fmt.Sprintf("pool %q: the picker is stopping", q.pool)})
			}
		}
	}
}

// Stats is a snapshot of a queue for status and metrics.
type Stats struct {
	Pool string
	// Config is the queue's settings (filled by the picker).
	Config Config
	// Enqueued, Dispatched and Cancelled count requests; Rejected counts
	// them by reason.
	Enqueued, Dispatched, Cancelled uint64
	Rejected                        map[string]uint64
	// Waiting is the requests waiting now, by band and flow.
	Waiting []Waiting
	// Wait is the histogram of waits by band and outcome.
	Wait map[WaitKey]Histogram
	// Flows are the flows the queue remembers, by band and name.
	Flows []FlowStats
}

// Waiting is one band and flow's waiting requests.
type Waiting struct {
	Priority int
	Flow     string
	Requests int
	Bytes    int64
}

// FlowStats is what one band's flow was dispatched since the queue began
// remembering it (it forgets a flow once idle and its service decayed).
type FlowStats struct {
	Priority         int
	Flow             string
	Dispatched       uint64
	DispatchedTokens uint64
}

// Stats returns the queue's counters and what waits now.
func (q *Queue) Stats() Stats {
	q.mu.Lock()
	defer q.mu.Unlock()
	s := q.stats
	s.Pool = q.pool
	s.Rejected = map[string]uint64{}
	for k, v := range q.stats.Rejected {
		s.Rejected[k] = v
	}
	for _, b := range q.bands {
		for _, f := range b.flows {
			s.Flows = append(s.Flows, FlowStats{Priority: b.priority, Flow: f.key, Dispatched: f.served, DispatchedTokens: f.tokens})
			if len(f.items) == 0 {
				continue
			}
			w := Waiting{Priority: b.priority, Flow: f.key, Requests: len(f.items)}
			for _, it := range f.items {
				w.Bytes += it.req.Bytes
			}
			s.Waiting = append(s.Waiting, w)
		}
	}
	sort.Slice(s.Waiting, func(i, j int) bool {
		if s.Waiting[i].Priority != s.Waiting[j].Priority {
			return s.Waiting[i].Priority > s.Waiting[j].Priority
		}
		return s.Waiting[i].Flow < s.Waiting[j].Flow
	})
	sort.Slice(s.Flows, func(i, j int) bool {
		if s.Flows[i].Priority != s.Flows[j].Priority {
			return s.Flows[i].Priority > s.Flows[j].Priority
		}
		return s.Flows[i].Flow < s.Flows[j].Flow
	})
	s.Wait = q.waits.snapshot()
	return s
}

// Bytes returns the body bytes held by waiting requests.
func (q *Queue) Bytes() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bytes
}
