package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// writeStore creates a real store at path holding a 1,000-endpoint state.
func writeStore(t *testing.T, path string) {
	t.Helper()
	s, err := Open(path, testOpts())
	if err != nil {
		t.Fatal(err)
	}
	s.SaveState(makeState(20, 50, 9))
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// boltUpdate edits a bbolt file directly, bypassing the store.
func boltUpdate(t *testing.T, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(fn); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestUnusableFilesAreMovedAside(t *testing.T) {
	cases := []struct {
		desc   string
		make   func(t *testing.T, path string)
		reason string // substring of Recovery.Reason
	}{{
		desc: "text file",
		make: func(t *testing.T, path string) {
			os.WriteFile(path, []byte("listen_addr = \"127.0.0.1:9002\"\n"), 0o600)
		},
		reason: "not a bbolt database",
	}, {
		desc: "random garbage",
		make: func(t *testing.T, path string) {
			b := make([]byte, 64<<10)
			r := rand.New(rand.NewPCG(1, 2))
			for i := range b {
				b[i] = byte(r.Uint32())
			}
			os.WriteFile(path, b, 0o600)
		},
		reason: "not a bbolt database",
	}, {
		desc: "bbolt file of another application",
		make: func(t *testing.T, path string) {
			boltUpdate(t, path, func(tx *bolt.Tx) error {
				b, err := tx.CreateBucket([]byte("users"))
				if err != nil {
					return err
				}
				return b.Put([]byte("alice"), []byte("admin"))
			})
		},
		reason: `foreign bbolt database: no switchyard metadata (buckets ["users"])`,
	}, {
		desc: "bbolt file with another application id",
		make: func(t *testing.T, path string) {
			boltUpdate(t, path, func(tx *bolt.Tx) error {
				b, err := tx.CreateBucket([]byte("meta"))
				if err != nil {
					return err
				}
				return b.Put([]byte("app"), []byte("someone-else"))
			})
		},
		reason: `application id "someone-else"`,
	}, {
		desc: "store truncated to half",
		make: func(t *testing.T, path string) {
			writeStore(t, path)
			fi, _ := os.Stat(path)
			os.Truncate(path, fi.Size()/2)
		},
		reason: "", // whichever read of a missing page fails first
	}, {
		desc: "store truncated inside its first page",
		make: func(t *testing.T, path string) {
			writeStore(t, path)
			os.Truncate(path, 100)
		},
		reason: "not a bbolt database",
	}, {
		desc: "store with both meta pages zeroed",
		make: func(t *testing.T, path string) {
			writeStore(t, path)
			f, _ := os.OpenFile(path, os.O_WRONLY, 0)
			f.WriteAt(make([]byte, 2*os.Getpagesize()), 0)
			f.Close()
		},
		reason: "not a bbolt database",
	}, {
		desc: "store with an undecodable state record",
		make: func(t *testing.T, path string) {
			writeStore(t, path)
			boltUpdate(t, path, func(tx *bolt.Tx) error {
				return tx.Bucket(bucketState).Put(keyState, []byte(`{"v":1,"pools":[{`))
			})
		},
		reason: `state "current"`,
	}, {
		desc: "store with a record from an unknown record version",
		make: func(t *testing.T, path string) {
			writeStore(t, path)
			boltUpdate(t, path, func(tx *bolt.Tx) error {
				return tx.Bucket(bucketMetrics).Put([]byte("p\x00a:1"), []byte(`{"v":7}`))
			})
		},
		reason: "record version 7",
	}}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.db")
			tc.make(t, path)
			orig, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			s := openT(t, path, testOpts())
			rec := s.Recovery()
			if rec == nil {
				t.Fatal("Open did not report a recovery")
			}
			t.Logf("reason: %v", rec.Reason)
			if !strings.Contains(rec.Reason.Error(), tc.reason) {
				t.Errorf("reason %q does not contain %q", rec.Reason, tc.reason)
			}
			if !strings.HasPrefix(rec.MovedTo, path+".corrupt-") {
				t.Errorf("moved to %q, want %s.corrupt-<time>", rec.MovedTo, path)
			}
			moved, err := os.ReadFile(rec.MovedTo)
			if err != nil || !bytes.Equal(moved, orig) {
				t.Errorf("moved-aside file differs from the original (read err %v)", err)
			}
			// The fresh store is empty and works.
			snap := loadT(t, s)
			if snap.State() != nil || len(snap.Metrics) != 0 {
				t.Errorf("fresh store is not empty: %+v", snap)
			}
			s.SaveState(makeState(1, 1, 1))
			closeT(t, s)
			s = openT(t, path, testOpts())
			if s.Recovery() != nil || loadT(t, s).StateVersion != 1 {
				t.Errorf("fresh store did not reopen cleanly: recovery %+v", s.Recovery())
			}
		})
	}
}

func TestMoveAsideNeverOverwrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state.db")
	now := time.Date(2026, 11, 22, 4, 0, 0, 0, time.UTC)
	o := testOpts()
	o.Now = func() time.Time { return now }
	var moved []string
	for i := range 2 {
		if err := os.WriteFile(path, []byte("garbage "+string(rune('a'+i))), 0o600); err != nil {
			t.Fatal(err)
		}
		s, err := Open(path, o)
		if err != nil {
			t.Fatal(err)
		}
		moved = append(moved, s.Recovery().MovedTo)
		closeT(t, s)
	}
	if moved[0] == moved[1] {
		t.Fatalf("both recoveries moved to %s", moved[0])
	}
	for i, m := range moved {
		b, err := os.ReadFile(m)
		if err != nil || string(b) != "garbage "+string(rune('a'+i)) {
			t.Errorf("%s holds %q (%v)", m, b, err)
		}
	}
}

func TestEmptyFileIsANewStore(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s := openT(t, path, testOpts())
	if s.Recovery() != nil || len(corruptFiles(t, path)) != 0 {
		t.Errorf("empty file treated as corrupt: %+v", s.Recovery())
	}
	s.SaveState(makeState(1, 1, 2))
	flushT(t, s)
	if v := loadT(t, s).StateVersion; v != 2 {
		t.Errorf("state version %d, want 2", v)
	}
}

func TestNewerSchemaIsLeftUntouched(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	writeStore(t, path)
	boltUpdate(t, path, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put(keySchema, u64(SchemaVersion+1))
	})
	before := fileHash(t, path)
	_, err := Open(path, testOpts())
	if !errors.Is(err, ErrNewerSchema) {
		t.Fatalf("Open: %v, want ErrNewerSchema", err)
	}
	if !strings.Contains(err.Error(), "file has schema 2, this switchyard knows up to 1") {
		t.Errorf("error %q does not name both schema versions", err)
	}
	if fileHash(t, path) != before || len(corruptFiles(t, path)) != 0 {
		t.Error("file was modified or moved")
	}
	// The lock was released: the file can be opened again.
	if _, err := Open(path, testOpts()); !errors.Is(err, ErrNewerSchema) {
		t.Errorf("second Open: %v, want ErrNewerSchema again", err)
	}
}

// writeV0 writes a hand-made schema-0 file: the state lived as plain JSON
// under legacy/state, in a format without record versions.
func writeV0(t *testing.T, path string) {
	t.Helper()
	boltUpdate(t, path, func(tx *bolt.Tx) error {
		mb, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		if err := mb.Put(keyApp, []byte(appID)); err != nil {
			return err
		}
		if err := mb.Put(keySchema, u64(0)); err != nil {
			return err
		}
		lb, err := tx.CreateBucket([]byte("legacy"))
		if err != nil {
			return err
		}
		return lb.Put([]byte("state"), []byte(`{"version":17,"pools":{"chat":["10.0.0.1:8000","10.0.0.2:8000"]}}`))
	})
}

// migrateLegacy is the fake v0 -> v1 migration.
func migrateLegacy(tx *bolt.Tx) error {
	lb := tx.Bucket([]byte("legacy"))
	var old struct {
		Version uint64              `json:"version"`
		Pools   map[string][]string `json:"pools"`
	}
	if err := json.Unmarshal(lb.Get([]byte("state")), &old); err != nil {
		return err
	}
	rec := stateRecord{V: recordVersion, Version: old.Version}
	for name, addrs := range old.Pools {
		pr := poolRecord{Name: name, Engine: "vllm"}
		for _, a := range addrs {
			pr.Endpoints = append(pr.Endpoints, endpointRecord{Address: a, Source: "file"})
		}
		rec.Pools = append(rec.Pools, pr)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	sb, err := tx.CreateBucketIfNotExists(bucketState)
	if err != nil {
		return err
	}
	if err := sb.Put(keyState, data); err != nil {
		return err
	}
	return tx.DeleteBucket([]byte("legacy"))
}

func TestMigrationFromV0(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	writeV0(t, path)
	o := testOpts()
	o.schema = &schema{version: 1, migrations: []migration{{from: 0, name: "legacy state", run: migrateLegacy}}}
	s := openT(t, path, o)
	if s.Recovery() != nil {
		t.Fatalf("migratable file was moved aside: %v", s.Recovery().Reason)
	}
	st := loadT(t, s).State()
	if st == nil || st.Version != 17 || len(st.Pools["chat"].Endpoints) != 2 || st.Pools["chat"].Endpoints[1].Address != "10.0.0.2:8000" {
		t.Fatalf("migrated state = %+v", st)
	}
	closeT(t, s)
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = db.View(func(tx *bolt.Tx) error {
		if v, _ := parseU64("schema", tx.Bucket(bucketMeta).Get(keySchema)); v != 1 {
			t.Errorf("schema on disk = %d, want 1", v)
		}
		if tx.Bucket([]byte("legacy")) != nil {
			t.Error("legacy bucket survived the migration")
		}
		return nil
	})
}

func TestFailedMigrationLeavesFileUnchanged(t *testing.T) {
	cases := []struct {
		desc string
		sc   schema
		want string
	}{{
		desc: "second step fails",
		sc: schema{version: 2, migrations: []migration{
			{from: 0, name: "legacy state", run: migrateLegacy},
			{from: 1, name: "broken", run: func(*bolt.Tx) error { return errors.New("boom") }},
		}},
		want: "migration 1->2 (broken): boom",
	}, {
		desc: "missing step",
		sc:   schema{version: 2, migrations: []migration{{from: 0, name: "legacy state", run: migrateLegacy}}},
		want: "no migration from schema 1 to 2",
	}}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.db")
			writeV0(t, path)
			before := fileHash(t, path)
			o := testOpts()
			o.schema = &tc.sc
			_, err := Open(path, o)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "left unchanged") {
				t.Fatalf("Open: %v, want an error containing %q", err, tc.want)
			}
			if fileHash(t, path) != before || len(corruptFiles(t, path)) != 0 {
				t.Error("failed migration modified or moved the file")
			}
		})
	}
}

// TestDamagedPagesNeverCrash overwrites random data pages of a real store
// (the meta pages stay valid, so only bbolt's page walk can notice): Open
// must never crash, and either recover or return the intact state.
func TestDamagedPagesNeverCrash(t *testing.T) {
	want := makeState(20, 50, 9)
	recovered := 0
	for seed := range uint64(12) {
		path := filepath.Join(t.TempDir(), "state.db")
		writeStore(t, path)
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(seed, 7))
		ps := int64(os.Getpagesize())
		for range 3 {
			page := make([]byte, ps)
			for i := range page {
				page[i] = byte(r.Uint32())
			}
			if _, err := f.WriteAt(page, (2+r.Int64N(fi.Size()/ps-2))*ps); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
		s, err := Open(path, testOpts())
		if err != nil {
			t.Fatalf("seed %d: Open: %v", seed, err)
		}
		if s.Recovery() != nil {
			recovered++
		} else if got := loadT(t, s).State(); !reflect.DeepEqual(got, want) {
			t.Errorf("seed %d: damaged store opened without recovery but its state differs", seed)
		}
		closeT(t, s)
	}
	t.Logf("%d of 12 damaged stores were moved aside", recovered)
	if recovered == 0 {
		t.Error("no damaged store was detected")
	}
}

// writeFullStore creates a real store at path with every kind of record,
// and returns what Load read back from it.
func writeFullStore(t *testing.T, path string) *Snapshot {
	t.Helper()
	s := openT(t, path, testOpts())
	s.SaveState(makeState(20, 50, 9))
	metrics := map[EndpointKey]Metrics{}
	health := map[EndpointKey]Health{}
	var sessions []Session
	exp := time.Now().Add(time.Hour).UTC()
	for i := range 300 {
		k := EndpointKey{Pool: fmt.Sprintf("pool-%02d", i%20), Address: fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250)}
		metrics[k] = Metrics{Waiting: i, Running: i % 7, KVUsage: float64(i%100) / 100, ScrapedAt: exp}
		health[k] = Health{Healthy: i%5 != 0, Reason: "scrapes", Since: exp}
		sessions = append(sessions, Session{ID: fmt.Sprintf("s-%04d", i), Pool: k.Pool, Endpoint: k.Address, Expires: exp})
		if i%10 == 0 {
			if err := s.SavePrefix(k.Pool, k.Address, bytes.Repeat([]byte{byte(i)}, 900)); err != nil {
				t.Fatal(err)
			}
		}
	}
	s.SaveMetrics(metrics)
	s.SaveHealth(health)
	s.SaveSessions(sessions)
	s.SaveConsulIndex("service:vllm", 42)
	flushT(t, s)
	snap := loadT(t, s)
	closeT(t, s)
	return snap
}

// sameSnapshot reports whether two loads hold the same records (the
// flush time aside).
func sameSnapshot(a, b *Snapshot) bool {
	a2, b2 := *a, *b
	a2.FlushedAt, b2.FlushedAt = time.Time{}, time.Time{}
	a2.state, b2.state = nil, nil
	return reflect.DeepEqual(a2, b2) && reflect.DeepEqual(a.State(), b.State())
}

// TestTruncatedAnywhereNeverCrashes cuts a real store at every page
// boundary and at odd offsets: Open must never crash, and must either move
// the file aside or return every record. bbolt does not compare the file's
// length with its page count; a missing page fails bbolt's page checks or
// the record decoding instead (guard turns a fault into an error).
func TestTruncatedAnywhereNeverCrashes(t *testing.T) {
	src := filepath.Join(t.TempDir(), "src.db")
	want := writeFullStore(t, src)
	orig, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	ps := os.Getpagesize()
	var sizes []int
	for i, n := 0, ps; n < len(orig); i, n = i+1, n+ps {
		sizes = append(sizes, []int{n, n - 1, n + ps/2}[i%3])
	}
	recovered := 0
	for _, n := range sizes {
		path := filepath.Join(t.TempDir(), "state.db")
		if err := os.WriteFile(path, orig[:n], 0o600); err != nil {
			t.Fatal(err)
		}
		s, err := Open(path, testOpts())
		if err != nil {
			t.Fatalf("truncated to %d bytes: Open: %v", n, err)
		}
		if s.Recovery() != nil {
			recovered++
		} else if got := loadT(t, s); !sameSnapshot(got, want) {
			t.Errorf("truncated to %d of %d bytes: opened without recovery but records differ", n, len(orig))
		}
		closeT(t, s)
	}
	t.Logf("%d of %d truncated stores were moved aside", recovered, len(sizes))
	if recovered == 0 {
		t.Error("no truncated store was detected")
	}
}

func TestOpenErrorsSayWhatToDo(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		desc string
		path string
		is   error
		want []string
	}{{
		desc: "missing directory",
		path: filepath.Join(dir, "no", "such", "state.db"),
		is:   fs.ErrNotExist,
		want: []string{"directory " + filepath.Join(dir, "no", "such") + " does not exist", "create it"},
	}, {
		desc: "a directory",
		path: dir,
		is:   syscall.EISDIR,
		want: []string{"store " + dir + ": is a directory", "needs a file path, such as " + filepath.Join(dir, "switchyard.db")},
	}}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			_, err := Open(tc.path, testOpts())
			if err == nil {
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, tc.is) {
				t.Errorf("error %q is not %v", err, tc.is)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "open "+tc.path) {
				t.Errorf("error %q repeats the path", err)
			}
		})
	}
}

// TestPermissionErrorsSayWhatToDo uses made-up errors: root, which the
// tests may run as, is never denied.
func TestPermissionErrorsSayWhatToDo(t *testing.T) {
	dir := t.TempDir()
	existing := filepath.Join(dir, "state.db")
	if err := os.WriteFile(existing, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	denied := func(p string) error { return &fs.PathError{Op: "open", Path: p, Err: syscall.EACCES} }
	for _, tc := range []struct {
		path string
		want string
	}{
		{existing, "needs read and write access to the file; fix its owner or mode"},
		{filepath.Join(dir, "new.db"), "cannot create the file in " + dir + "; fix the directory's owner or mode"},
	} {
		err := describeOpenError(tc.path, denied(tc.path))
		if !errors.Is(err, fs.ErrPermission) || !strings.Contains(err.Error(), tc.want) ||
			!strings.HasPrefix(err.Error(), "store "+tc.path+": permission denied: ") {
			t.Errorf("%s: %q lacks %q", tc.path, err, tc.want)
		}
	}
	for _, e := range []syscall.Errno{syscall.EROFS, syscall.ENOSPC} {
		err := describeOpenError(existing, &fs.PathError{Op: "open", Path: existing, Err: e})
		if !errors.Is(err, e) || !strings.Contains(err.Error(), "; ") {
			t.Errorf("%v: %q has no hint", e, err)
		}
	}
}
