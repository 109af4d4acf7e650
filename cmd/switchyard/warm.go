package main

import (
	"context"
	"hash/maphash"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/store"
)

// warmSaveInterval is how often the picker's scheduling memory (prefix
// index, sessions, endpoint health and load) is copied to the store. A
// crash loses at most this much learning plus the store's flush interval;
// the prefix index changes slowly relative to it.
const warmSaveInterval = 2 * time.Second

// warmSaver copies the picker's memory into the store, writing only the
// prefix blobs that changed since the last save and deleting those of
// endpoints that are gone.
type warmSaver struct {
	st     store.Store
	picker *picker.Server
	log    *slog.Logger
	seed   maphash.Seed
	// saved is the hash of every prefix blob in the store.
	saved map[store.EndpointKey]uint64
	// health is each endpoint's last saved health, for its Since.
	health map[store.EndpointKey]store.Health
	// restored is what the start loaded; saves and lastSave (UnixNano)
	// count durable saves since, for /api/status.
	restored picker.WarmStats
	saves    atomic.Int64
	lastSave atomic.Int64
}

func newWarmSaver(st store.Store, snap *store.Snapshot, p *picker.Server, logger *slog.Logger) *warmSaver {
	w := &warmSaver{st: st, picker: p, log: logger, seed: maphash.MakeSeed(),
		saved: map[store.EndpointKey]uint64{}, health: map[store.EndpointKey]store.Health{}}
	for k := range snap.Prefix {
		w.saved[k] = 0 // the previous run's: rewritten or deleted at the first save
	}
	for k, h := range snap.Health {
		w.health[k] = h
	}
	return w
}

// save copies the picker's current memory into the store's write batch.
func (w *warmSaver) save(now time.Time) {
	warm := w.picker.ExportWarm(now, picker.WarmLimits{
		MaxPrefixBlob: store.DefaultMaxPrefixBlob, MaxPrefixTotal: store.DefaultMaxPrefixTotal})

	live := make(map[store.EndpointKey]bool, len(warm.Prefix))
	for _, b := range warm.Prefix {
		k := store.EndpointKey{Pool: b.Pool, Address: b.Endpoint}
		live[k] = true
		h := maphash.Bytes(w.seed, b.Data)
		if old, ok := w.saved[k]; ok && old == h {
			continue
		}
		if err := w.st.SavePrefix(b.Pool, b.Endpoint, b.Data); err != nil {
			w.log.Warn("store: prefix index not saved", "pool", b.Pool, "endpoint", b.Endpoint, "err", err)
			continue
		}
		w.saved[k] = h
	}
	for k := range w.saved {
		if !live[k] {
			if err := w.st.SavePrefix(k.Pool, k.Address, nil); err == nil {
				delete(w.saved, k)
			}
		}
	}

	sessions := make([]store.Session, 0, len(warm.Sessions))
	for _, s := range warm.Sessions {
		sessions = append(sessions, store.Session{ID: s.ID, Pool: s.Pool, Endpoint: s.Endpoint, Expires: s.Expires})
	}
	w.st.SaveSessions(sessions)

	health := map[store.EndpointKey]store.Health{}
	loads := map[store.EndpointKey]store.Metrics{}
	for _, e := range warm.Endpoints {
		k := store.EndpointKey{Pool: e.Pool, Address: e.Endpoint}
		if e.Known {
			h := store.Health{Healthy: !e.Failing, Since: now}
			if e.Failing {
				h.Reason = "metrics scrapes failing"
			}
			if prev, ok := w.health[k]; ok && prev.Healthy == h.Healthy && !prev.Since.IsZero() {
				h.Since = prev.Since
			}
			health[k] = h
		}
		if !e.ScrapedAt.IsZero() {
			loads[k] = store.Metrics{Waiting: e.Waiting, Running: e.Running, KVUsage: e.KVUsage, ScrapedAt: e.ScrapedAt}
		}
	}
	w.health = health
	w.st.SaveHealth(health)
	w.st.SaveMetrics(loads)
}

// persistWarm saves the picker's memory every warmSaveInterval and once
// more on shutdown (the store's final flush on close commits that one).
// Each periodic save is flushed at once, so what status reports as saved
// survives a SIGKILL.
func (a *app) persistWarm(ctx context.Context) error {
	t := time.NewTicker(warmSaveInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			a.warm.save(time.Now())
			return nil
		case now := <-t.C:
			a.warm.save(now)
			fctx, cancel := context.WithTimeout(ctx, warmSaveInterval)
			err := a.store.Flush(fctx)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					a.log.Warn("store: flushing the picker's memory failed", "err", err)
				}
				continue
			}
			a.warm.saves.Add(1)
			a.warm.lastSave.Store(time.Now().UnixNano())
		}
	}
}

// restoreWarm loads what the previous run's picker knew into this one.
func restoreWarm(p *picker.Server, snap *store.Snapshot, logger *slog.Logger) picker.WarmStats {
	var warm picker.Warm
	for k, b := range snap.Prefix {
		warm.Prefix = append(warm.Prefix, picker.PrefixBlob{Pool: k.Pool, Endpoint: k.Address, Data: b})
	}
	for _, s := range snap.Sessions {
		warm.Sessions = append(warm.Sessions, picker.WarmSession{Pool: s.Pool, ID: s.ID, Endpoint: s.Endpoint, Expires: s.Expires})
	}
	for k, h := range snap.Health {
		warm.Endpoints = append(warm.Endpoints, picker.WarmEndpoint{Pool: k.Pool, Endpoint: k.Address, Known: true, Failing: !h.Healthy})
	}
	st, err := p.ImportWarm(warm, time.Now())
	if err != nil {
		logger.Warn("store: part of the picker's memory could not be restored", "err", err)
	}
	logger.Info("restored the picker's memory", "prefix_endpoints", st.PrefixEndpoints, "prefix_blocks", st.PrefixBlocks,
		"sessions", st.Sessions, "failing_endpoints", st.Failing)
	return st
}
