package load

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Run executes the configured stages and returns the report. It stops by
// itself after the stages plus at most DrainTimeout; cancelling ctx cancels
// every in-flight request and returns the partial report with Interrupted
// set. The error is non-nil only for an invalid configuration.
func Run(ctx context.Context, c Config) (*Report, error) {
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("load config: %w", err)
	}
	cfg := c.withDefaults()
	client := cfg.Client
	if client == nil {
		conns := cfg.MaxInFlight
		if cfg.Arrival == ArrivalConcurrency {
			conns = maxConcurrency(cfg.Stages)
		}
		client = newHTTPClient(max(conns, 16))
		defer client.CloseIdleConnections()
	}
	r := &runner{
		cfg: cfg,
		gen: newGenerator(cfg),
		col: newCollector(cfg.Stages),
		snd: &sender{
			client:    client,
			endpoints: cfg.endpoints(),
			headers:   cfg.Headers.Clone(),
			stream:    !cfg.NoStream,
			timeout:   cfg.Timeout,
			session:   cfg.Workload.SessionHeader,
		},
	}
	reqCtx, cancelReqs := context.WithCancel(ctx)
	defer cancelReqs()
	r.reqCtx = reqCtx

	r.start = time.Now()
	cfg.Logger.Info("load run starting", "url", strings.Join(cfg.endpoints(), ","), "workload", cfg.Workload.Kind,
		"arrival", cfg.Arrival, "stages", len(cfg.Stages), "duration", cfg.TotalDuration())
	if cfg.Arrival == ArrivalConcurrency {
		r.closedLoop(ctx)
	} else {
		r.openLoop(ctx)
	}

	drained := make(chan struct{})
	go func() { r.wg.Wait(); close(drained) }()
	timer := time.NewTimer(cfg.DrainTimeout)
	defer timer.Stop()
	select {
	case <-drained:
	case <-ctx.Done():
		<-drained // reqCtx is a child of ctx: every request is already cancelled
	case <-timer.C:
		cfg.Logger.Warn("drain timeout: cancelling in-flight requests", "in_flight", r.inflight.Load(), "timeout", cfg.DrainTimeout)
		cancelReqs()
		<-drained
	}

	rep := &Report{Config: cfg, Start: r.start, Interrupted: ctx.Err() != nil}
	rep.Config.Client, rep.Config.Logger = nil, nil
	rep.Config.Headers = redact(cfg.Headers)
	rep.Config.Workload = cfg.Workload.relevant()
	rep.Elapsed = time.Since(r.start)
	rep.ElapsedS = rep.Elapsed.Seconds()
	rep.Stages, rep.Total = r.col.report()
	cfg.Logger.Info("load run finished", "sent", rep.Total.Sent, "completed", rep.Total.Completed,
		"failed", rep.Total.Failed, "elapsed", rep.Elapsed.Round(time.Millisecond))
	return rep, nil
}

// redact hides credentials so reports can be shared.
func redact(h http.Header) http.Header {
	out := h.Clone()
	for k := range out {
		switch http.CanonicalHeaderKey(k) {
		case "Authorization", "Proxy-Authorization", "Cookie", "X-Api-Key", "Api-Key":
			out[k] = []string{"REDACTED"}
		}
	}
	return out
}

func maxConcurrency(stages []Stage) int {
	m := 0
	for _, s := range stages {
		m = max(m, s.Concurrency)
	}
	return m
}

type runner struct {
	cfg      Config
	gen      *generator
	col      *collector
	snd      *sender
	reqCtx   context.Context
	start    time.Time
	wg       sync.WaitGroup
	inflight atomic.Int64
}

// issue sends req in the calling goroutine and records the result.
func (r *runner) issue(req *request, stage int) {
	r.col.sent(stage, req.model)
	res := r.snd.do(r.reqCtx, req, stage)
	r.gen.done(req, res.answer)
	r.col.record(res)
	if res.errKind != "" && res.errKind != ErrCancelled {
		r.cfg.Logger.Debug("request failed", "kind", res.errKind, "detail", truncate(res.detail, 200))
	}
}

// sleepUntil waits until t; false if ctx ended first.
func sleepUntil(ctx context.Context, timer *time.Timer, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer.Reset(d)
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// openLoop releases requests on the stage schedule. Arrival times are
// computed from the stage start (not from the previous send), so slow
// responses never delay later arrivals; the only throttle is MaxInFlight,
// and arrivals refused by it are counted as dropped.
func (r *runner) openLoop(ctx context.Context) {
	arrivals := newRand(r.cfg.Seed, streamArrival)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	stageStart := r.start
	for i, st := range r.cfg.Stages {
		stageEnd := stageStart.Add(st.Duration)
		r.col.stageBounds(i, stageStart, time.Time{})
		r.cfg.Logger.Info("stage", "index", i, "rate", st.Rate, "duration", st.Duration)
		if st.Rate > 0 {
			interval := float64(time.Second) / st.Rate
			next := stageStart
			bursts := newBursts(arrivals, stageStart)
			switch r.cfg.Arrival {
			case ArrivalPoisson:
				next = next.Add(time.Duration(arrivals.ExpFloat64() * interval))
			case ArrivalBursty:
				next = bursts.next(next, st.Rate)
			}
			for k := 1; next.Before(stageEnd); k++ {
				if !sleepUntil(ctx, timer, next) {
					r.col.stageBounds(i, time.Time{}, time.Now())
					return
				}
				r.fire(i)
				switch r.cfg.Arrival {
				case ArrivalPoisson:
					next = next.Add(time.Duration(arrivals.ExpFloat64() * interval))
				case ArrivalBursty:
					next = bursts.next(next, st.Rate)
				default:
					next = stageStart.Add(time.Duration(math.Round(float64(k) * interval)))
				}
			}
		}
		if !sleepUntil(ctx, timer, stageEnd) {
			r.col.stageBounds(i, time.Time{}, time.Now())
			return
		}
		r.col.stageBounds(i, time.Time{}, stageEnd)
		stageStart = stageEnd
	}
}

// bursts is the state of ArrivalBursty's two-phase process.
type bursts struct {
	rng      *rand.Rand
	burst    bool
	phaseEnd time.Time
}

// newBursts starts in a quiet spell at start.
func newBursts(rng *rand.Rand, start time.Time) *bursts {
	b := &bursts{rng: rng}
	b.phaseEnd = start.Add(b.phaseLength())
	return b
}

func (b *bursts) phaseLength() time.Duration {
	mean := 3 * BurstMean
	if b.burst {
		mean = BurstMean
	}
	return time.Duration(b.rng.ExpFloat64() * float64(mean))
}

// next returns the arrival after t for a mean rate: an exponential gap at
// the phase's rate, restarted at each phase change (arrivals are
// memoryless).
func (b *bursts) next(t time.Time, rate float64) time.Time {
	for {
		r := rate * BurstQuiet
		if b.burst {
			r = rate * BurstFactor
		}
		at := t.Add(time.Duration(b.rng.ExpFloat64() * float64(time.Second) / r))
		if at.Before(b.phaseEnd) {
			return at
		}
		t = b.phaseEnd
		b.burst = !b.burst
		b.phaseEnd = t.Add(b.phaseLength())
	}
}

func (r *runner) fire(stage int) {
	if r.inflight.Load() >= int64(r.cfg.MaxInFlight) {
		r.col.dropped(stage, false)
		return
	}
	req, ok := r.gen.next()
	if !ok {
		r.col.dropped(stage, true)
		return
	}
	r.inflight.Add(1)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		defer r.inflight.Add(-1)
		r.issue(req, stage)
	}()
}

// closedState is what closed-loop workers follow; a new value is published
// at every stage change and changed is closed to wake idle workers.
type closedState struct {
	stage       int
	concurrency int
	done        bool
	changed     chan struct{}
}

// closedLoop keeps Stage.Concurrency requests in flight: worker w is active
// while w < the current stage's concurrency, and sends its next request as
// soon as the previous one finishes. At a stage change, surplus workers
// stop after their current request.
func (r *runner) closedLoop(ctx context.Context) {
	var cur atomic.Pointer[closedState]
	cur.Store(&closedState{stage: 0, concurrency: r.cfg.Stages[0].Concurrency, changed: make(chan struct{})})
	for w := range maxConcurrency(r.cfg.Stages) {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.worker(ctx, w, &cur)
		}()
	}
	publish := func(next *closedState) {
		old := cur.Swap(next)
		close(old.changed)
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	stageStart := r.start
	for i, st := range r.cfg.Stages {
		if i > 0 {
			publish(&closedState{stage: i, concurrency: st.Concurrency, changed: make(chan struct{})})
		}
		r.cfg.Logger.Info("stage", "index", i, "concurrency", st.Concurrency, "duration", st.Duration)
		stageEnd := stageStart.Add(st.Duration)
		r.col.stageBounds(i, stageStart, time.Time{})
		if !sleepUntil(ctx, timer, stageEnd) {
			r.col.stageBounds(i, time.Time{}, time.Now())
			break
		}
		r.col.stageBounds(i, time.Time{}, stageEnd)
		stageStart = stageEnd
	}
	publish(&closedState{done: true, changed: make(chan struct{})})
}

func (r *runner) worker(ctx context.Context, w int, cur *atomic.Pointer[closedState]) {
	for {
		st := cur.Load()
		if st.done || ctx.Err() != nil {
			return
		}
		if w >= st.concurrency {
			select {
			case <-st.changed:
			case <-ctx.Done():
			}
			continue
		}
		req, ok := r.gen.next()
		if !ok { // multi-turn: every session awaits its answer
			select {
			case <-r.gen.idle:
			case <-st.changed:
			case <-ctx.Done():
			}
			continue
		}
		r.inflight.Add(1)
		r.issue(req, st.stage)
		r.inflight.Add(-1)
	}
}
