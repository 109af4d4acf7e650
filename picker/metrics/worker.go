package metrics

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// worker scrapes one endpoint: its goroutine sleeps until the next scrape
// is due (or the picker's traffic wakes it), reads and parses the page,
// and publishes the Snapshot.
type worker struct {
	m      *Manager
	t      Target
	key    Key
	url    string // for errors: http://address/path
	parser *Parser
	h      *Handle
	ctx    context.Context
	cancel context.CancelFunc
	// get is the endpoint's connection (nil when Options.Client is set).
	get *getter
	// query is the name[] filter ("" when not sent), hdr the request's
	// extra header lines.
	query string
	hdr   []byte
	// kick wakes the goroutine early; idle is set while it waits out
	// the idle interval (watch kicks it when traffic comes).
	kick chan struct{}
	idle atomic.Bool
	// pubMu serialises publishing: the goroutine's scrapes and Ingest.
	pubMu sync.Mutex
	// scraping is set while the goroutine reads the endpoint itself (as
	// its owner, or standing in), clear while it relies on another
	// replica's readings (share.go).
	scraping atomic.Bool
	// cover is the latest reading from a replica ranked before this one
	// in the endpoint's order, lastOwn when this process last read the
	// endpoint; both guarded by pubMu.
	cover   cover
	lastOwn time.Time

	// demand is resolved once known (watch reads it too); lastSent is
	// written by the goroutine only, read by watch.
	demand   atomic.Pointer[demandRef]
	lastSent int64

	// The goroutine's own state.
	owner     bool              // it found itself the owner at its last look
	costs     [16]time.Duration // recent exchange durations, a ring
	nCosts    int
	earliest  time.Time // no scrape before (a kick waits for it)
	filter    FilterState
	modelsDue time.Time // when /v1/models is read next
	body      *[]byte   // with Options.Client: the last answer's buffer
}

// acceptHeader asks for the text format.
const acceptHeader = "Accept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\n"

// bufPool holds page buffers: one is in use per page being read, not per
// endpoint.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}

func (m *Manager) newWorker(t Target, p *Parser, h *Handle) *worker {
	if h == nil {
		h = &Handle{}
	}
	w := &worker{m: m, t: t, key: t.Key(), parser: p, h: h, url: "http://" + t.Address + t.MetricsPath,
		kick: make(chan struct{}, 1), hdr: []byte(acceptHeader),
		// An endpoint the others read gets its first reading from them
		// within the grace of a handover (see standBy).
		cover: cover{at: time.Now(), interval: t.Interval, ok: true}}
	if !m.opts.NoNameFilter {
		w.query = "?" + url.Values{"name[]": p.SampleNames()}.Encode()
	}
	if m.opts.Client == nil {
		w.get = newGetter(t.Address, min(2*time.Second, m.opts.Timeout))
	}
	w.ctx, w.cancel = context.WithCancel(m.ctx)
	return w
}

func (w *worker) sameTarget(t Target) bool {
	return w.t.MetricsPath == t.MetricsPath && w.t.Engine == t.Engine &&
		w.t.Interval == t.Interval && w.t.IdleInterval == t.IdleInterval &&
		equalOverrides(w.t.Overrides, t.Overrides) && w.t.APIKey == t.APIKey
}

func equalOverrides(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if bv, ok := b[k]; !ok || bv != v {
			return false
		}
	}
	return true
}

// stop ends the goroutine, aborting a request in progress.
func (w *worker) stop() {
	w.cancel()
	if w.get != nil {
		w.get.close()
	}
}

// wake makes the goroutine look again at once.
func (w *worker) wake() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// demanded reports whether the picker sent the endpoint something since
// its last scrape, or has requests in flight there.
func (w *worker) demanded() bool {
	d := w.demandSource()
	if d == nil {
		return true
	}
	sent, inFlight := d.Demand()
	return sent != atomic.LoadInt64(&w.lastSent) || inFlight > 0
}

// demandRef boxes a Demand for an atomic pointer.
type demandRef struct{ d Demand }

func (w *worker) demandSource() Demand {
	if r := w.demand.Load(); r != nil {
		return r.d
	}
	if w.m.opts.Demand == nil {
		return nil
	}
	d := w.m.opts.Demand(w.key)
	if d != nil {
		w.demand.Store(&demandRef{d})
	}
	return d
}

func (w *worker) run() {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-w.ctx.Done():
			return
		case <-timer.C:
		case <-w.kick:
		}
		w.idle.Store(false)
		if wait := w.standBy(); wait > 0 {
			// Another replica reads it: look again when its readings
			// would be overdue (a reading, or SetReplicas, may wake the
			// goroutine sooner). No connection is kept open meanwhile.
			if w.scraping.Swap(false) && w.get != nil {
				w.get.closeIdle()
			}
			timer.Reset(wait)
			continue
		}
		w.scraping.Store(true)
		if wait := time.Until(w.earliest); wait > 0 {
			timer.Reset(wait)
			continue
		}
		start := time.Now()
		next, idle := w.once()
		if w.ctx.Err() != nil {
			return
		}
		// Keep the period steady, but never spin if a scrape ran long.
		timer.Reset(max(next-time.Since(start), next/4))
		w.idle.Store(idle)
	}
}

// once scrapes and publishes; it returns the time until the next scrape
// and whether that is the idle interval.
func (w *worker) once() (time.Duration, bool) {
	start := time.Now()
	vals, cost, size, err := w.scrape()
	if err != nil && w.ctx.Err() != nil {
		return 0, false // stopping; publish nothing
	}
	var models []string
	if err == nil {
		w.addCost(cost)
		if now := time.Now(); !now.Before(w.modelsDue) {
			w.modelsDue = now.Add(ModelsInterval)
			var merr error
			if models, merr = w.servedModels(); merr != nil {
				w.m.opts.Logger.Debug("reading served models failed", "pool", w.t.Pool, "endpoint", w.t.Address, "err", merr)
			}
		}
	}
	active := true
	if d := w.demandSource(); d != nil {
		sent, inFlight := d.Demand()
		active = sent != w.lastSent || inFlight > 0 || err != nil || vals.Waiting+vals.Running > 0
		atomic.StoreInt64(&w.lastSent, sent)
	}
	base := w.t.Interval
	if !active {
		base = w.t.IdleInterval
	}
	base = max(base, w.budgetFloor())
	s := w.publish(time.Now(), vals, err, base, "", func(s *Snapshot) {
		s.Cost, s.PageBytes, s.Filter = w.cost(), size, w.filter
		if models != nil {
			s.ServedModels = models
		}
	})
	next := base
	if fails := s.ConsecutiveFailures; fails > 1 {
		// Back off a dead endpoint: interval doubles per failure.
		next = min(base<<min(fails-1, 16), max(w.m.opts.MaxBackoff, base))
	}
	w.earliest = start.Add(max(w.t.Interval, w.budgetFloor()))
	if s.ConsecutiveFailures > 0 {
		w.earliest = start.Add(next)
	}
	if cb := w.m.opts.OnReading; cb != nil {
		r := Reading{At: s.ScrapedAt, Interval: base, Cost: s.Cost, PageBytes: s.PageBytes, Filter: s.Filter, Models: models}
		if err != nil {
			r.Err = err.Error()
		} else {
			r.Values = s.Values
		}
		cb(w.key, r)
	}
	return next, !active && s.ConsecutiveFailures == 0
}

// addCost records a successful exchange's duration.
func (w *worker) addCost(d time.Duration) {
	w.costs[w.nCosts%len(w.costs)] = d
	w.nCosts++
}

// cost is the shortest recent exchange: what answering a scrape takes the
// endpoint, without the queueing a busy server adds (0: not measured).
func (w *worker) cost() time.Duration {
	n := min(w.nCosts, len(w.costs))
	if n == 0 {
		return 0
	}
	return slices.Min(w.costs[:n])
}

// budgetFloor is the shortest interval the engine budget allows, at most
// the idle interval: an endpoint in use is never read less often than an
// idle one, even when its answers are slow for other reasons than the
// page's cost (a starved CPU on either side).
func (w *worker) budgetFloor() time.Duration {
	b := w.m.opts.EngineBudget
	if b <= 0 {
		return 0
	}
	c := w.cost()
	if c == 0 {
		// Not read here lately: the cost the owner measured.
		if s := w.h.Load(); s != nil {
			c = s.Cost
		}
	}
	return min(time.Duration(float64(c)*float64(w.m.scrapers.Load())/b), w.t.IdleInterval)
}

// cover is a reading from a replica ranked before this one (or, at a
// handover, what stands for the new owner's first).
type cover struct {
	at       time.Time
	interval time.Duration
	ok       bool // false: the reading was a failure
}

// maxAge is how long a reading planned to be followed after interval
// stays fresh.
func (w *worker) maxAge(interval time.Duration) time.Duration {
	return max(time.Duration(w.m.opts.StaleIntervals)*interval, w.m.opts.MinMaxAge)
}

// standBy returns how long the goroutine may leave the endpoint to the
// replicas ranked before it in the endpoint's order (0: read it now). The
// owner reads it. Another replica waits for readings from before it: one
// at rank r reads the endpoint itself once their latest has been stale
// for r graces (a grace is its interval, at least MinStandInGrace), or,
// when the latest says the endpoint failed, r-1 graces after it (the
// first after the owner checks at once: a replica's failed scrapes are
// its own to make, never taken from another).
func (w *worker) standBy() time.Duration {
	rank := w.m.ring.Load().rank(w.key)
	if rank == 0 {
		w.owner = true
		return 0
	}
	now := time.Now()
	w.pubMu.Lock()
	if w.owner {
		// Just handed over: the new owner reads it next.
		w.owner = false
		if now.After(w.cover.at) {
			w.cover = cover{at: now, interval: w.t.Interval, ok: true}
		}
	}
	c := w.cover
	w.pubMu.Unlock()
	grace := max(c.interval, MinStandInGrace)
	due := c.at.Add(time.Duration(rank-1) * grace)
	if c.ok {
		due = c.at.Add(w.maxAge(c.interval) + time.Duration(rank)*grace)
	}
	return max(due.Sub(now), 0)
}

// ingest takes a reading another replica made (Manager.Ingest).
func (w *worker) ingest(from string, r Reading) {
	before := w.m.ring.Load().before(w.key, from)
	interval := r.Interval
	if interval <= 0 {
		interval = w.t.Interval
	}
	w.pubMu.Lock()
	scraping := w.scraping.Load()
	wake := false
	if before && r.At.After(w.cover.at) {
		w.cover = cover{at: r.At, interval: interval, ok: r.Err == ""}
		// One standing in may stop; one standing by may have to check.
		wake = scraping == (r.Err == "")
	}
	prev := w.h.Load()
	switch {
	case r.Err != "":
		// Never published: only this process's own failures count.
	case scraping && !(before && r.At.After(w.lastOwn)):
		// It reads the endpoint itself, and this is no reading from
		// before it that is newer than its own.
	case prev != nil && !r.At.After(prev.ScrapedAt):
		// Older than what is shown.
	default:
		w.publishLocked(r.At, r.Values, nil, interval, from, func(s *Snapshot) {
			if r.Cost > 0 {
				s.Cost = r.Cost
			}
			if r.PageBytes > 0 {
				s.PageBytes = r.PageBytes
			}
			if r.Filter != FilterUnknown {
				s.Filter = r.Filter
			}
			if r.Models != nil {
				s.ServedModels = r.Models
			}
		})
	}
	w.pubMu.Unlock()
	if wake {
		w.wake()
	}
}

// publish makes the next Snapshot from the previous one and an attempt
// at `at` (vals when err is nil), with interval planned until the next;
// fill adds the scrape's own details. It returns what it published.
func (w *worker) publish(at time.Time, vals Values, err error, interval time.Duration, from string, fill func(*Snapshot)) *Snapshot {
	w.pubMu.Lock()
	defer w.pubMu.Unlock()
	return w.publishLocked(at, vals, err, interval, from, fill)
}

// publishLocked is publish with pubMu held.
func (w *worker) publishLocked(at time.Time, vals Values, err error, interval time.Duration, from string, fill func(*Snapshot)) *Snapshot {
	if from == "" {
		w.lastOwn = at
	}
	opts := &w.m.opts
	prev := w.h.Load()
	s := &Snapshot{Key: w.key, ScrapedAt: at, Err: err, Interval: interval, From: from, MaxAge: w.maxAge(interval)}
	if prev != nil {
		s.ServedModels, s.Perf, s.Cost, s.PageBytes, s.Filter = prev.ServedModels, prev.Perf, prev.Cost, prev.PageBytes, prev.Filter
	}
	if fill != nil {
		fill(s)
	}
	if err == nil {
		s.Values = vals
		var before *Values
		var dt time.Duration
		if prev != nil && !prev.LastSuccess.IsZero() {
			before, dt = &prev.Values, at.Sub(prev.LastSuccess)
		}
		s.Perf = s.Perf.next(before, &s.Values, dt)
		s.LastSuccess = at
	} else {
		if prev != nil {
			s.Values = prev.Values
			s.LastSuccess = prev.LastSuccess
			s.From = prev.From // whose scrape the Values are
			s.ConsecutiveFailures = prev.ConsecutiveFailures
			// Freshness still counts from the last success's plan.
			s.MaxAge = max(s.MaxAge, prev.MaxAge)
		}
		s.ConsecutiveFailures++
		s.Failing = s.ConsecutiveFailures >= opts.FailureThreshold
	}
	if w.ctx.Err() != nil {
		return s // replaced or stopped meanwhile: the handle is not ours
	}
	if cb := opts.OnScrape; cb != nil && err == nil {
		cb(s)
	}
	w.h.cur.Store(s)
	wasFailing := prev != nil && prev.Failing
	firstSuccess := err == nil && (prev == nil || prev.LastSuccess.IsZero())
	if wasFailing != s.Failing || firstSuccess {
		log := opts.Logger
		switch {
		case s.Failing:
			log.Warn("metrics endpoint failing", "pool", w.t.Pool, "endpoint", w.t.Address, "failures", s.ConsecutiveFailures, "err", err)
		case wasFailing:
			log.Info("metrics endpoint recovered", "pool", w.t.Pool, "endpoint", w.t.Address)
		default:
			log.Debug("metrics endpoint answered its first scrape", "pool", w.t.Pool, "endpoint", w.t.Address)
		}
		if cb := opts.OnTransition; cb != nil {
			cb(Transition{Key: s.Key, Healthy: !s.Failing, Snapshot: s})
		}
	} else if err != nil {
		opts.Logger.Debug("metrics scrape failed", "pool", w.t.Pool, "endpoint", w.t.Address, "err", err)
	}
	return s
}

// scrape reads and parses the page; cost is the exchange's duration and
// size the page's.
func (w *worker) scrape() (vals Values, cost time.Duration, size int, err error) {
	defer w.release()
	start := time.Now()
	status, body, err := w.fetch(w.t.MetricsPath+w.query, w.hdr)
	cost = time.Since(start)
	if err == nil && status >= 400 && status < 500 && status != http.StatusNotFound && w.query != "" {
		// The server may refuse the filter's query string: try without.
		start = time.Now()
		status, body, err = w.fetch(w.t.MetricsPath, w.hdr)
		cost = time.Since(start)
		if err == nil && status == http.StatusOK {
			w.query, w.filter = "", FilterRejected
			w.m.opts.Logger.Info("metrics endpoint refuses the name[] filter; no longer sent", "pool", w.t.Pool, "endpoint", w.t.Address)
		}
	}
	if err != nil {
		return Values{}, 0, 0, fmt.Errorf("scrape %s: %w", w.url, err)
	}
	if status != http.StatusOK {
		return Values{}, 0, 0, fmt.Errorf("scrape %s: HTTP %d", w.url, status)
	}
	// The page is read: waiting for a parse slot is not the server's
	// slowness, so it is bounded by the worker's life, not the timeout,
	// and it is not part of the exchange's cost.
	select {
	case w.m.parsing <- struct{}{}:
	case <-w.ctx.Done():
		return Values{}, 0, 0, w.ctx.Err()
	}
	v, err := w.parser.Parse(body)
	skipped := w.parser.Skipped()
	<-w.m.parsing
	if err != nil {
		return Values{}, 0, 0, fmt.Errorf("scrape %s: %w", w.url, err)
	}
	if w.query != "" {
		w.filter = FilterHonoured
		if skipped > 0 {
			w.filter = FilterIgnored
		}
	}
	return v, cost, len(body), nil
}

// fetch GETs target (path and query) with the header lines hdr: the
// status and the body, valid until release.
func (w *worker) fetch(target string, hdr []byte) (int, []byte, error) {
	limit := w.m.opts.MaxBodyBytes
	deadline := time.Now().Add(w.m.opts.Timeout)
	if w.get != nil {
		resp, err := w.get.get(target, hdr, deadline, limit)
		switch {
		case errors.Is(err, errTooLarge):
			return 0, nil, fmt.Errorf("body exceeds %d bytes", limit)
		case errors.Is(err, os.ErrDeadlineExceeded):
			return 0, nil, fmt.Errorf("no answer within %v (deadline exceeded)", w.m.opts.Timeout)
		case err != nil:
			return 0, nil, err
		}
		return resp.status, resp.body, nil
	}
	ctx, cancel := context.WithDeadline(w.ctx, deadline)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+w.t.Address+target, nil)
	if err != nil {
		return 0, nil, err
	}
	for _, line := range bytes.Split(bytes.TrimSuffix(hdr, []byte("\r\n")), []byte("\r\n")) {
		if k, v, ok := bytes.Cut(line, []byte(":")); ok {
			req.Header.Set(string(k), string(bytes.TrimSpace(v)))
		}
	}
	resp, err := w.m.opts.Client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// Drain a little so the connection can be reused.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return resp.StatusCode, nil, nil
	}
	if w.body == nil {
		w.body = bufPool.Get().(*[]byte)
	}
	b := bytes.NewBuffer((*w.body)[:0])
	n, err := b.ReadFrom(io.LimitReader(resp.Body, limit+1))
	*w.body = b.Bytes()[:0]
	if err != nil {
		return 0, nil, fmt.Errorf("read body: %w", err)
	}
	if n > limit {
		return 0, nil, fmt.Errorf("body exceeds %d bytes", limit)
	}
	return resp.StatusCode, b.Bytes(), nil
}

// release gives back the buffer of the last answer fetched.
func (w *worker) release() {
	if w.get != nil {
		w.get.release()
	}
	if w.body != nil {
		bufPool.Put(w.body)
		w.body = nil
	}
}

// servedModels reads the server's OpenAI model list (GET /v1/models): the
// ids of its "data" entries, sorted.
func (w *worker) servedModels() ([]string, error) {
	hdr := []byte("Accept: application/json\r\n")
	if w.t.APIKey != "" {
		hdr = append(hdr, "Authorization: Bearer "+w.t.APIKey+"\r\n"...)
	}
	defer w.release()
	status, body, err := w.fetch("/v1/models", hdr)
	if err != nil {
		return nil, fmt.Errorf("GET /v1/models: %w", err)
	}
	if status != http.StatusOK {
		return nil, fmt.Errorf("GET /v1/models: HTTP %d", status)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
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
