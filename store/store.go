package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/switchyard/switchyard/registry"
)

// Errors Open and the store methods return; match them with errors.Is.
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

// Store is what switchyard's components need from persistence: depend on
// it rather than on *File, so tests can use the in-memory
// storetest.Fake. Its methods are safe for concurrent use.
//
// Save* methods record the latest value and return at once; a newer save
// of the same item replaces an older one. Flush makes everything saved so
// far durable, and Load returns what is durable. After Close,
// methods return ErrClosed (saves are ignored).
type Store interface {
	Load() (*Snapshot, error)
	SaveState(st *registry.State)
	SaveMetrics(m map[EndpointKey]Metrics)
	SaveHealth(h map[EndpointKey]Health)
	SavePrefix(pool, endpoint string, blob []byte) error
	SaveSessions(sessions []Session)
	SaveConsulIndex(key string, index uint64)
	// AddUsage counts one request's usage in its hourly bucket; when it
	// returns, a crash of the process cannot lose it (see File.AddUsage).
	AddUsage(t time.Time, tenant, model string, c UsageCounts) error
	// Usage returns the hourly buckets starting in [from, to), saved or
	// not yet committed, sorted by hour, tenant and model.
	Usage(from, to time.Time) ([]UsageRow, error)
	Flush(ctx context.Context) error
	// LastError is the error of the latest failed background write, or nil
	// once a write succeeds.
	LastError() error
	Close() error
}

var _ Store = (*File)(nil)

// File is an open switchyard state file, the bbolt implementation of
// Store. Its methods are safe for concurrent use.
type File struct {
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
	// journal makes usage durable between commits (usage.go).
	journal *journal

	closeOnce sync.Once
	closeErr  error
}

// Open opens (or creates) the store at path with file mode 0600. See the
// package documentation for what happens to locked, corrupt, foreign and
// newer-schema files.
func Open(path string, opts Options) (*File, error) {
	opts = opts.withDefaults()
	s := &File{
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
	if err := s.openJournal(); err != nil {
		_ = s.db.Close()
		return nil, err
	}
	for k, b := range snap.Prefix {
		s.prefixSizes[k] = len(b)
		s.prefixTotal += len(b)
	}
	go s.run()
	return s, nil
}

// open opens the database, moving an unusable file aside at most once.
func (s *File) open() (*Snapshot, error) {
	for attempt := 0; ; attempt++ {
		db, opened, reason, err := s.tryOpen()
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
			return nil, fmt.Errorf("store %s: freshly created file is unusable: %w", s.path, reason)
		}
		moved, err := s.quarantine(opened)
		if errors.Is(err, errReplaced) {
			// Another process moved the file aside first: open what is
			// there now (it is most likely locked by that process).
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("store %s is unusable (%v) and could not be moved aside: %w", s.path, reason, err)
		}
		s.recovery = &Recovery{MovedTo: moved, Reason: reason}
		s.log.Warn("store file was unusable; moved it aside and started a fresh store",
			"path", s.path, "moved_to", moved, "reason", reason)
	}
}

// errReplaced means the file changed identity between opening it and
// moving it aside.
var errReplaced = errors.New("store file was replaced while opening it")

// tryOpen opens the file with bbolt, which takes its exclusive lock (for
// at most Options.LockTimeout) and checks the meta pages itself. A non-nil
// reason means the file's content is unusable and the file should be moved
// aside; opened identifies the file that was opened, for the move. err is
// fatal: the file is locked, or the system refused to open it.
func (s *File) tryOpen() (db *bolt.DB, opened os.FileInfo, reason, err error) {
	openFile := func(name string, flag int, perm os.FileMode) (*os.File, error) {
		f, err := os.OpenFile(name, flag, perm)
		if err != nil {
			return nil, err
		}
		fi, err := f.Stat()
		if err != nil {
			_ = f.Close()
			return nil, err
		}
		if fi.Mode().Perm() != 0o600 {
			// bbolt's mode only applies to new files; tighten old ones.
			if err := f.Chmod(0o600); err != nil {
				s.log.Warn("store file is readable by others and cannot be restricted to its owner",
					"path", name, "mode", fi.Mode().Perm().String(), "err", err)
			}
		}
		opened = fi
		return f, nil
	}
	returned := false
	boltErr := guard(func() error {
		var err error
		db, err = bolt.Open(s.path, 0o600, &bolt.Options{Timeout: s.opts.LockTimeout, OpenFile: openFile})
		returned = true
		return err
	})
	switch {
	case boltErr == nil:
		return db, opened, nil, nil
	case !returned:
		// bbolt faulted on a damaged page while opening. The file stays
		// mapped (and so locked) by this process until it exits; it is
		// moved aside all the same.
		return nil, opened, boltErr, nil
	case errors.Is(boltErr, bolterrors.ErrTimeout):
		return nil, nil, nil, fmt.Errorf("store %s is %w: waited %v for its lock; is another switchyard running with the same store? Stop it, or give this one another store path", s.path, ErrLocked, s.opts.LockTimeout)
	case opened == nil || isSystemError(boltErr):
		return nil, nil, nil, describeOpenError(s.path, boltErr)
	case errors.Is(boltErr, bolterrors.ErrInvalid), errors.Is(boltErr, bolterrors.ErrChecksum), errors.Is(boltErr, bolterrors.ErrVersionMismatch):
		return nil, opened, fmt.Errorf("not a bbolt database (bbolt: %w)", boltErr), nil
	default:
		return nil, opened, fmt.Errorf("bbolt: %w", boltErr), nil
	}
}

// quarantine renames the store file to "<path>.corrupt-<time>". opened is
// the file that was found unusable: if path names another file by now,
// another process has already moved it aside and quarantine returns
// errReplaced instead of moving a good file.
func (s *File) quarantine(opened os.FileInfo) (string, error) {
	cur, err := os.Lstat(s.path)
	if err != nil {
		return "", err
	}
	if opened != nil && !os.SameFile(opened, cur) {
		return "", errReplaced
	}
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
func (s *File) Path() string { return s.path }

// Recovery reports whether Open moved an unusable file aside (nil if not).
func (s *File) Recovery() *Recovery { return s.recovery }

// LastError returns the error of the latest failed background flush, or
// nil once a flush succeeds.
func (s *File) LastError() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// Close flushes everything pending and closes the file. It is safe to call
// more than once.
func (s *File) Close() error {
	s.closeOnce.Do(func() {
		close(s.closing)
		<-s.done
		s.journal.close()
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
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
