package registry

import (
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"time"
)

// guard is the Manager's discovery guard (see Guard): it decides, for each
// merged state, which Critical endpoints are left out and which are held.
// It is owned by the Manager and used under its lock.
type guard struct {
	log  *slog.Logger
	held map[string]*hold // pool -> active hold
	// activations counts holds started, per pool, since the process began.
	activations map[string]uint64
}

// hold is one pool's active hold.
type hold struct {
	since, until time.Time
	addrs        map[string]bool
}

// GuardStatus describes one pool's active hold.
type GuardStatus struct {
	Pool string
	// Held are the addresses kept routable although their source reports
	// them failing, sorted.
	Held []string
	// Since is when the hold started, Until when it ends unless they
	// recover first.
	Since, Until time.Time
}

func newGuard(log *slog.Logger) *guard {
	return &guard{log: log, held: map[string]*hold{}, activations: map[string]uint64{}}
}

// apply edits s in place: every Critical endpoint is removed, unless its
// pool's guard holds it, in which case it stays with Held set. prev is the
// last published state (nil at first): the guard only ever holds endpoints
// that were ready in it. It returns the earliest time a hold ends, zero
// when none is active, so the Manager can apply again then.
func (g *guard) apply(prev, s *State, now time.Time) time.Time {
	var next time.Time
	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		cfg := p.EffectiveGuard()
		h := g.held[name]
		if h != nil && (!now.Before(h.until) || cfg.Grace <= 0) {
			g.log.Warn("discovery guard: grace period over; removing the endpoints still failing their health checks",
				"pool", name, "held", len(h.addrs), "since", h.since.Format(time.RFC3339))
			delete(g.held, name)
			h = nil
		}
		var critical []string
		ready := 0
		for _, e := range p.Endpoints {
			switch {
			case e.Critical:
				critical = append(critical, e.Address)
			case !e.Draining:
				ready++
			}
		}
		if len(critical) > 0 && cfg.Grace > 0 && prev != nil {
			failed, wasReady := newlyFailed(prev.Pools[name], critical)
			switch {
			case h == nil:
				h = g.maybeStart(name, failed, wasReady, ready, cfg, now)
			default:
				// The same event, still unfolding (services re-registered
				// one by one): more endpoints join the hold.
				for _, a := range failed {
					h.addrs[a] = true
				}
			}
		}
		if h != nil {
			h.refresh(p, critical)
			if len(h.addrs) == 0 {
				g.log.Info("discovery guard: the held endpoints recovered or left; hold ended", "pool", name)
				delete(g.held, name)
				h = nil
			}
		}
		kept := p.Endpoints[:0]
		for _, e := range p.Endpoints {
			if e.Critical {
				if h == nil || !h.addrs[e.Address] {
					continue
				}
				e.Critical, e.Held = false, true
			}
			kept = append(kept, e)
		}
		p.Endpoints = kept
		if h != nil && (next.IsZero() || h.until.Before(next)) {
			next = h.until
		}
	}
	for name := range g.held {
		if _, ok := s.Pools[name]; !ok {
			delete(g.held, name) // the pool itself was removed: deliberate
		}
	}
	return next
}

// newlyFailed returns the critical addresses that were ready (published,
// not draining, not held) in before, and how many were ready.
func newlyFailed(before *Pool, critical []string) (failed []string, wasReady int) {
	if before == nil {
		return nil, 0
	}
	// Held endpoints were already failing: they never start a new hold
	// (else a hold would renew itself when its grace ends).
	ready := map[string]bool{}
	for _, e := range before.Endpoints {
		if !e.Draining && !e.Held {
			ready[e.Address] = true
		}
	}
	for _, a := range critical {
		if ready[a] {
			failed = append(failed, a)
		}
	}
	return failed, len(ready)
}

// maybeStart starts a hold when the endpoints that failed at once exceed
// the threshold of those that were ready, or leave the pool with no ready
// endpoint.
func (g *guard) maybeStart(name string, failed []string, wasReady, ready int, cfg Guard, now time.Time) *hold {
	if len(failed) == 0 || wasReady == 0 {
		return nil
	}
	if share := float64(len(failed)) / float64(wasReady); share <= cfg.Threshold && ready > 0 {
		return nil
	}
	h := &hold{since: now, until: now.Add(cfg.Grace), addrs: map[string]bool{}}
	for _, a := range failed {
		h.addrs[a] = true
	}
	g.held[name] = h
	g.activations[name]++
	g.log.Warn("discovery guard: too many endpoints failed their health checks at once; holding them while their metrics scrapes succeed",
		"pool", name, "failed", len(failed), "ready_before", wasReady, "ready_after", ready,
		"threshold", cfg.Threshold, "grace", cfg.Grace, "until", h.until.Format(time.RFC3339))
	return h
}

// refresh drops from the hold the endpoints that passed again (no longer
// critical), left the pool (deregistered) or whose scrapes fail.
func (h *hold) refresh(p *Pool, critical []string) {
	still := map[string]bool{}
	for _, a := range critical {
		still[a] = true
	}
	for _, e := range p.Endpoints {
		if e.ScrapeFailing {
			delete(h.addrs, e.Address)
		}
	}
	for a := range h.addrs {
		if !still[a] {
			delete(h.addrs, a)
		}
	}
}

// status returns the active holds, sorted by pool.
func (g *guard) status() []GuardStatus {
	out := make([]GuardStatus, 0, len(g.held))
	for name, h := range g.held {
		addrs := make([]string, 0, len(h.addrs))
		for a := range h.addrs {
			addrs = append(addrs, a)
		}
		slices.Sort(addrs)
		out = append(out, GuardStatus{Pool: name, Held: addrs, Since: h.since, Until: h.until})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pool < out[j].Pool })
	return out
}

func (s GuardStatus) String() string {
	return fmt.Sprintf("pool %q holds %d endpoints until %s", s.Pool, len(s.Held), s.Until.Format(time.RFC3339))
}
