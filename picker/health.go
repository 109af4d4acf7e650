package picker

import (
	"context"
	"errors"
	"slices"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

// EndpointHealth tracks which endpoints' metrics scrapes are failing and
// decides which of them Envoy should stop routing to. It is the registry's
// health input (a registry.Source): what it decides is sent as
// Update.ScrapeFailing and flows through the registry's debounce like any
// other input, so xDS withholds those endpoints from EDS (override_host
// does not check health) and the discovery guard stops holding them, both
// reading only the published state.
//
// A failing scrape is evidence against the server only when the failure
// says so. The rule (HealthPolicy):
//   - a refused connection (nothing listens: the server is down or
//     restarting) withholds the endpoint as soon as the scraper marks it
//     failing (FailureThreshold scrapes in a row);
//   - any other failure (a timeout above all) withholds it only once it
//     has been failing for SoftFailAfter: a scrape timing out because
//     switchyard itself is short of CPU, or a server busy for a moment,
//     is not a reason to push every Envoy a new endpoint list;
//   - such soft failures are not acted on at all while more than
//     MaxSoftShare of the scraped endpoints fail softly at once: that
//     many servers hanging together is switchyard's own trouble (CPU,
//     network), like Envoy's panic threshold;
//   - an endpoint is withheld only while another endpoint of its pool is
//     known to answer: a pool whose scrapes all fail (a wrong metrics
//     path, say) stays in EDS, and an endpoint not scraped yet is
//     unknown, not healthy, so a pool does not flap while its scrapes
//     fail one by one;
//   - a recovered endpoint is re-added at once: the picker already routes
//     to it again (it reads the scrapes directly), and an endpoint the
//     picker picks but Envoy lacks would be silently replaced by another;
//   - reports go out at most once per ReportInterval (the first change
//     after a quiet interval at once), so a burst of flips becomes one
//     registry publish and one push to each Envoy.
type EndpointHealth struct {
	policy HealthPolicy
	now    func() time.Time

	mu      sync.Mutex
	states  map[metrics.Key]scrapeState // absent: unknown (never answered nor failed)
	pools   map[string][]string         // scraped endpoints per pool
	changed chan struct{}
}

// scrapeState is one endpoint's scrape health as the scraper reported it.
type scrapeState struct {
	failing bool
	// hard marks a failure that proves the server down (connection
	// refused), acted on at once.
	hard bool
	// since is when the endpoint became failing.
	since time.Time
}

// HealthPolicy is the rule EndpointHealth applies (see EndpointHealth).
// Zero fields take the defaults.
type HealthPolicy struct {
	// SoftFailAfter is how long an endpoint must have been failing, with
	// failures other than refused connections, before it is withheld.
	SoftFailAfter time.Duration
	// MaxSoftShare is the share (0..1) of scraped endpoints that may fail
	// softly at once before soft failures are ignored as switchyard's own.
	MaxSoftShare float64
	// ReportInterval is the least time between two reports.
	ReportInterval time.Duration
}

// HealthPolicy defaults.
const (
	DefaultSoftFailAfter  = 5 * time.Second
	DefaultMaxSoftShare   = 0.5
	DefaultReportInterval = time.Second
)

func (p HealthPolicy) withDefaults() HealthPolicy {
	if p.SoftFailAfter <= 0 {
		p.SoftFailAfter = DefaultSoftFailAfter
	}
	if p.MaxSoftShare <= 0 {
		p.MaxSoftShare = DefaultMaxSoftShare
	}
	if p.ReportInterval <= 0 {
		p.ReportInterval = DefaultReportInterval
	}
	return p
}

func newEndpointHealth(p HealthPolicy) *EndpointHealth {
	return &EndpointHealth{policy: p.withDefaults(), now: time.Now, states: map[metrics.Key]scrapeState{},
		pools: map[string][]string{}, changed: make(chan struct{})}
}

// observe records a scraper transition, classifying a failure by its
// error.
func (h *EndpointHealth) observe(tr metrics.Transition) {
	hard := false
	if !tr.Healthy && tr.Snapshot != nil {
		hard = refused(tr.Snapshot.Err)
	}
	h.record(tr.Key, !tr.Healthy, hard)
}

// refused reports whether err says nothing listens at the endpoint.
func refused(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED)
}

// set records a definite state (a restored one, or a test's): failing
// endpoints count as down at once.
func (h *EndpointHealth) set(k metrics.Key, failing bool) { h.record(k, failing, failing) }

// record stores a transition; it wakes watchers only on a change.
func (h *EndpointHealth) record(k metrics.Key, failing, hard bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	was, known := h.states[k]
	if known && was.failing == failing && was.hard == hard {
		return
	}
	st := scrapeState{failing: failing, hard: hard}
	if failing {
		st.since = h.now()
		if known && was.failing {
			st.since = was.since
		}
	}
	h.states[k] = st
	h.notifyLocked()
}

// setTargets replaces the scraped endpoint set, forgetting endpoints that
// left it.
func (h *EndpointHealth) setTargets(targets []metrics.Target) {
	h.mu.Lock()
	defer h.mu.Unlock()
	pools := map[string][]string{}
	live := map[metrics.Key]bool{}
	for _, t := range targets {
		pools[t.Pool] = append(pools[t.Pool], t.Address)
		live[t.Key()] = true
	}
	h.pools = pools
	changed := false
	for k := range h.states {
		if !live[k] {
			delete(h.states, k)
			changed = true
		}
	}
	if changed {
		h.notifyLocked()
	}
}

func (h *EndpointHealth) notifyLocked() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// Unhealthy reports whether endpoint addr of pool should be withheld from
// Envoy now (see EndpointHealth for the rule).
func (h *EndpointHealth) Unhealthy(pool, addr string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	w, _ := h.withheldLocked(h.now())
	return w[metrics.Key{Pool: pool, Address: addr}]
}

// withheldLocked applies the policy at now: the endpoints to withhold,
// and the earliest later time at which the answer may change without a
// new report (zero if none).
func (h *EndpointHealth) withheldLocked(now time.Time) (map[metrics.Key]bool, time.Time) {
	known, soft := 0, 0
	for _, st := range h.states {
		known++
		if st.failing && !st.hard {
			soft++
		}
	}
	ignoreSoft := known > 0 && float64(soft) > h.policy.MaxSoftShare*float64(known)
	var next time.Time
	out := map[metrics.Key]bool{}
	for k, st := range h.states {
		if !st.failing {
			continue
		}
		if !st.hard {
			if ignoreSoft {
				continue
			}
			if due := st.since.Add(h.policy.SoftFailAfter); now.Before(due) {
				if next.IsZero() || due.Before(next) {
					next = due
				}
				continue
			}
		}
		if h.answeringPeerLocked(k) {
			out[k] = true
		}
	}
	return out, next
}

// answeringPeerLocked reports whether another endpoint of k's pool is
// known to answer its scrapes.
func (h *EndpointHealth) answeringPeerLocked(k metrics.Key) bool {
	for _, a := range h.pools[k.Pool] {
		if st, known := h.states[metrics.Key{Pool: k.Pool, Address: a}]; known && !st.failing {
			return true
		}
	}
	return false
}

// Changed returns a channel closed once any Unhealthy answer may have
// changed. Call it before reading Unhealthy so no change is lost.
func (h *EndpointHealth) Changed() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.changed
}

// UnhealthyEndpoints lists every endpoint Unhealthy reports, sorted by
// pool then address.
func (h *EndpointHealth) UnhealthyEndpoints() []metrics.Key {
	h.mu.Lock()
	w, _ := h.withheldLocked(h.now())
	h.mu.Unlock()
	out := make([]metrics.Key, 0, len(w))
	for k := range w {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Pool != out[j].Pool {
			return out[i].Pool < out[j].Pool
		}
		return out[i].Address < out[j].Address
	})
	return out
}

// Run implements registry.Source: it sends the endpoints to withhold at
// once (none, at first) and again whenever they change, at most once per
// ReportInterval, until ctx ends.
func (h *EndpointHealth) Run(ctx context.Context, up chan<- registry.Update) {
	var (
		sent     []metrics.Key
		sentAt   time.Time
		first    = true
		timer    = time.NewTimer(time.Hour)
		deadline time.Time
	)
	defer timer.Stop()
	for {
		changed := h.Changed()
		h.mu.Lock()
		now := h.now()
		w, next := h.withheldLocked(now)
		h.mu.Unlock()
		cur := make([]metrics.Key, 0, len(w))
		for k := range w {
			cur = append(cur, k)
		}
		sortKeys(cur)
		if first || !slices.Equal(cur, sent) {
			if wait := sentAt.Add(h.policy.ReportInterval).Sub(now); !first && wait > 0 {
				// Coalesce: report what holds when the interval ends.
				next = now.Add(wait)
			} else {
				u := registry.Update{ScrapeFailing: map[string][]string{}}
				for _, k := range cur {
					u.ScrapeFailing[k.Pool] = append(u.ScrapeFailing[k.Pool], k.Address)
				}
				select {
				case up <- u:
				case <-ctx.Done():
					return
				}
				sent, sentAt, first = cur, h.now(), false
			}
		}
		var tick <-chan time.Time
		if !next.IsZero() {
			if !next.Equal(deadline) {
				timer.Reset(max(next.Sub(h.now()), 0))
				deadline = next
			}
			tick = timer.C
		}
		select {
		case <-changed:
		case <-tick:
			deadline = time.Time{}
		case <-ctx.Done():
			return
		}
	}
}

func sortKeys(ks []metrics.Key) {
	sort.Slice(ks, func(i, j int) bool {
		if ks[i].Pool != ks[j].Pool {
			return ks[i].Pool < ks[j].Pool
		}
		return ks[i].Address < ks[j].Address
	})
}

var _ registry.Source = (*EndpointHealth)(nil)

// knownStates copies every known endpoint state (true: failing).
func (h *EndpointHealth) knownStates() map[metrics.Key]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[metrics.Key]bool, len(h.states))
	for k, v := range h.states {
		out[k] = v.failing
	}
	return out
}
