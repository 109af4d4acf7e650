package persist

import (
	"context"
	"hash/maphash"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/store"
)

// DefaultWarmInterval is how often Warm copies the picker's scheduling
// memory (prefix index, sessions, endpoint health and load) to the store.
// A crash loses at most this much learning plus the store's flush
// interval; the prefix index changes slowly relative to it.
const DefaultWarmInterval = 2 * time.Second

// failingReason is the store's Health.Reason of an endpoint whose metrics
// scrapes fail.
const failingReason = "metrics scrapes failing"

// Picker is the part of the picker Warm saves and restores;
// *picker.Server implements it.
type Picker interface {
	ExportWarm(now time.Time, lim picker.WarmLimits) picker.Warm
	ImportWarm(w picker.Warm, now time.Time) (picker.WarmStats, error)
}

// WarmOptions configure NewWarm; the zero value uses the defaults.
type WarmOptions struct {
	// Interval is how often Run saves (DefaultWarmInterval when 0).
	Interval time.Duration
	// Logger receives save and restore problems (discarded when nil).
	Logger *slog.Logger
}

// Warm carries the picker's scheduling memory across restarts: Restore
// loads what a previous run saved into the picker, and Run copies the
// picker's memory into the store, writing only the prefix blobs that
// changed since the last save and deleting those of endpoints that are
// gone. An endpoint's health keeps the time it entered its state across
// saves (and restarts), so the store says since when it has been failing.
type Warm struct {
	st       store.Store
	picker   Picker
	interval time.Duration
	log      *slog.Logger
	seed     maphash.Seed

	// Touched by Restore (before Run) and Run's saves only.
	// saved holds the prefix blobs in the store: their hash, or unhashed
	// for the previous run's (rewritten or deleted at the first save).
	saved map[store.EndpointKey]savedBlob
	// health is each endpoint's last saved health, for its Since.
	health map[store.EndpointKey]store.Health

	restored atomic.Pointer[picker.WarmStats]
	saves    atomic.Int64
	lastSave atomic.Int64 // UnixNano of the latest durable save
}

type savedBlob struct {
	hash   uint64
	hashed bool
}

// NewWarm returns a Warm between p and st.
func NewWarm(st store.Store, p Picker, opts WarmOptions) *Warm {
	if opts.Interval <= 0 {
		opts.Interval = DefaultWarmInterval
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Warm{st: st, picker: p, interval: opts.Interval, log: opts.Logger, seed: maphash.MakeSeed(),
		saved: map[store.EndpointKey]savedBlob{}, health: map[store.EndpointKey]store.Health{}}
}

// Restore loads what the previous run saved (snap) into the picker: call
// it once, after the picker has the persisted registry state and before
// Run. What the picker cannot use (entries of endpoints it does not have,
// blobs that do not decode) is skipped and logged; the rest loads.
func (w *Warm) Restore(snap *store.Snapshot, now time.Time) picker.WarmStats {
	var warm picker.Warm
	for k, b := range snap.Prefix {
		warm.Prefix = append(warm.Prefix, picker.PrefixBlob{Pool: k.Pool, Endpoint: k.Address, Data: b})
		w.saved[k] = savedBlob{}
	}
	for _, s := range snap.Sessions {
		warm.Sessions = append(warm.Sessions, picker.WarmSession{Pool: s.Pool, ID: s.ID, Endpoint: s.Endpoint, Expires: s.Expires})
	}
	for k, h := range snap.Health {
		warm.Endpoints = append(warm.Endpoints, picker.WarmEndpoint{Pool: k.Pool, Endpoint: k.Address, Known: true, Failing: !h.Healthy})
		w.health[k] = h
	}
	st, err := w.picker.ImportWarm(warm, now)
	if err != nil {
		w.log.Warn("store: part of the picker's memory could not be restored", "err", err)
	}
	w.log.Info("restored the picker's memory", "prefix_endpoints", st.PrefixEndpoints, "prefix_blocks", st.PrefixBlocks,
		"sessions", st.Sessions, "failing_endpoints", st.Failing)
	w.restored.Store(&st)
	return st
}

// Restored is what Restore loaded (zero before it ran).
func (w *Warm) Restored() picker.WarmStats {
	if st := w.restored.Load(); st != nil {
		return *st
	}
	return picker.WarmStats{}
}

// Saves returns how many periodic saves were made durable since start and
// when the latest finished (zero if none).
func (w *Warm) Saves() (n int64, last time.Time) {
	if ns := w.lastSave.Load(); ns != 0 {
		last = time.Unix(0, ns)
	}
	return w.saves.Load(), last
}

// Run saves the picker's memory every interval, flushing each save so
// that what Saves reports survives a SIGKILL, and once more when ctx ends
// (not flushed: closing the store commits it). A failed flush is logged
// and retried with the next save. Run returns nil when ctx ends.
func (w *Warm) Run(ctx context.Context) error {
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			w.save(time.Now())
			return nil
		case now := <-t.C:
			w.save(now)
			fctx, cancel := context.WithTimeout(ctx, w.interval)
			err := w.st.Flush(fctx)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					w.log.Warn("store: flushing the picker's memory failed", "err", err)
				}
				continue
			}
			w.saves.Add(1)
			w.lastSave.Store(time.Now().UnixNano())
		}
	}
}

// save copies the picker's current memory into the store's write batch.
func (w *Warm) save(now time.Time) {
	warm := w.picker.ExportWarm(now, picker.WarmLimits{
		MaxPrefixBlob: store.DefaultMaxPrefixBlob, MaxPrefixTotal: store.DefaultMaxPrefixTotal})
	w.savePrefix(warm.Prefix)

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
				h.Reason = failingReason
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

// savePrefix writes the blobs that changed since the last save and
// deletes those of endpoints no longer exported. A blob the store refuses
// is logged and tried again at the next save.
func (w *Warm) savePrefix(blobs []picker.PrefixBlob) {
	live := make(map[store.EndpointKey]bool, len(blobs))
	for _, b := range blobs {
		k := store.EndpointKey{Pool: b.Pool, Address: b.Endpoint}
		live[k] = true
		h := maphash.Bytes(w.seed, b.Data)
		if old, ok := w.saved[k]; ok && old.hashed && old.hash == h {
			continue
		}
		if err := w.st.SavePrefix(b.Pool, b.Endpoint, b.Data); err != nil {
			w.log.Warn("store: prefix index not saved", "pool", b.Pool, "endpoint", b.Endpoint, "err", err)
			continue
		}
		w.saved[k] = savedBlob{hash: h, hashed: true}
	}
	for k := range w.saved {
		if !live[k] {
			if err := w.st.SavePrefix(k.Pool, k.Address, nil); err == nil {
				delete(w.saved, k)
			}
		}
	}
}
