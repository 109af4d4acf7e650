package metrics

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	DefaultInterval         = 50 * time.Millisecond
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
	// Interval between scrapes; 0 means Options.Interval.
	Interval time.Duration
	// Overrides maps logical metric names to metric selectors
	// (registry.Scheduling.Metrics).
	Overrides map[string]string
	// APIKey, when set, is sent as Authorization: Bearer with GET
	// /v1/models (vLLM's --api-key guards /v1; /metrics is open).
	APIKey string
}

// Key returns the target's key.
func (t Target) Key() Key { return Key{Pool: t.Pool, Address: t.Address} }

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
	// MaxAge is how old LastSuccess may be for Values to count as fresh.
	MaxAge time.Duration
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

// Options configure a Manager. Zero fields take the Default* values.
type Options struct {
	// Client is shared by every scrape; nil means a keep-alive client owned
	// by the Manager.
	Client *http.Client
	// Interval is the scrape interval for targets that set none.
	Interval time.Duration
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
	Logger   *slog.Logger
	// MaxParallelParses bounds the pages parsed at once (0: GOMAXPROCS-1,
	// at least 1: one processor is always left to the rest).
	// Parsing is CPU-bound: more at once gains nothing, and a thousand
	// runnable scrape goroutines would queue everything else in the
	// process (xDS pushes, configuration reloads, pick requests) behind
	// them. Waiting parses are blocked, not runnable.
	MaxParallelParses int
}

func (o *Options) setDefaults() {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
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

// NewHTTPClient returns the keep-alive client a Manager uses by default:
// plain text (no gzip on a hot loopback/LAN path), a few idle connections
// per endpoint, short dial timeout.
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
type Manager struct {
	opts       Options
	ownsClient bool
	// parsing holds one token per page being parsed.
	parsing chan struct{}
	ctx     context.Context
	cancel  context.CancelFunc

	mu      sync.Mutex // serialises Sync and Stop
	stopped bool
	view    atomic.Pointer[map[Key]*worker] // immutable once stored
	wg      sync.WaitGroup
	running atomic.Int32 // scrape goroutines alive, for tests
}

// NewManager returns a Manager with no targets. It stops scraping when ctx
// ends or Stop is called.
func NewManager(ctx context.Context, opts Options) *Manager {
	opts.setDefaults()
	m := &Manager{opts: opts, parsing: make(chan struct{}, opts.MaxParallelParses)}
	if m.opts.Client == nil {
		m.opts.Client = NewHTTPClient()
		m.ownsClient = true
	}
	m.ctx, m.cancel = context.WithCancel(ctx)
	empty := map[Key]*worker{}
	m.view.Store(&empty)
	return m
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
		p, err := NewParser(t.Engine, t.Overrides)
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

func (m *Manager) normalize(t Target) Target {
	if t.MetricsPath == "" {
		t.MetricsPath = DefaultMetricsPath
	} else if !strings.HasPrefix(t.MetricsPath, "/") {
		t.MetricsPath = "/" + t.MetricsPath
	}
	if t.Interval <= 0 {
		t.Interval = m.opts.Interval
	}
	t.Overrides = maps.Clone(t.Overrides)
	return t
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
	m.mu.Unlock()
	m.wg.Wait()
	if m.ownsClient {
		m.opts.Client.CloseIdleConnections()
	}
}

type worker struct {
	m      *Manager
	t      Target
	url    string
	parser *Parser
	maxAge time.Duration
	h      *Handle
	ctx    context.Context
	cancel context.CancelFunc
	body   bytes.Buffer
	// modelsDue is when /v1/models is read next.
	modelsDue time.Time
}

func (m *Manager) newWorker(t Target, p *Parser, h *Handle) *worker {
	if h == nil {
		h = &Handle{}
	}
	w := &worker{m: m, t: t, parser: p, h: h, url: "http://" + t.Address + t.MetricsPath}
	w.maxAge = max(time.Duration(m.opts.StaleIntervals)*t.Interval, m.opts.MinMaxAge)
	w.ctx, w.cancel = context.WithCancel(m.ctx)
	return w
}

func (w *worker) sameTarget(t Target) bool {
	return w.t.MetricsPath == t.MetricsPath && w.t.Engine == t.Engine &&
		w.t.Interval == t.Interval && maps.Equal(w.t.Overrides, t.Overrides) && w.t.APIKey == t.APIKey
}

func (w *worker) stop() { w.cancel() }

func (w *worker) run() {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-w.ctx.Done():
			return
		case <-timer.C:
		}
		start := time.Now()
		fails := w.once()
		if w.ctx.Err() != nil {
			return
		}
		delay := w.t.Interval
		if fails > 1 {
			// Back off a dead endpoint: interval doubles per failure.
			delay = min(w.t.Interval<<min(fails-1, 16), max(w.m.opts.MaxBackoff, w.t.Interval))
		}
		// Keep the period steady, but never spin if a scrape ran long.
		delay = max(delay-time.Since(start), w.t.Interval/4)
		timer.Reset(delay)
	}
}

// once scrapes and publishes; it returns the consecutive failure count.
func (w *worker) once() int {
	vals, err := w.scrape()
	if err != nil && w.ctx.Err() != nil {
		return 0 // stopping; publish nothing
	}
	now := time.Now()
	prev := w.h.Load()
	s := &Snapshot{Key: w.t.Key(), ScrapedAt: now, MaxAge: w.maxAge, Err: err}
	if prev != nil {
		s.ServedModels = prev.ServedModels
		s.Perf = prev.Perf
	}
	if err == nil {
		s.Values = vals
		var before *Values
		var dt time.Duration
		if prev != nil && !prev.LastSuccess.IsZero() {
			before, dt = &prev.Values, now.Sub(prev.LastSuccess)
		}
		s.Perf = s.Perf.next(before, &s.Values, dt)
		s.LastSuccess = now
		if !now.Before(w.modelsDue) {
			w.modelsDue = now.Add(ModelsInterval)
			if models, merr := w.servedModels(); merr == nil {
				s.ServedModels = models
			} else {
				w.m.opts.Logger.Debug("reading served models failed", "pool", w.t.Pool, "endpoint", w.t.Address, "err", merr)
			}
		}
	} else {
		if prev != nil {
			s.Values = prev.Values
			s.LastSuccess = prev.LastSuccess
			s.ConsecutiveFailures = prev.ConsecutiveFailures
		}
		s.ConsecutiveFailures++
		s.Failing = s.ConsecutiveFailures >= w.m.opts.FailureThreshold
	}
	if w.ctx.Err() != nil {
		return 0 // replaced or stopped meanwhile: the handle is not ours
	}
	if cb := w.m.opts.OnScrape; cb != nil && err == nil {
		cb(s)
	}
	w.h.cur.Store(s)
	wasFailing := prev != nil && prev.Failing
	firstSuccess := err == nil && (prev == nil || prev.LastSuccess.IsZero())
	if wasFailing != s.Failing || firstSuccess {
		log := w.m.opts.Logger
		switch {
		case s.Failing:
			log.Warn("metrics endpoint failing", "pool", w.t.Pool, "endpoint", w.t.Address, "failures", s.ConsecutiveFailures, "err", err)
		case wasFailing:
			log.Info("metrics endpoint recovered", "pool", w.t.Pool, "endpoint", w.t.Address)
		default:
			log.Debug("metrics endpoint answered its first scrape", "pool", w.t.Pool, "endpoint", w.t.Address)
		}
		if cb := w.m.opts.OnTransition; cb != nil {
			cb(Transition{Key: s.Key, Healthy: !s.Failing, Snapshot: s})
		}
	} else if err != nil {
		w.m.opts.Logger.Debug("metrics scrape failed", "pool", w.t.Pool, "endpoint", w.t.Address, "err", err)
	}
	return s.ConsecutiveFailures
}

// servedModels reads the server's OpenAI model list (GET /v1/models): the
// ids of its "data" entries, sorted.
func (w *worker) servedModels() ([]string, error) {
	ctx, cancel := context.WithTimeout(w.ctx, w.m.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+w.t.Address+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	if w.t.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+w.t.APIKey)
	}
	resp, err := w.m.opts.Client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return nil, fmt.Errorf("GET /v1/models: HTTP %d", resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, w.m.opts.MaxBodyBytes)).Decode(&list); err != nil {
		return nil, fmt.Errorf("GET /v1/models: %w", err)
	}
	models := make([]string, 0, len(list.Data))
	for _, d := range list.Data {
		if d.ID != "" {
			models = append(models, d.ID)
		}
	}
	if len(models) == 0 {
		return nil, errors.New("GET /v1/models: no models listed")
	}
	slices.Sort(models)
	return models, nil
}

func (w *worker) scrape() (Values, error) {
	ctx, cancel := context.WithTimeout(w.ctx, w.m.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.url, nil)
	if err != nil {
		return Values{}, fmt.Errorf("scrape %s: %w", w.url, err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")
	resp, err := w.m.opts.Client.Do(req)
	if err != nil {
		return Values{}, fmt.Errorf("scrape %s: %w", w.url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// Drain a little so the connection can be reused.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return Values{}, fmt.Errorf("scrape %s: HTTP %d", w.url, resp.StatusCode)
	}
	limit := w.m.opts.MaxBodyBytes
	w.body.Reset()
	n, err := w.body.ReadFrom(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return Values{}, fmt.Errorf("scrape %s: read body: %w", w.url, err)
	}
	if n > limit {
		return Values{}, fmt.Errorf("scrape %s: body exceeds %d bytes", w.url, limit)
	}
	// The page is read: waiting for a parse slot is not the server's
	// slowness, so it is bounded by the worker's life, not the timeout.
	select {
	case w.m.parsing <- struct{}{}:
	case <-w.ctx.Done():
		return Values{}, w.ctx.Err()
	}
	v, err := w.parser.Parse(w.body.Bytes())
	<-w.m.parsing
	if err != nil {
		return Values{}, fmt.Errorf("scrape %s: %w", w.url, err)
	}
	return v, nil
}
