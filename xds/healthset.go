package xds

import "sync"

// HealthSet is a ready-made HealthView: whoever knows endpoint health (the
// picker, wired in by cmd/switchyard) calls Set, and the xDS server reacts.
// The zero value is not usable; use NewHealthSet.
type HealthSet struct {
	mu        sync.Mutex
	unhealthy map[string]map[string]bool // pool -> addr -> true
	changed   chan struct{}
}

var _ HealthView = (*HealthSet)(nil)

// NewHealthSet returns a HealthSet in which every endpoint is healthy.
func NewHealthSet() *HealthSet {
	return &HealthSet{unhealthy: map[string]map[string]bool{}, changed: make(chan struct{})}
}

// Set records whether endpoint addr of pool is unhealthy, waking the server
// only if the answer changed.
func (h *HealthSet) Set(pool, addr string, unhealthy bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.unhealthy[pool][addr] == unhealthy {
		return
	}
	if unhealthy {
		if h.unhealthy[pool] == nil {
			h.unhealthy[pool] = map[string]bool{}
		}
		h.unhealthy[pool][addr] = true
	} else {
		delete(h.unhealthy[pool], addr)
		if len(h.unhealthy[pool]) == 0 {
			delete(h.unhealthy, pool)
		}
	}
	close(h.changed)
	h.changed = make(chan struct{})
}

// Unhealthy implements HealthView.
func (h *HealthSet) Unhealthy(pool, addr string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.unhealthy[pool][addr]
}

// Changed implements HealthView.
func (h *HealthSet) Changed() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.changed
}
