package store

import (
	"encoding/json"
	"fmt"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/switchyard/switchyard/registry"
)

// EndpointKey names one endpoint of one pool.
type EndpointKey struct {
	Pool    string
	Address string // "ip:port"
}

// Metrics is the last scrape of one endpoint.
type Metrics struct {
	Waiting   int
	Running   int
	KVUsage   float64 // 0..1
	ScrapedAt time.Time
}

// Health is an endpoint's health and drain state as the picker last saw it.
type Health struct {
	Healthy  bool
	Draining bool
	// Reason says why the endpoint is unhealthy or draining ("" if not).
	Reason string
	// Since is when the endpoint entered this state.
	Since time.Time
}

// Session is one session-affinity entry.
type Session struct {
	ID       string
	Pool     string
	Endpoint string // "ip:port"
	Expires  time.Time
}

// Snapshot is everything the store held when it was loaded. It shares no
// memory with the store; callers may keep and modify it.
type Snapshot struct {
	// StateVersion is the Version of the persisted registry state (0 if
	// none); seed registry.WithInitialVersion with it.
	StateVersion uint64
	Metrics      map[EndpointKey]Metrics
	Health       map[EndpointKey]Health
	// Prefix holds the picker's opaque prefix-cache blobs.
	Prefix map[EndpointKey][]byte
	// Sessions are the unexpired session-affinity entries, sorted by ID.
	Sessions []Session
	// ConsulIndexes are the last Consul indexes by selector key.
	ConsulIndexes map[string]uint64
	// CreatedAt is when the file was created; FlushedAt when the background
	// writer last committed (zero if never).
	CreatedAt time.Time
	FlushedAt time.Time

	state *stateRecord
}

// NewSnapshot returns an empty snapshot (what a new store loads).
func NewSnapshot() *Snapshot {
	return &Snapshot{
		Metrics:       map[EndpointKey]Metrics{},
		Health:        map[EndpointKey]Health{},
		Prefix:        map[EndpointKey][]byte{},
		ConsulIndexes: map[string]uint64{},
	}
}

// SetState sets the snapshot's registry state and StateVersion to a copy
// of st (nil clears them). Stores other than File, such as
// storetest.Fake, build their snapshots with it.
func (sn *Snapshot) SetState(st *registry.State) {
	if st == nil {
		sn.state, sn.StateVersion = nil, 0
		return
	}
	r := fromState(st)
	sn.state, sn.StateVersion = &r, r.Version
}

// State returns a fresh copy of the persisted registry state (with its
// Version), or nil if no state was ever saved.
func (sn *Snapshot) State() *registry.State {
	if sn.state == nil {
		return nil
	}
	return sn.state.toState()
}

// Load reads everything persisted (that is, flushed) from disk. Sessions
// that have expired are left out.
func (s *File) Load() (*Snapshot, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	var snap *Snapshot
	err := guard(func() error {
		var err error
		snap, err = s.read(s.db)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("store %s: load: %w", s.path, err)
	}
	return snap, nil
}

func (s *File) read(db *bolt.DB) (*Snapshot, error) {
	snap := NewSnapshot()
	now := s.opts.Now()
	err := db.View(func(tx *bolt.Tx) error {
		mb := tx.Bucket(bucketMeta)
		var err error
		if snap.CreatedAt, err = parseTime("created_at", mb.Get(keyCreatedAt)); err != nil {
			return err
		}
		if snap.FlushedAt, err = parseTime("flushed_at", mb.Get(keyFlushedAt)); err != nil {
			return err
		}
		if data := tx.Bucket(bucketState).Get(keyState); data != nil {
			var r stateRecord
			if err := decode("state", keyState, data, &r, func() int { return r.V }); err != nil {
				return err
			}
			snap.state, snap.StateVersion = &r, r.Version
		}
		err = tx.Bucket(bucketMetrics).ForEach(func(k, v []byte) error {
			key, err := parseEndpointKey(k)
			if err != nil {
				return fmt.Errorf("metrics: %w", err)
			}
			var r metricsRecord
			if err := decode("metrics", k, v, &r, func() int { return r.V }); err != nil {
				return err
			}
			snap.Metrics[key] = Metrics{Waiting: r.Waiting, Running: r.Running, KVUsage: r.KVUsage, ScrapedAt: r.ScrapedAt}
			return nil
		})
		if err != nil {
			return err
		}
		err = tx.Bucket(bucketHealth).ForEach(func(k, v []byte) error {
			key, err := parseEndpointKey(k)
			if err != nil {
				return fmt.Errorf("health: %w", err)
			}
			var r healthRecord
			if err := decode("health", k, v, &r, func() int { return r.V }); err != nil {
				return err
			}
			snap.Health[key] = Health{Healthy: r.Healthy, Draining: r.Draining, Reason: r.Reason, Since: r.Since}
			return nil
		})
		if err != nil {
			return err
		}
		err = tx.Bucket(bucketPrefix).ForEach(func(k, v []byte) error {
			key, err := parseEndpointKey(k)
			if err != nil {
				return fmt.Errorf("prefix: %w", err)
			}
			snap.Prefix[key] = append([]byte(nil), v...)
			return nil
		})
		if err != nil {
			return err
		}
		err = tx.Bucket(bucketSessions).ForEach(func(k, v []byte) error {
			var r sessionRecord
			if err := decode("session", k, v, &r, func() int { return r.V }); err != nil {
				return err
			}
			if r.Expires.After(now) {
				snap.Sessions = append(snap.Sessions, Session{ID: string(k), Pool: r.Pool, Endpoint: r.Endpoint, Expires: r.Expires})
			}
			return nil
		})
		if err != nil {
			return err
		}
		return tx.Bucket(bucketConsul).ForEach(func(k, v []byte) error {
			idx, err := parseU64(fmt.Sprintf("consul index %q", k), v)
			if err != nil {
				return err
			}
			snap.ConsulIndexes[string(k)] = idx
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(snap.Sessions, func(i, j int) bool { return snap.Sessions[i].ID < snap.Sessions[j].ID })
	return snap, nil
}

func parseTime(what string, b []byte) (time.Time, error) {
	if b == nil {
		return time.Time{}, nil
	}
	var t time.Time
	if err := t.UnmarshalText(b); err != nil {
		return time.Time{}, fmt.Errorf("%s: %w", what, err)
	}
	return t, nil
}

// encodeRecord marshals a record; the record types cannot fail to encode
// except for non-finite floats, which are reported.
func encodeRecord(what string, v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w", what, err)
	}
	return b, nil
}
