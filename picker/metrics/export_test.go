package metrics

import (
	"maps"
	"slices"
	"strings"
)

// Test hooks: methods only the package's own tests call.

// Get returns the latest Snapshot for k, or nil if k is not scraped or has
// not been attempted yet. It takes no lock.
func (m *Manager) Get(k Key) *Snapshot {
	w := (*m.view.Load())[k]
	if w == nil {
		return nil
	}
	return w.h.Load()
}

// All returns the latest Snapshot of every endpoint that has one, sorted by
// pool then address.
func (m *Manager) All() []*Snapshot {
	view := *m.view.Load()
	keys := slices.SortedFunc(maps.Keys(view), func(a, b Key) int {
		return strings.Compare(a.name(), b.name())
	})
	out := make([]*Snapshot, 0, len(keys))
	for _, k := range keys {
		if s := view[k].h.Load(); s != nil {
			out = append(out, s)
		}
	}
	return out
}
