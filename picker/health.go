package picker

import (
	"context"
	"sort"
	"sync"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

// EndpointHealth tracks which endpoints' metrics scrapes are failing. It is
// the registry's health input (a registry.Source): every change is sent as
// Update.ScrapeFailing and flows through the registry's debounce like any
// other input, so xDS withholds those endpoints from EDS (override_host
// does not check health) and the discovery guard stops holding them, both
// reading only the published state. An endpoint counts as unhealthy only while at least one
// other endpoint of its pool is known healthy (its last scrape answered):
// when a whole pool's scrapes fail (a broken metrics path, say) its
// endpoints stay in EDS, and an endpoint not scraped yet is unknown, not
// healthy, so a pool whose scrapes all fail does not flap while they fail
// one by one.
type EndpointHealth struct {
	mu      sync.Mutex
	failing map[metrics.Key]bool // true: failing; false: answering; absent: unknown
	pools   map[string][]string  // scraped endpoints per pool
	changed chan struct{}
}

func newEndpointHealth() *EndpointHealth {
	return &EndpointHealth{failing: map[metrics.Key]bool{}, pools: map[string][]string{}, changed: make(chan struct{})}
}

// set records a transition; it wakes watchers only on a change.
func (h *EndpointHealth) set(k metrics.Key, failing bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if was, known := h.failing[k]; known && was == failing {
		return
	}
	h.failing[k] = failing
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
	for k := range h.failing {
		if !live[k] {
			delete(h.failing, k)
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
// Envoy: its scrapes are failing and some endpoint of the pool is not.
func (h *EndpointHealth) Unhealthy(pool, addr string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.unhealthyLocked(pool, addr)
}

func (h *EndpointHealth) unhealthyLocked(pool, addr string) bool {
	if !h.failing[metrics.Key{Pool: pool, Address: addr}] {
		return false
	}
	for _, a := range h.pools[pool] {
		if failing, known := h.failing[metrics.Key{Pool: pool, Address: a}]; known && !failing {
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
	defer h.mu.Unlock()
	var out []metrics.Key
	for k, failing := range h.failing {
		if failing && h.unhealthyLocked(k.Pool, k.Address) {
			out = append(out, k)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Pool != out[j].Pool {
			return out[i].Pool < out[j].Pool
		}
		return out[i].Address < out[j].Address
	})
	return out
}

// Run implements registry.Source: it sends the unhealthy endpoints at once
// (none, at first) and again after every change, until ctx ends.
func (h *EndpointHealth) Run(ctx context.Context, up chan<- registry.Update) {
	for {
		changed := h.Changed()
		u := registry.Update{ScrapeFailing: map[string][]string{}}
		for _, k := range h.UnhealthyEndpoints() {
			u.ScrapeFailing[k.Pool] = append(u.ScrapeFailing[k.Pool], k.Address)
		}
		select {
		case up <- u:
		case <-ctx.Done():
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return
		}
	}
}

var _ registry.Source = (*EndpointHealth)(nil)

// states copies every known endpoint state (true: failing).
func (h *EndpointHealth) states() map[metrics.Key]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[metrics.Key]bool, len(h.failing))
	for k, v := range h.failing {
		out[k] = v
	}
	return out
}
