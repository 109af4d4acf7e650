package store

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// Errors Open and the Store methods return; match them with errors.Is.
var (
	// ErrLocked means another process (usually another switchyard) holds
	// the store file.
	ErrLocked = errors.New("locked by another process")
	// ErrNewerSchema means the file was written by a newer switchyard; it
	// is left untouched.
	ErrNewerSchema = errors.New("schema is newer than this switchyard supports")
	// ErrClosed is returned by methods called after Close.
	ErrClosed = errors.New("store is closed")
	// ErrTooLarge is returned by SavePrefix when a blob exceeds
	// Options.MaxPrefixBlob or would push the total past
	// Options.MaxPrefixTotal.
	ErrTooLarge = errors.New("prefix blob too large")
)

// Defaults for the zero fields of Options.
const (
	DefaultLockTimeout    = time.Second
	DefaultFlushInterval  = 200 * time.Millisecond
	DefaultVersionBlock   = 1000
	DefaultMaxPrefixBlob  = 256 << 10
	DefaultMaxPrefixTotal = 64 << 20
	DefaultMaxSessions    = 100_000
	// MaxKeyLen bounds session ids, pool/endpoint pairs and Consul keys;
	// longer keys are dropped rather than failing a whole flush.
	MaxKeyLen = 1024
)

// Options configure Open. The zero value uses the defaults above.
type Options struct {
	// LockTimeout is how long Open waits for another process to release
	// the file before failing with ErrLocked.
	LockTimeout time.Duration
	// FlushInterval is the longest a Save* waits in memory before the
	// background writer commits it.
	FlushInterval time.Duration
	// VersionBlock is how many xDS versions one durable reservation covers.
	VersionBlock uint64
	// MaxPrefixBlob caps one prefix-cache blob, MaxPrefixTotal all of them.
	MaxPrefixBlob  int
	MaxPrefixTotal int
	// MaxSessions caps the session-affinity map; the sessions that expire
	// last are kept.
	MaxSessions int
	// Logger receives recovery warnings and flush errors (slog.Default()
	// when nil).
	Logger *slog.Logger
	// Now is the clock used for session expiry and timestamps (time.Now
	// when nil).
	Now func() time.Time

	// schema overrides the schema version and migrations (tests only).
	schema *schema
}

func (o Options) withDefaults() Options {
	if o.LockTimeout <= 0 {
		o.LockTimeout = DefaultLockTimeout
	}
	if o.FlushInterval <= 0 {
		o.FlushInterval = DefaultFlushInterval
	}
	if o.VersionBlock == 0 {
		o.VersionBlock = DefaultVersionBlock
	}
	if o.MaxPrefixBlob <= 0 {
		o.MaxPrefixBlob = DefaultMaxPrefixBlob
	}
	if o.MaxPrefixTotal <= 0 {
		o.MaxPrefixTotal = DefaultMaxPrefixTotal
	}
	if o.MaxSessions <= 0 {
		o.MaxSessions = DefaultMaxSessions
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.schema == nil {
		s := currentSchema()
		o.schema = &s
	}
	return o
}

// Recovery says that Open found an unusable file and moved it aside.
type Recovery struct {
	// MovedTo is where the old file now lives ("<path>.corrupt-<time>").
	MovedTo string
	// Reason is why the file was unusable.
	Reason error
}

// Store is an open switchyard state file. Its methods are safe for
// concurrent use.
type Store struct {
	path     string
	db       *bolt.DB
	opts     Options
	log      *slog.Logger
	recovery *Recovery

	mu          sync.Mutex
	pend        pending
	prefixSizes map[EndpointKey]int // size of every blob on disk or pending
	prefixTotal int
	closed      bool
	lastErr     error

	dirty    chan struct{} // 1-buffered wake-up for the writer
	flushReq chan chan error
	closing  chan struct{}
	done     chan struct{} // closed when the writer has returned
	writeErr error         // the writer's final flush error
	flushes  atomic.Uint64 // committed batches, for tests

	closeOnce sync.Once
	closeErr  error

	verMu    sync.Mutex
	nextVer  uint64
	verLimit uint64 // highest version covered by the durable reservation
}

// Open opens (or creates) the store at path with file mode 0600. See the
// package documentation for what happens to locked, corrupt, foreign and
// newer-schema files.
func Open(path string, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	s := &Store{
		path:        path,
		opts:        opts,
		log:         opts.Logger,
		prefixSizes: map[EndpointKey]int{},
		dirty:       make(chan struct{}, 1),
		flushReq:    make(chan chan error),
		closing:     make(chan struct{}),
		done:        make(chan struct{}),
	}
	snap, err := s.open()
	if err != nil {
		return nil, err
	}
	for k, b := range snap.Prefix {
		s.prefixSizes[k] = len(b)
		s.prefixTotal += len(b)
	}
	s.verLimit = snap.XDSVersion
	s.nextVer = snap.XDSVersion + 1
	go s.run()
	return s, nil
}

// open opens the database, moving an unusable file aside at most once.
func (s *Store) open() (*Snapshot, error) {
	for attempt := 0; ; attempt++ {
		db, held, reason, err := s.tryOpen()
		if err != nil {
			return nil, err
		}
		if reason == nil {
			snap, reason2, err := s.prepare(db)
			if err != nil {
				_ = db.Close()
				return nil, err
			}
			if reason2 == nil {
				s.db = db
				return snap, nil
			}
			_ = db.Close()
			reason = reason2
		}
		if attempt > 0 {
			if held != nil {
				_ = held.Close()
			}
			return nil, fmt.Errorf("store %s: freshly created file is unusable: %w", s.path, reason)
		}
		moved, err := s.quarantine(held)
		if err != nil {
			return nil, fmt.Errorf("store %s is unusable (%v) and could not be moved aside: %w", s.path, reason, err)
		}
		s.recovery = &Recovery{MovedTo: moved, Reason: reason}
		s.log.Warn("store file was unusable; moved it aside and started a fresh store",
			"path", s.path, "moved_to", moved, "reason", reason)
	}
}

// tryOpen locks the file, checks its header and opens it with bbolt. A
// non-nil reason means the file is unusable and should be moved aside;
// held, if non-nil, is the still-locked file to move. err is fatal.
func (s *Store) tryOpen() (db *bolt.DB, held *os.File, reason, err error) {
	f, err := os.OpenFile(s.path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("store %s: open: %w", s.path, err)
	}
	if err := lockFile(f, s.opts.LockTimeout); err != nil {
		_ = f.Close()
		if errors.Is(err, ErrLocked) {
			return nil, nil, nil, fmt.Errorf("store %s is %w (is another switchyard running with the same -store path?)", s.path, err)
		}
		return nil, nil, nil, fmt.Errorf("store %s: lock: %w", s.path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, nil, nil, fmt.Errorf("store %s: stat: %w", s.path, err)
	}
	if fi.Mode().Perm() != 0o600 {
		if err := f.Chmod(0o600); err != nil {
			_ = f.Close()
			return nil, nil, nil, fmt.Errorf("store %s: chmod 0600: %w", s.path, err)
		}
	}
	if fi.Size() > 0 {
		if reason := checkHeader(f, fi.Size()); reason != nil {
			return nil, f, reason, nil
		}
	}
	returned := false
	reason = guard(func() error {
		var err error
		db, err = bolt.Open(s.path, 0o600, &bolt.Options{
			Timeout: s.opts.LockTimeout,
			// Hand bbolt the file we already locked: flock on the same
			// open file description succeeds, and bbolt closes it.
			OpenFile: func(string, int, os.FileMode) (*os.File, error) { return f, nil },
		})
		returned = true
		return err
	})
	switch {
	case reason == nil:
		return db, nil, nil, nil
	case !returned:
		// bbolt panicked on a damaged page: f is still open and locked.
		return nil, f, reason, nil
	case errors.Is(reason, bolterrors.ErrTimeout):
		return nil, nil, nil, fmt.Errorf("store %s is %w", s.path, ErrLocked)
	default:
		// bbolt closed (and unlocked) f itself.
		return nil, nil, fmt.Errorf("bbolt: %w", reason), nil
	}
}

// quarantine renames the store file to "<path>.corrupt-<time>". held is the
// locked file, or nil to lock it again first.
func (s *Store) quarantine(held *os.File) (string, error) {
	if held == nil {
		f, err := os.OpenFile(s.path, os.O_RDWR, 0)
		if err != nil {
			return "", err
		}
		if err := lockFile(f, s.opts.LockTimeout); err != nil {
			_ = f.Close()
			return "", err
		}
		held = f
	}
	defer func() {
		// Unlock explicitly: a mapping bbolt left behind after a panic
		// would otherwise keep the lock alive on the moved file.
		_ = unlockFile(held)
		_ = held.Close()
	}()
	base := s.path + ".corrupt-" + s.opts.Now().UTC().Format("20060102T150405Z")
	target := base
	for i := 1; ; i++ {
		if _, err := os.Lstat(target); errors.Is(err, os.ErrNotExist) {
			break
		}
		target = fmt.Sprintf("%s-%d", base, i)
	}
	if err := os.Rename(s.path, target); err != nil {
		return "", err
	}
	syncDir(s.path)
	return target, nil
}

// Path returns the store's file name.
func (s *Store) Path() string { return s.path }

// Recovery reports whether Open moved an unusable file aside (nil if not).
func (s *Store) Recovery() *Recovery { return s.recovery }

// LastError returns the error of the latest failed background flush, or
// nil once a flush succeeds.
func (s *Store) LastError() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// Close flushes everything pending and closes the file. It is safe to call
// more than once.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		close(s.closing)
		<-s.done
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		s.verMu.Lock()
		defer s.verMu.Unlock()
		var err error
		if s.writeErr != nil {
			err = fmt.Errorf("store %s: final flush: %w", s.path, s.writeErr)
		}
		if cerr := s.db.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("store %s: close: %w", s.path, cerr))
		}
		s.closeErr = err
	})
	return s.closeErr
}

// NextVersion returns the next xDS snapshot version: strictly greater than
// every version this file has ever handed out, across restarts and crashes.
// Versions come from a block reserved durably on disk; crossing into a new
// block commits (and fsyncs) the new high-water mark before returning.
func (s *Store) NextVersion() (uint64, error) {
	s.verMu.Lock()
	defer s.verMu.Unlock()
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return 0, ErrClosed
	}
	if s.nextVer > s.verLimit {
		limit := s.nextVer - 1 + s.opts.VersionBlock
		err := s.db.Update(func(tx *bolt.Tx) error {
			return tx.Bucket(bucketMeta).Put(keyXDSVersion, u64(limit))
		})
		if err != nil {
			return 0, fmt.Errorf("store %s: reserve xDS versions up to %d: %w", s.path, limit, err)
		}
		s.verLimit = limit
	}
	v := s.nextVer
	s.nextVer++
	return v, nil
}
