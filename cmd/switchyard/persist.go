package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/registry/hclfile"
	"github.com/switchyard/switchyard/store"
)

// openStore opens the bbolt file and loads what the previous run left, so
// serve can start warm: the persisted state is served before any source
// (Consul included) has answered.
func openStore(path string, logger *slog.Logger) (*store.File, *store.Snapshot, error) {
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
		return nil, nil, err
	}
	return st, snap, nil
}

// consulIndexKey encodes a selector as the store's string key.
func consulIndexKey(sel registry.ConsulSelector) string {
	b, _ := json.Marshal(sel) // a struct of strings and a bool always encodes
	return string(b)
}

// consulIndexes decodes the persisted indexes back into selectors; keys
// that no longer decode (a renamed field) are skipped, costing one full
// read.
func consulIndexes(saved map[string]uint64) map[registry.ConsulSelector]uint64 {
	out := map[registry.ConsulSelector]uint64{}
	for k, idx := range saved {
		var sel registry.ConsulSelector
		if json.Unmarshal([]byte(k), &sel) == nil {
			out[sel] = idx
		}
	}
	return out
}

// persist saves every published state, and the Consul indexes it was
// built from, to the store, and waits for it to be durable before looking
// at the next one: a SIGKILL then loses at most the state published while
// that one commit ran (a few milliseconds), where the store's batched
// writer alone could lose up to its flush interval (200 ms) of states. It
// runs beside the registry, so a publish is never slowed down; states
// published while a commit runs are coalesced into the latest.
func (a *app) persist(ctx context.Context) error {
	var last uint64
	for {
		st, changed := a.view.Current()
		if st.Version != 0 && st.Version != last {
			a.store.SaveState(st)
			if a.consul != nil {
				for sel, idx := range a.consul.Indexes() {
					a.store.SaveConsulIndex(consulIndexKey(sel), idx)
				}
			}
			if err := a.store.Flush(ctx); err != nil && ctx.Err() == nil {
				a.log.Error("store: persisting the registry state failed; it stays in memory and is retried with the next write", "version", st.Version, "err", err)
			}
			last = st.Version
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

// newConsulSource builds the Consul source watching what cfg asks for (its
// pools' consul blocks, the replicas block); it opens no connection until
// something is wanted. restored is the persisted state, whose Consul
// members stand in until Consul first answers. The configuration's
// top-level consul block, read once at start, overrides the CONSUL_HTTP_*
// environment.
func newConsulSource(cfg *hclfile.Config, restored *registry.State, saved map[string]uint64, logger *slog.Logger) (*consul.Source, error) {
	opts := consul.Options{
		Wants:          consul.WantsFrom(cfg.State),
		Restored:       restored,
		InitialIndexes: consulIndexes(saved),
		Logger:         logger.With("component", "consul"),
	}
	if ag := cfg.Consul; ag != nil {
		opts.Address, opts.Token, opts.TokenFile = ag.Address, ag.Token, ag.TokenFile
		t := ag.TLS
		opts.TLS = consul.TLSOptions{ServerName: t.ServerName, CAFile: t.CAFile, CAPath: t.CAPath,
			CertFile: t.CertFile, KeyFile: t.KeyFile, InsecureSkipVerify: t.InsecureSkipVerify}
	}
	cs, err := consul.New(opts)
	if err != nil {
		return nil, fmt.Errorf("consul: %w", err)
	}
	return cs, nil
}
