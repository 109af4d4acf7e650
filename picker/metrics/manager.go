package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/registry"
)

// Defaults used when Options or Target leave a field zero.
const (
	DefaultInterval   = 50 * time.Millisecond
	DefaultIdleFactor = 20
	// DefaultEngineBudget is 4.5 % of the engine's answer time: real vLLM's
	// API server spends about 6 % more CPU on a scrape than the answer
	// takes, so its CPU stays under 5 % of a core (issue 25).
	DefaultEngineBudget     = 0.045
	DefaultTimeout          = time.Second
	DefaultMaxBodyBytes     = 4 << 20
	DefaultStaleIntervals   = 3
	DefaultMinMaxAge        = 250 * time.Millisecond
	DefaultFailureThreshold = 3
	DefaultMaxBackoff       = time.Second
	DefaultMetricsPath      = "/metrics"
)

// Key names one scraped endpoint.
type Key struct {
	Pool    string
	Address string // "ip:port"
}

// name renders k for errors and logs. (Key has no String method on
// purpose: Snapshot embeds Key, and %v of a Snapshot should show all of it.)
func (k Key) name() string { return k.Pool + "/" + k.Address }

// Target is one endpoint to scrape.
type Target struct {
	Pool        string
	Address     string // "ip:port" or "[v6]:port"
	MetricsPath string // "" means /metrics
	Engine      registry.Engine
	// Interval between scrapes while the endpoint is in use; 0 means
	// Options.Interval.
	Interval time.Duration
	// IdleInterval between scrapes while it is idle; 0 means
	// Options.IdleInterval.
	IdleInterval time.Duration
	// Overrides maps logical metric names to metric selectors
	// (registry.Scheduling.Metrics).
	Overrides map[string]string
	// APIKey, when set, is sent as Authorization: Bearer with GET
	// /v1/models (vLLM's --api-key guards /v1; /metrics is open).
	APIKey string
}

// Key returns the target's key.
func (t Target) Key() Key { return Key{Pool: t.Pool, Address: t.Address} }

// Reading is what one scrape of an endpoint found: the values the picker
// uses and when the page was read. It is a plain value, so that it can
// as well come from another replica that scraped the endpoint (see
// Manager.Ingest and Options.OnReading).
type Reading struct {
	// At is when the page was read.
	At time.Time
	// Values are the page's figures; zero when Err is set.
	Values Values
	// Err, when not empty, says why the scrape failed.
	Err string
	// Interval is the interval the scraper planned until its next
	// scrape; a reading older than StaleIntervals of it is stale.
	Interval time.Duration
	// Cost, PageBytes and Filter describe the scrape as Snapshot's
	// fields of the same names do (zero: unknown).
	Cost      time.Duration
	PageBytes int
	Filter    FilterState
	// Models are the server's served models when this scrape read them
	// (every ModelsInterval; nil: not read this time).
	Models []string
}

// FilterState says whether an endpoint honours the name[] filter.
type FilterState uint8

// FilterState values.
const (
	// FilterUnknown: not sent, or no page read since.
	FilterUnknown FilterState = iota
	// FilterHonoured: the page had only the families asked for.
	FilterHonoured
	// FilterIgnored: the page had others too (vLLM 0.32 ignores it).
	FilterIgnored
	// FilterRejected: the server refused the query string (an HTTP 4xx
	// that a page without it did not get); it is no longer sent.
	FilterRejected
)

func (f FilterState) String() string {
	switch f {
	case FilterHonoured:
		return "honoured"
	case FilterIgnored:
		return "ignored"
	case FilterRejected:
		return "rejected"
	}
	return "unknown"
}

// Snapshot is the latest known state of one endpoint. It is immutable once
// published: readers may keep and share it without locking.
type Snapshot struct {
	Key
	// Values come from the latest successful scrape (zero before the first).
	Values
	// ScrapedAt is when the latest attempt finished; LastSuccess when the
	// latest successful one did (zero if none yet).
	ScrapedAt   time.Time
	LastSuccess time.Time
	// Err is the latest attempt's error, nil if it succeeded.
	Err error
	// ConsecutiveFailures counts failed attempts since the last success.
	ConsecutiveFailures int
	// Failing is set once ConsecutiveFailures reaches the failure threshold
	// and cleared by the next success.
	Failing bool
	// MaxAge is how old LastSuccess may be for Values to count as fresh:
	// StaleIntervals times Interval, at least MinMaxAge.
	MaxAge time.Duration
	// Interval is the time planned until the next scrape: the target's
	// interval while the endpoint is in use, its idle interval while not,
	// stretched to keep within the engine budget, backed off while
	// failing.
	Interval time.Duration
	// Cost is the endpoint's time to answer a scrape (the shortest of the
	// recent exchanges, the network's round trip included): what the
	// engine budget is reckoned from. Zero until measured.
	Cost time.Duration
	// PageBytes is the size of the latest page read.
	PageBytes int
	// Filter says whether the endpoint honours the name[] filter.
	Filter FilterState
	// From is the replica whose scrape gave the Values ("" for this
	// process's own): another replica's when it reads the endpoint for
	// this one (Manager.SetReplicas).
	From string
	// ServedModels are the model names the server's GET /v1/models lists
	// (its served model names and LoRA adapters), refreshed every
	// ModelsInterval; nil while unknown (never answered, or no such API).
	// It is shared between snapshots: read only.
	ServedModels []string
	// Perf is the endpoint's speed as its successive pages tell it
	// (latency histogram means, the slot limit it showed); kept across
	// failed scrapes.
	Perf Perf
}

// ModelsInterval is how often each server's /v1/models is read (after a
// successful metrics scrape); an adapter loaded at run time is seen
// within it.
const ModelsInterval = 5 * time.Second

// Fresh reports whether the Values come from a successful scrape no older
// than MaxAge at now. Scorers should treat an endpoint that is not fresh as
// having unknown load.
func (s *Snapshot) Fresh(now time.Time) bool {
	return s != nil && !s.LastSuccess.IsZero() && now.Sub(s.LastSuccess) <= s.MaxAge
}

// Age returns how old the latest successful scrape is at now, or -1 if
// there has been none.
func (s *Snapshot) Age(now time.Time) time.Duration {
	if s == nil || s.LastSuccess.IsZero() {
		return -1
	}
	return now.Sub(s.LastSuccess)
}

// Transition reports that an endpoint answered its first scrape (Healthy
// true), became failing (Healthy false) or recovered (Healthy true). Until
// the first of these an endpoint's health is unknown; after it only
// changes are reported.
type Transition struct {
	Key
	Healthy  bool
	Snapshot *Snapshot
}

// Demand is what the picker's own accounting knows of the traffic it
// sends an endpoint: sent counts the requests sent there (it only grows),
// inFlight those not finished (sent by this process or, when replicas
// share their picks, another). picker/sched.Load implements it.
type Demand interface {
	Demand() (sent, inFlight int64)
}

// Options configure a Manager. Zero fields take the Default* values.
type Options struct {
	// Client, when set, makes every request (tests serve pages from
	// memory through it); nil means the Manager's own HTTP/1.1 getter,
	// one kept-alive connection per endpoint.
	Client *http.Client
	// Interval is the scrape interval for targets that set none: how
	// often an endpoint in use is read.
	Interval time.Duration
	// IdleInterval is how often an idle endpoint is read: one the picker
	// sent nothing since its last scrape, with nothing in flight, whose
	// page showed nothing running or waiting. 0 means DefaultIdleFactor
	// times the target's interval; negative, never slower than Interval.
	// An endpoint that gets traffic is read again within WatchInterval.
	// Without Demand, every endpoint counts as in use.
	IdleInterval time.Duration
	// EngineBudget bounds the share of an engine's time spent answering
	// scrapes, summed over the replicas that scrape it (see
	// Manager.SetScrapers): an endpoint whose answers take Cost is read
	// at most every Cost*scrapers/EngineBudget. 0 means
	// DefaultEngineBudget; negative, no bound.
	EngineBudget float64
	// NoNameFilter stops sending Prometheus' name[] filter, which asks a
	// server that honours it (prometheus_client pages: SGLang, and
	// others) for only the families read.
	NoNameFilter bool
	// Demand, if set, resolves an endpoint's Demand; it may return nil
	// while unknown (asked again later).
	Demand func(Key) Demand
	// Timeout bounds each scrape request.
	Timeout time.Duration
	// MaxBodyBytes caps a metrics page; larger pages fail the scrape.
	MaxBodyBytes int64
	// StaleIntervals and MinMaxAge set Snapshot.MaxAge to
	// max(StaleIntervals*interval, MinMaxAge).
	StaleIntervals int
	MinMaxAge      time.Duration
	// FailureThreshold is how many consecutive failures mark an endpoint
	// failing.
	FailureThreshold int
	// MaxBackoff caps the scrape interval of a failing endpoint, which
	// doubles with each consecutive failure.
	MaxBackoff time.Duration
	// OnTransition, if set, is called from the endpoint's scrape goroutine
	// on its first successful scrape and on every healthy<->failing change.
	// It must not block for long.
	OnTransition func(Transition)
	// OnScrape, if set, is called from the endpoint's scrape goroutine
	// with every successful scrape just before it is published (so a
	// reader of the snapshot finds what the callback recorded). It must
	// not block.
	OnScrape func(*Snapshot)
	// OnReading, if set, is called with every scrape this process made
	// (successful or not), after it is published: what it passes on to
	// the replicas it reads endpoints with (SetReplicas). It must not
	// block.
	OnReading func(Key, Reading)
	Logger    *slog.Logger
	// MaxParallelParses bounds the pages parsed at once (0: GOMAXPROCS-1,
	// at least 1: one processor is always left to the rest).
	// Parsing is CPU-bound: more at once gains nothing, and a thousand
	// runnable scrape goroutines would queue everything else in the
	// process (xDS pushes, configuration reloads, pick requests) behind
	// them. Waiting parses are blocked, not runnable.
	MaxParallelParses int
}

// WatchInterval is how often the endpoints scraped at their idle interval
// are checked for traffic the picker sent them.
const WatchInterval = 20 * time.Millisecond

func (o *Options) setDefaults() {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.EngineBudget == 0 {
		o.EngineBudget = DefaultEngineBudget
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if o.StaleIntervals <= 0 {
		o.StaleIntervals = DefaultStaleIntervals
	}
	if o.MinMaxAge <= 0 {
		o.MinMaxAge = DefaultMinMaxAge
	}
	if o.FailureThreshold <= 0 {
		o.FailureThreshold = DefaultFailureThreshold
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.MaxParallelParses <= 0 {
		o.MaxParallelParses = max(1, runtime.GOMAXPROCS(0)-1)
	}
}

// NewHTTPClient returns a keep-alive net/http client suited to scraping:
// plain text (no gzip on a hot loopback/LAN path), a few idle connections
// per endpoint, short dial timeout. A Manager does not need one (it has
// its own getter); it is for callers that set Options.Client.
func NewHTTPClient() *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 2,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

// Manager scrapes a changing set of endpoints, one goroutine each, and
// publishes each endpoint's latest Snapshot for lock-free reads.
//
// How often: an endpoint in use is read every Interval, an idle one every
// IdleInterval (and at once when the picker sends it something), never
// more often than the engine budget allows, less often while it fails.
// Which: every endpoint, unless SetReplicas names replicas it shares the
// reading with; then those it owns (its readings of the others come in
// through Ingest), and those whose readings stop coming (share.go).
type Manager struct {
	opts Options
	// parsing holds one token per page being parsed.
	parsing chan struct{}
	ctx     context.Context
	cancel  context.CancelFunc

	mu      sync.Mutex // serialises Sync and Stop
	stopped bool
	view    atomic.Pointer[map[Key]*worker] // immutable once stored
	wg      sync.WaitGroup
	running atomic.Int32 // scrape goroutines alive, for tests
	// scrapers is how many processes scrape each endpoint (the engine
	// budget is shared among them).
	scrapers atomic.Int32
	// ring is who reads endpoints together (nil: this process alone).
	ring atomic.Pointer[ring]
	// schemas are the parsers' shared parts by engine and overrides
	// (guarded by mu): endpoints alike share one.
	schemas map[string]*schema
}

// NewManager returns a Manager with no targets. It stops scraping when ctx
// ends or Stop is called.
func NewManager(ctx context.Context, opts Options) *Manager {
	opts.setDefaults()
	m := &Manager{opts: opts, parsing: make(chan struct{}, opts.MaxParallelParses)}
	m.scrapers.Store(1)
	m.ctx, m.cancel = context.WithCancel(ctx)
	empty := map[Key]*worker{}
	m.view.Store(&empty)
	if opts.Demand != nil {
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			m.watch()
		}()
	}
	return m
}

// SetScrapers says how many processes scrape each endpoint (n < 1 counts
// as 1): every replica while each scrapes every endpoint. The engine
// budget is shared among them.
func (m *Manager) SetScrapers(n int) {
	m.scrapers.Store(int32(max(n, 1)))
}

// Ingest takes a reading of k made elsewhere, by the replica named from.
// It is published as if this process had scraped it, unless this process
// reads k itself (as its owner, or standing in, until a reading from a
// replica ranked before it comes) or already shows a later one. A failed
// reading is never published: when it comes from a replica ranked before
// this one, this process reads k itself to see (share.go). It fails for
// an endpoint not in the scraped set.
func (m *Manager) Ingest(k Key, from string, r Reading) error {
	w := (*m.view.Load())[k]
	if w == nil {
		return fmt.Errorf("endpoint %s is not scraped here", k.name())
	}
	w.ingest(from, r)
	return nil
}

// Sync makes the scraped set equal to targets: new endpoints start, missing
// ones stop, and changed ones restart with their new settings (keeping
// their last Snapshot). A target with an unknown engine or bad overrides is
// reported in the joined error; an already running scrape for its key
// keeps its previous settings.
func (m *Manager) Sync(targets []Target) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stopped {
		return errors.New("metrics manager stopped")
	}
	old := *m.view.Load()
	next := make(map[Key]*worker, len(targets))
	var errs []error
	for _, t := range targets {
		t = m.normalize(t)
		k := t.Key()
		if w, ok := old[k]; ok && w.sameTarget(t) {
			next[k] = w
			continue
		}
		p, err := m.parser(t.Engine, t.Overrides)
		if err != nil {
			errs = append(errs, fmt.Errorf("endpoint %s: %w", k.name(), err))
			if w, ok := old[k]; ok {
				next[k] = w
			}
			continue
		}
		if prev, ok := next[k]; ok && prev != old[k] {
			// Duplicate key in targets: the last one wins.
			prev.stop()
		}
		var h *Handle
		if prevW, ok := old[k]; ok {
			h = prevW.h // keep the key's handle across a restart
		}
		next[k] = m.newWorker(t, p, h)
	}
	// Publish the new view before stopping old workers so readers never
	// see a key vanish and come back.
	m.view.Store(&next)
	for k, w := range old {
		if next[k] != w {
			w.stop()
		}
	}
	for k, w := range next {
		if old[k] != w {
			m.wg.Add(1)
			m.running.Add(1)
			go func() {
				defer m.wg.Done()
				defer m.running.Add(-1)
				w.run()
			}()
		}
	}
	return errors.Join(errs...)
}

// parser returns a Parser for engine and overrides, sharing the schema
// of every parser alike. m.mu must be held.
func (m *Manager) parser(engine registry.Engine, overrides map[string]string) (*Parser, error) {
	keys := slices.Sorted(maps.Keys(overrides))
	var b strings.Builder
	b.WriteString(string(engine))
	for _, k := range keys {
		b.WriteString("\x00" + k + "=" + overrides[k])
	}
	key := b.String()
	s := m.schemas[key]
	if s == nil {
		var err error
		if s, err = newSchema(engine, overrides); err != nil {
			return nil, err
		}
		if m.schemas == nil {
			m.schemas = map[string]*schema{}
		}
		m.schemas[key] = s
	}
	return s.parser(), nil
}

func (m *Manager) normalize(t Target) Target {
	if t.MetricsPath == "" {
		t.MetricsPath = DefaultMetricsPath
	} else if !strings.HasPrefix(t.MetricsPath, "/") {
		t.MetricsPath = "/" + t.MetricsPath
	}
	if t.Interval <= 0 {
		t.Interval = m.opts.Interval
	}
	if t.IdleInterval == 0 {
		t.IdleInterval = m.opts.IdleInterval
	}
	switch {
	case t.IdleInterval == 0:
		t.IdleInterval = DefaultIdleFactor * t.Interval
	case t.IdleInterval < t.Interval:
		t.IdleInterval = t.Interval
	}
	t.Overrides = maps.Clone(t.Overrides)
	return t
}

// watch wakes the endpoints waiting out their idle interval once the
// picker sends them something.
func (m *Manager) watch() {
	t := time.NewTicker(WatchInterval)
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
		for _, w := range *m.view.Load() {
			if w.idle.Load() && w.demanded() {
				w.wake()
			}
		}
	}
}

// Handle is a stable reference to one endpoint's latest Snapshot, for hot
// paths that resolve endpoints once (when their pool view is rebuilt) and
// then read on every request with a single atomic load. It stays valid
// while the endpoint is scraped, across target setting changes; once the
// endpoint is removed it stops updating, so its Snapshot turns stale.
type Handle struct {
	cur atomic.Pointer[Snapshot]
}

// Load returns the latest Snapshot, or nil before the first attempt.
func (h *Handle) Load() *Snapshot { return h.cur.Load() }

// Handle returns k's handle, or nil if k is not scraped.
func (m *Manager) Handle(k Key) *Handle {
	if w := (*m.view.Load())[k]; w != nil {
		return w.h
	}
	return nil
}

// Stop ends every scrape and waits for the goroutines to exit.
func (m *Manager) Stop() {
	m.mu.Lock()
	m.stopped = true
	m.cancel()
	for _, w := range *m.view.Load() {
		w.stop()
	}
	m.mu.Unlock()
	m.wg.Wait()
}
