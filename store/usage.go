package store

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
)

// UsageKey names one usage bucket: an hour (its start, UTC), a tenant and
// a model.
type UsageKey struct {
	Hour   time.Time
	Tenant string
	Model  string
}

// UsageCounts are what a usage bucket adds up.
type UsageCounts struct {
	Requests, Errors                             int64
	PromptTokens, CachedTokens, CompletionTokens int64
}

func (c *UsageCounts) add(o UsageCounts) {
	c.Requests += o.Requests
	c.Errors += o.Errors
	c.PromptTokens += o.PromptTokens
	c.CachedTokens += o.CachedTokens
	c.CompletionTokens += o.CompletionTokens
}

// UsageRow is one bucket's counts.
type UsageRow struct {
	UsageKey
	UsageCounts
}

// UsageHour is the bucket that holds t.
func UsageHour(t time.Time) time.Time { return t.UTC().Truncate(time.Hour) }

// SortUsage orders rows by hour, tenant, model.
func SortUsage(rows []UsageRow) {
	slices.SortFunc(rows, func(a, b UsageRow) int {
		if c := a.Hour.Compare(b.Hour); c != 0 {
			return c
		}
		if c := strings.Compare(a.Tenant, b.Tenant); c != 0 {
			return c
		}
		return strings.Compare(a.Model, b.Model)
	})
}

// journal makes usage durable against a crash of the process without a
// bbolt commit per request: AddUsage appends one line to a journal file
// (a write into the kernel's page cache, which a killed process cannot
// lose), and the writer folds the journal into bbolt with its next commit.
// Two files alternate: records go to the active one while the other's,
// already committed, are truncated away; each record carries a sequence
// number, and the commit stores the last number it folded in, so replaying
// a journal at Open never counts a record twice.
type journal struct {
	mu     sync.Mutex
	files  [2]*os.File
	active int
	// fileMax is the highest sequence number written to each file.
	fileMax [2]uint64
	seq     uint64 // last number given out
	folded  uint64 // last number committed to bbolt
	pending map[UsageKey]UsageCounts
	// folding is the batch of a commit in progress (still visible to
	// queries), foldingUpto its last sequence number.
	folding     map[UsageKey]UsageCounts
	foldingUpto uint64
	werr        error // the last journal write error, logged once
	closed      bool
}

// journalRecord is one line of a journal file.
type journalRecord struct {
	Seq        uint64 `json:"s"`
	Hour       int64  `json:"h"`
	Tenant     string `json:"t"`
	Model      string `json:"m"`
	Requests   int64  `json:"r,omitempty"`
	Errors     int64  `json:"e,omitempty"`
	Prompt     int64  `json:"p,omitempty"`
	Cached     int64  `json:"c,omitempty"`
	Completion int64  `json:"o,omitempty"`
}

// usageRecord is a bucket's value in bbolt.
type usageRecord struct {
	V          int   `json:"v"`
	Requests   int64 `json:"requests"`
	Errors     int64 `json:"errors"`
	Prompt     int64 `json:"prompt_tokens"`
	Cached     int64 `json:"cached_tokens"`
	Completion int64 `json:"completion_tokens"`
}

// journalPaths are the journal files of the store at path.
func journalPaths(path string) [2]string {
	return [2]string{path + ".usage-0", path + ".usage-1"}
}

// openJournal replays what the previous run journaled but did not commit,
// commits it, and opens empty journals.
func (s *File) openJournal() error {
	j := &journal{pending: map[UsageKey]UsageCounts{}}
	if err := s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(keyUsageFolded); v != nil {
			n, err := parseU64("usage sequence", v)
			j.folded = n
			return err
		}
		return nil
	}); err != nil {
		return fmt.Errorf("store %s: %w", s.path, err)
	}
	j.seq = j.folded
	replay := map[UsageKey]UsageCounts{}
	for i, p := range journalPaths(s.path) {
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			j.closeFiles()
			return fmt.Errorf("store: usage journal %s: %w (it must be readable and writable by switchyard's user, like the store file)", p, err)
		}
		j.files[i] = f
		bad := 0
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			var r journalRecord
			if json.Unmarshal(sc.Bytes(), &r) != nil {
				bad++ // a line cut by a power failure
				continue
			}
			j.seq = max(j.seq, r.Seq)
			if r.Seq <= j.folded {
				continue
			}
			k := UsageKey{Hour: time.Unix(r.Hour, 0).UTC(), Tenant: r.Tenant, Model: r.Model}
			c := replay[k]
			c.add(UsageCounts{Requests: r.Requests, Errors: r.Errors, PromptTokens: r.Prompt, CachedTokens: r.Cached, CompletionTokens: r.Completion})
			replay[k] = c
		}
		if err := sc.Err(); err != nil {
			j.closeFiles()
			return fmt.Errorf("store: reading usage journal %s: %w", p, err)
		}
		if bad > 0 {
			s.log.Warn("store: usage journal lines skipped (cut short)", "file", p, "lines", bad)
		}
	}
	if len(replay) > 0 {
		var skipped []error
		if err := s.db.Update(func(tx *bolt.Tx) (err error) { skipped, err = putUsage(tx, replay, j.seq); return err }); err != nil {
			j.closeFiles()
			return fmt.Errorf("store %s: committing the usage journal: %w", s.path, err)
		}
		for _, e := range skipped {
			s.log.Warn("store record not saved", "path", s.path, "err", e)
		}
		s.log.Info("store: usage journaled before the last stop recovered", "buckets", len(replay))
	}
	j.folded = j.seq
	for _, f := range j.files {
		if err := f.Truncate(0); err != nil {
			j.closeFiles()
			return fmt.Errorf("store: usage journal %s: %w", f.Name(), err)
		}
	}
	s.journal = j
	return nil
}

func (j *journal) closeFiles() {
	for _, f := range j.files {
		if f != nil {
			_ = f.Close()
		}
	}
}

// AddUsage counts one request's usage (c) in the bucket of hour t, tenant
// and model. When it returns the record is in the journal: a crash of the
// process (SIGKILL) loses nothing, a crash of the machine at most what was
// added since the writer's last commit (Options.FlushInterval). A journal
// write error is returned (and logged once); the usage is still counted
// and committed with the next flush.
func (s *File) AddUsage(t time.Time, tenant, model string, c UsageCounts) error {
	j := s.journal
	k := UsageKey{Hour: UsageHour(t), Tenant: tenant, Model: model}
	j.mu.Lock()
	if j.closed {
		j.mu.Unlock()
		return ErrClosed
	}
	j.seq++
	line, _ := json.Marshal(journalRecord{Seq: j.seq, Hour: k.Hour.Unix(), Tenant: tenant, Model: model,
		Requests: c.Requests, Errors: c.Errors, Prompt: c.PromptTokens, Cached: c.CachedTokens, Completion: c.CompletionTokens})
	line = append(line, '\n')
	_, err := j.files[j.active].Write(line)
	j.fileMax[j.active] = j.seq
	sum := j.pending[k]
	sum.add(c)
	j.pending[k] = sum
	logIt := err != nil && j.werr == nil
	if err != nil {
		j.werr = err
	}
	j.mu.Unlock()
	if logIt {
		s.log.Error("store: usage journal write failed; usage stays in memory until the next commit", "err", err)
	}
	select {
	case s.dirty <- struct{}{}:
	default:
	}
	if err != nil {
		return fmt.Errorf("store: usage journal: %w", err)
	}
	return nil
}

// take starts a commit: it hands out the pending usage and the last
// sequence number in it, and moves new records to the other journal file
// when that one holds only committed records.
func (j *journal) take() (map[UsageKey]UsageCounts, uint64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.pending) == 0 {
		return nil, 0
	}
	batch, upto := j.pending, j.seq
	j.pending, j.folding, j.foldingUpto = map[UsageKey]UsageCounts{}, batch, upto
	other := 1 - j.active
	if j.fileMax[other] <= j.folded {
		if err := j.files[other].Truncate(0); err == nil {
			j.active = other
		}
	}
	return batch, upto
}

// done ends a commit: on success the batch's records are folded; on
// failure the batch goes back to pending.
func (j *journal) done(batch map[UsageKey]UsageCounts, upto uint64, err error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.folding = nil
	if err == nil {
		j.folded = upto
		return
	}
	for k, c := range batch {
		sum := j.pending[k]
		sum.add(c)
		j.pending[k] = sum
	}
}

// close closes the journal files (after the final commit).
func (j *journal) close() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.closed = true
	j.closeFiles()
}

// usageKey encodes a bucket key: 8-byte big-endian hour (Unix seconds),
// then uvarint length and bytes of the tenant, then the model. Keys sort
// by hour first, so a range of hours is one cursor walk.
func usageKey(k UsageKey) []byte {
	b := binary.BigEndian.AppendUint64(make([]byte, 0, 8+2+len(k.Tenant)+len(k.Model)), uint64(k.Hour.Unix()))
	b = binary.AppendUvarint(b, uint64(len(k.Tenant)))
	b = append(b, k.Tenant...)
	return append(b, k.Model...)
}

func parseUsageKey(b []byte) (UsageKey, error) {
	if len(b) < 9 {
		return UsageKey{}, errors.New("usage key too short")
	}
	k := UsageKey{Hour: time.Unix(int64(binary.BigEndian.Uint64(b)), 0).UTC()}
	n, w := binary.Uvarint(b[8:])
	if w <= 0 || uint64(len(b)-8-w) < n {
		return UsageKey{}, errors.New("bad usage key")
	}
	rest := b[8+w:]
	k.Tenant, k.Model = string(rest[:n]), string(rest[n:])
	return k, nil
}

// putUsage adds batch to the usage buckets and records upto as folded. A
// stored bucket that does not decode is replaced (and reported in
// skipped) rather than blocking every later commit.
func putUsage(tx *bolt.Tx, batch map[UsageKey]UsageCounts, upto uint64) (skipped []error, err error) {
	ub := tx.Bucket(bucketUsage)
	keys := slices.Collect(maps.Keys(batch))
	slices.SortFunc(keys, func(a, b UsageKey) int { return bytes.Compare(usageKey(a), usageKey(b)) })
	for _, k := range keys {
		kb := usageKey(k)
		sum := batch[k]
		if old := ub.Get(kb); old != nil {
			c, err := decodeUsage(old)
			if err != nil {
				skipped = append(skipped, fmt.Errorf("usage bucket %s/%s/%s replaced: %w", k.Hour.Format(time.RFC3339), k.Tenant, k.Model, err))
			}
			sum.add(c)
		}
		data, err := encodeRecord("usage", usageRecord{V: recordVersion, Requests: sum.Requests, Errors: sum.Errors,
			Prompt: sum.PromptTokens, Cached: sum.CachedTokens, Completion: sum.CompletionTokens})
		if err != nil {
			skipped = append(skipped, err)
			continue
		}
		if err := ub.Put(kb, data); err != nil {
			return skipped, err
		}
	}
	return skipped, tx.Bucket(bucketMeta).Put(keyUsageFolded, u64(upto))
}

func decodeUsage(b []byte) (UsageCounts, error) {
	var r usageRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return UsageCounts{}, err
	}
	if r.V != recordVersion {
		return UsageCounts{}, fmt.Errorf("usage record version %d, want %d", r.V, recordVersion)
	}
	return UsageCounts{Requests: r.Requests, Errors: r.Errors, PromptTokens: r.Prompt, CachedTokens: r.Cached, CompletionTokens: r.Completion}, nil
}

// Usage returns the usage buckets whose hour starts in [from, to) (from
// rounded down to its hour), committed or not, sorted by hour, tenant and
// model.
func (s *File) Usage(from, to time.Time) ([]UsageRow, error) {
	from = UsageHour(from)
	// What is not committed yet, taken before reading what is: a commit
	// finishing meanwhile is recognised by its sequence number in the
	// same read, so nothing is missed or counted twice.
	j := s.journal
	j.mu.Lock()
	folding, foldingUpto := maps.Clone(j.folding), j.foldingUpto
	pending, pendingUpto := maps.Clone(j.pending), j.seq
	j.mu.Unlock()
	var dbFolded uint64
	sums := map[UsageKey]UsageCounts{}
	err := s.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(keyUsageFolded); v != nil {
			dbFolded, _ = parseU64("usage sequence", v)
		}
		c := tx.Bucket(bucketUsage).Cursor()
		for kb, v := c.Seek(binary.BigEndian.AppendUint64(nil, uint64(from.Unix()))); kb != nil; kb, v = c.Next() {
			k, err := parseUsageKey(kb)
			if err != nil {
				return err
			}
			if !k.Hour.Before(to) {
				break
			}
			uc, err := decodeUsage(v)
			if err != nil {
				continue // replaced at its next commit
			}
			sums[k] = uc
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, bolt.ErrDatabaseNotOpen) {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("store %s: usage: %w", s.path, err)
	}
	for _, m := range []struct {
		batch map[UsageKey]UsageCounts
		upto  uint64
	}{{folding, foldingUpto}, {pending, pendingUpto}} {
		if m.upto <= dbFolded {
			continue // committed by the time of the read
		}
		for k, c := range m.batch {
			if !k.Hour.Before(from) && k.Hour.Before(to) {
				sum := sums[k]
				sum.add(c)
				sums[k] = sum
			}
		}
	}
	rows := make([]UsageRow, 0, len(sums))
	for k, c := range sums {
		rows = append(rows, UsageRow{UsageKey: k, UsageCounts: c})
	}
	SortUsage(rows)
	return rows, nil
}
