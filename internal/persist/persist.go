// Package persist keeps a running switchyard's memory in a store.Store so
// that a restart is warm: Open loads what the previous run left,
// StateSaver writes every published registry state (and the Consul
// indexes it was built from) durably, and Warm restores the picker's
// scheduling memory (prefix index, sessions, endpoint health) at start and
// copies it back to the store every few seconds. It owns the translation
// between the picker's and the store's types; the store owns the file,
// the picker what the memory means.
package persist

import (
	"encoding/json"
	"log/slog"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
)

// Open opens the bbolt store at path and loads what the previous run
// left, so serve can start warm: the persisted state is served before any
// source (Consul included) has answered. A file that was unusable and
// moved aside is logged; the store then starts empty.
func Open(path string, logger *slog.Logger) (*store.File, *store.Snapshot, error) {
	st, err := store.Open(path, store.Options{Logger: logger.With("component", "store")})
	if err != nil {
		return nil, nil, err // names the path and what to do
	}
	if r := st.Recovery(); r != nil {
		logger.Warn("store file was unusable and has been moved aside; starting cold",
			"path", path, "moved_to", r.MovedTo, "reason", r.Reason)
	}
	snap, err := st.Load()
	if err != nil {
		_ = st.Close()
		return nil, nil, err // names the path
	}
	return st, snap, nil
}

// consulIndexKey encodes a selector as the store's string key.
func consulIndexKey(sel registry.ConsulSelector) string {
	b, _ := json.Marshal(sel) // a struct of strings and a bool always encodes
	return string(b)
}

// ConsulIndexes returns the Consul blocking-query indexes snap holds, by
// selector, for consul.Options.InitialIndexes (empty for a nil snap).
// Keys that no longer decode (a renamed field) are skipped, costing that
// selector one full read.
func ConsulIndexes(snap *store.Snapshot) map[registry.ConsulSelector]uint64 {
	out := map[registry.ConsulSelector]uint64{}
	if snap == nil {
		return out
	}
	for k, idx := range snap.ConsulIndexes {
		var sel registry.ConsulSelector
		if json.Unmarshal([]byte(k), &sel) == nil {
			out[sel] = idx
		}
	}
	return out
}
