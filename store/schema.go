package store

import (
	"errors"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
)

// appID identifies a bbolt file as a switchyard store.
const appID = "switchyard-store"

// SchemaVersion is the on-disk layout this package reads and writes.
const SchemaVersion = 1

// Bucket and key names; see the package documentation.
var (
	bucketMeta     = []byte("meta")
	bucketState    = []byte("state")
	bucketMetrics  = []byte("metrics")
	bucketHealth   = []byte("health")
	bucketPrefix   = []byte("prefix")
	bucketSessions = []byte("sessions")
	bucketConsul   = []byte("consul")
	bucketUsage    = []byte("usage")

	keyApp       = []byte("app")
	keySchema    = []byte("schema")
	keyCreatedAt = []byte("created_at")
	keyFlushedAt = []byte("flushed_at")
	keyState     = []byte("current")
	// keyUsageFolded is the last usage journal record committed.
	keyUsageFolded = []byte("usage_folded")
)

// dataBuckets are the buckets of the current schema besides meta.
func dataBuckets() [][]byte {
	return [][]byte{bucketState, bucketMetrics, bucketHealth, bucketPrefix, bucketSessions, bucketConsul, bucketUsage}
}

// migration upgrades a store from schema version from to from+1 inside the
// write transaction it is given.
type migration struct {
	from uint64
	name string
	run  func(tx *bolt.Tx) error
}

// schema is the schema version this binary writes and the migrations that
// lead to it.
type schema struct {
	version    uint64
	migrations []migration
}

// currentSchema returns the built-in schema. Add a migration here (and bump
// SchemaVersion) whenever the layout or a record version changes.
func currentSchema() schema {
	return schema{version: SchemaVersion}
}

// prepare initialises a new file, or checks and migrates an existing one,
// then reads everything once. A non-nil reason means the file is not a
// usable switchyard store and should be moved aside; err is fatal.
func (s *File) prepare(db *bolt.DB) (snap *Snapshot, reason, err error) {
	var (
		hasMeta bool
		others  []string
		app     string
		version uint64
		verErr  error
	)
	reason = guard(func() error {
		return db.View(func(tx *bolt.Tx) error {
			return tx.ForEach(func(name []byte, _ *bolt.Bucket) error {
				if string(name) != string(bucketMeta) {
					others = append(others, string(name))
					return nil
				}
				hasMeta = true
				mb := tx.Bucket(bucketMeta)
				app = string(mb.Get(keyApp))
				version, verErr = parseU64("schema version", mb.Get(keySchema))
				return nil
			})
		})
	})
	if reason != nil {
		return nil, reason, nil
	}
	sc := s.opts.schema
	switch {
	case !hasMeta && len(others) == 0:
		if err := s.initialise(db); err != nil {
			return nil, nil, err
		}
	case !hasMeta:
		slices.Sort(others)
		return nil, fmt.Errorf("foreign bbolt database: no switchyard metadata (buckets %q)", others), nil
	case app != appID:
		return nil, fmt.Errorf("foreign bbolt database: application id %q, want %q", app, appID), nil
	case verErr != nil:
		return nil, verErr, nil
	case version > sc.version:
		return nil, nil, fmt.Errorf("store %s: %w (file has schema %d, this switchyard knows up to %d); the file was left untouched: run the newer switchyard, or move the file away to start cold", s.path, ErrNewerSchema, version, sc.version)
	case version < sc.version:
		if err := s.migrate(db, version); err != nil {
			return nil, nil, err
		}
	}
	if err := ensureBuckets(db); err != nil {
		return nil, nil, fmt.Errorf("store %s: create buckets: %w", s.path, err)
	}
	var loadErr error
	reason = guard(func() error {
		snap, loadErr = s.read(db)
		return nil
	})
	if reason == nil && loadErr != nil {
		reason = loadErr
	}
	if reason != nil {
		return nil, reason, nil
	}
	return snap, nil, nil
}

func (s *File) initialise(db *bolt.DB) error {
	err := db.Update(func(tx *bolt.Tx) error {
		mb, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		for _, kv := range [][2][]byte{
			{keyApp, []byte(appID)},
			{keySchema, u64(s.opts.schema.version)},
			{keyCreatedAt, []byte(s.opts.Now().UTC().Format(time.RFC3339Nano))},
		} {
			if err := mb.Put(kv[0], kv[1]); err != nil {
				return err
			}
		}
		for _, b := range dataBuckets() {
			if _, err := tx.CreateBucket(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("store %s: initialise: %w", s.path, err)
	}
	return nil
}

// migrate runs every migration from version up to the current schema in
// one transaction: either the file ends up at the current schema or it is
// left exactly as it was.
func (s *File) migrate(db *bolt.DB, from uint64) error {
	sc := s.opts.schema
	err := db.Update(func(tx *bolt.Tx) error {
		for v := from; v < sc.version; v++ {
			i := slices.IndexFunc(sc.migrations, func(m migration) bool { return m.from == v })
			if i < 0 {
				return fmt.Errorf("no migration from schema %d to %d", v, v+1)
			}
			m := sc.migrations[i]
			if err := m.run(tx); err != nil {
				return fmt.Errorf("migration %d->%d (%s): %w", v, v+1, m.name, err)
			}
		}
		return tx.Bucket(bucketMeta).Put(keySchema, u64(sc.version))
	})
	if err != nil {
		return fmt.Errorf("store %s: migrate schema %d to %d: %w; the file was left unchanged", s.path, from, sc.version, err)
	}
	s.log.Info("store schema migrated", "path", s.path, "from", from, "to", sc.version)
	return nil
}

// ensureBuckets creates missing data buckets, writing only if needed.
func ensureBuckets(db *bolt.DB) error {
	missing := false
	_ = db.View(func(tx *bolt.Tx) error {
		for _, b := range dataBuckets() {
			if tx.Bucket(b) == nil {
				missing = true
			}
		}
		return nil
	})
	if !missing {
		return nil
	}
	return db.Update(func(tx *bolt.Tx) error {
		var errs []error
		for _, b := range dataBuckets() {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}
