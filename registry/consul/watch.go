package consul

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/registry"
)

// watcher follows one selector with blocking queries. Its fields after
// cancel are guarded by Source.mu.
type watcher struct {
	sel    registry.ConsulSelector
	cancel context.CancelFunc

	pools        []string // pools using the selector, sorted
	replicas     bool     // the selector is the replicas' service
	initialIndex uint64   // Options.InitialIndexes entry, 0 if none
	seed         map[string][]registry.Endpoint
	// seedReplicas are the restored state's Consul replicas, which stand
	// in for the replicas' service until Consul answers (nil: none).
	seedReplicas []registry.Replica
	answered     bool // Consul has answered at least once
	attempts     int  // queries finished (either way)
	entries      []*api.ServiceEntry
	index        uint64
	up           bool
	lastSuccess  time.Time
	lastErr      error
	// outage is set by a failed query and cleared by the next answer.
	outage bool
	// ghosts are instances Consul stopped listing in its first answer
	// after an outage or an index reset (an agent or cluster restarted
	// and is still re-registering its services): until ghostsUntil they
	// are reported failing (Critical), not deregistered, so the
	// registry's discovery guard can hold them. Keyed by instanceID.
	ghosts      map[string]*api.ServiceEntry
	ghostsUntil time.Time
}

// current returns the entries to convert at now: Consul's latest answer
// plus the ghosts still within their window, marked critical.
func (w *watcher) current(now time.Time) []*api.ServiceEntry {
	if len(w.ghosts) == 0 || !now.Before(w.ghostsUntil) {
		return w.entries
	}
	out := append([]*api.ServiceEntry(nil), w.entries...)
	for _, g := range w.ghosts {
		out = append(out, g)
	}
	return out
}

// settle updates the ghosts for a new answer; rebuilt says the answer
// follows an outage or an index reset. It reports when the ghosts expire
// (zero if none are kept).
func (w *watcher) settle(entries []*api.ServiceEntry, rebuilt bool, now time.Time, window time.Duration) time.Time {
	listed := map[string]bool{}
	for _, e := range entries {
		if e != nil && e.Service != nil {
			listed[instanceID(e)] = true
		}
	}
	if rebuilt && window > 0 {
		ghosts := map[string]*api.ServiceEntry{}
		for _, e := range w.current(now) {
			if e == nil || e.Service == nil || listed[instanceID(e)] {
				continue
			}
			g := *e
			g.Checks = api.HealthChecks{{Node: nodeName(e), CheckID: "switchyard:not-re-registered", ServiceID: e.Service.ID,
				Status: api.HealthCritical, Output: "not listed since Consul came back; re-registration pending"}}
			ghosts[instanceID(e)] = &g
		}
		if len(ghosts) > 0 {
			w.ghosts, w.ghostsUntil = ghosts, now.Add(window)
			return w.ghostsUntil
		}
	}
	for id := range w.ghosts {
		if listed[id] {
			delete(w.ghosts, id)
		}
	}
	if len(w.ghosts) == 0 || !now.Before(w.ghostsUntil) {
		w.ghosts = nil
		return time.Time{}
	}
	return w.ghostsUntil
}

func nodeName(e *api.ServiceEntry) string {
	if e.Node == nil {
		return ""
	}
	return e.Node.Node
}

// watch runs w's query loop until ctx ends.
func (s *Source) watch(ctx context.Context, w *watcher) {
	var index uint64 // 0: the next query is a full, non-blocking read
	backoff := time.Duration(0)
	for {
		start := time.Now()
		entries, next, err := s.fetch(ctx, w.sel, index)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			s.mu.Lock()
			wasUp := w.up || w.attempts == 0
			w.attempts++
			w.up, w.lastErr = false, err
			w.outage = w.answered
			s.mu.Unlock()
			if wasUp {
				s.log.Warn("consul query failed; keeping the last members and retrying", "service", w.sel.Service, "tag", w.sel.Tag, "err", err)
			}
			s.notify()
			// Consul may come back restarted with a lower index; a query
			// blocking on the old one would hang, so start over.
			index = 0
			backoff = nextBackoff(backoff, s.opts.MinBackoff, s.opts.MaxBackoff)
			if !sleep(ctx, jitter(backoff)) {
				return
			}
			continue
		}
		if backoff > 0 {
			s.log.Info("consul reachable again", "service", w.sel.Service, "tag", w.sel.Tag)
		}
		backoff = 0
		// Blocking-query rules: an index that goes backwards (Consul
		// restarted or its state was rebuilt) means start over with a full
		// read; the answer itself is current and is used.
		reset := next < index
		if reset {
			s.log.Info("consul index went backwards; resetting", "service", w.sel.Service, "tag", w.sel.Tag, "from", index, "to", next)
			next = 0
		}
		index = next
		s.mu.Lock()
		rebuilt := w.answered && (w.outage || reset || next < w.index)
		w.outage = false
		if until := w.settle(entries, rebuilt, time.Now(), s.opts.RebuildSettle); !until.IsZero() {
			if rebuilt {
				s.log.Warn("consul came back without some instances it listed before; treating them as re-registering, not deregistered",
					"service", w.sel.Service, "tag", w.sel.Tag, "missing", len(w.ghosts), "until", until.Format(time.RFC3339))
			}
			// Rebuild the contribution when the ghosts expire.
			time.AfterFunc(time.Until(until)+time.Millisecond, s.notify)
		}
		if !w.answered && w.initialIndex > 0 {
			s.log.Info("consul first answer", "service", w.sel.Service, "tag", w.sel.Tag,
				"index", next, "previous_run_index", w.initialIndex, "changed", next != w.initialIndex)
		}
		w.attempts++
		w.answered, w.up, w.lastErr = true, true, nil
		w.entries, w.index, w.lastSuccess = entries, index, time.Now()
		s.mu.Unlock()
		s.notify()
		// An answer that came back at once (index 0, or unchanged) must not
		// turn into a busy loop.
		if !sleep(ctx, s.opts.MinInterval-time.Since(start)) {
			return
		}
	}
}

// notify wakes Run without blocking; one pending wake-up is enough since
// Run always rebuilds the whole contribution.
func (s *Source) notify() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// nextBackoff doubles d within [lo, hi].
func nextBackoff(d, lo, hi time.Duration) time.Duration {
	if d < lo {
		return lo
	}
	return min(2*d, hi)
}

// jitter spreads d over [0.8d, 1.2d) so many switchyards do not retry in
// step.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// sleep waits d (nothing when d <= 0) and reports false if ctx ended
// first.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
