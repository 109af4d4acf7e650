package storetest_test

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
	"github.com/switchyard/switchyard/store/storetest"
)

// impl opens a store and reopens it after Close with what it made durable.
type impl struct {
	name   string
	open   func(t *testing.T) store.Store
	reopen func(t *testing.T, closed store.Store, last *store.Snapshot) store.Store
}

func impls() []impl {
	return []impl{{
		name: "File",
		open: func(t *testing.T) store.Store {
			path := filepath.Join(t.TempDir(), "state.db")
			return openFile(t, path)
		},
		reopen: func(t *testing.T, closed store.Store, _ *store.Snapshot) store.Store {
			return openFile(t, closed.(*store.File).Path())
		},
	}, {
		name: "Fake",
		open: func(*testing.T) store.Store { return storetest.New() },
		reopen: func(_ *testing.T, _ store.Store, last *store.Snapshot) store.Store {
			return storetest.NewFrom(last)
		},
	}}
}

func openFile(t *testing.T, path string) store.Store {
	t.Helper()
	f, err := store.Open(path, store.Options{
		FlushInterval: time.Hour, // flushes only when asked, like the fake
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func load(t *testing.T, s store.Store) *store.Snapshot {
	t.Helper()
	sn, err := s.Load()
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return sn
}

func flush(t *testing.T, s store.Store) {
	t.Helper()
	if err := s.Flush(t.Context()); err != nil {
		t.Fatalf("Flush: %v", err)
	}
}

func testState(version uint64) *registry.State {
	st := registry.Empty()
	st.Version = version
	st.Pools["p"] = &registry.Pool{Name: "p", Engine: registry.EngineVLLM,
		Endpoints: []registry.Endpoint{{Address: "127.0.0.1:8000", Source: "file"}}}
	st.Models["m"] = &registry.Model{Name: "m", Pool: "p"}
	return st
}

// TestFakeBehavesLikeFile runs the same scenario against the bbolt store
// and the fake, so tests written against the fake hold for the real one.
func TestFakeBehavesLikeFile(t *testing.T) {
	for _, im := range impls() {
		t.Run(im.name, func(t *testing.T) {
			s := im.open(t)
			if sn := load(t, s); sn.State() != nil || sn.StateVersion != 0 || len(sn.Prefix) != 0 {
				t.Fatalf("new store is not empty: %+v", sn)
			}

			// Saves are not durable until flushed.
			ep := store.EndpointKey{Pool: "p", Address: "127.0.0.1:8000"}
			s.SaveState(testState(3))
			s.SaveConsulIndex("svc", 5)
			if err := s.SavePrefix(ep.Pool, ep.Address, []byte("blob")); err != nil {
				t.Fatal(err)
			}
			if sn := load(t, s); sn.State() != nil || len(sn.ConsulIndexes) != 0 {
				t.Errorf("unflushed saves are visible to Load")
			}
			flush(t, s)
			sn := load(t, s)
			if st := sn.State(); st == nil || st.Version != 3 || sn.StateVersion != 3 || st.Pools["p"].Endpoints[0].Address != ep.Address {
				t.Errorf("state after flush = %+v", st)
			}
			if sn.ConsulIndexes["svc"] != 5 || !bytes.Equal(sn.Prefix[ep], []byte("blob")) {
				t.Errorf("indexes %v, prefix %q after flush", sn.ConsulIndexes, sn.Prefix[ep])
			}

			// Replacements, deletions, expiry, limits.
			now := time.Now().UTC()
			s.SaveMetrics(map[store.EndpointKey]store.Metrics{ep: {Waiting: 2, KVUsage: 0.5, ScrapedAt: now}})
			s.SaveHealth(map[store.EndpointKey]store.Health{ep: {Healthy: false, Reason: "down", Since: now}})
			s.SaveSessions([]store.Session{
				{ID: "live", Pool: "p", Endpoint: ep.Address, Expires: now.Add(time.Hour)},
				{ID: "gone", Pool: "p", Endpoint: ep.Address, Expires: now.Add(-time.Hour)},
			})
			s.SaveConsulIndex("svc", 0)
			if err := s.SavePrefix(ep.Pool, ep.Address, make([]byte, store.DefaultMaxPrefixBlob+1)); !errors.Is(err, store.ErrTooLarge) {
				t.Errorf("oversized prefix blob: %v, want ErrTooLarge", err)
			}
			flush(t, s)
			sn = load(t, s)
			if m := sn.Metrics[ep]; m.Waiting != 2 || m.KVUsage != 0.5 || !m.ScrapedAt.Equal(now) {
				t.Errorf("metrics = %+v", sn.Metrics)
			}
			if h := sn.Health[ep]; h.Healthy || h.Reason != "down" || len(sn.Health) != 1 {
				t.Errorf("health = %+v", sn.Health)
			}
			if len(sn.Sessions) != 1 || sn.Sessions[0].ID != "live" {
				t.Errorf("sessions = %+v, want only the live one", sn.Sessions)
			}
			if _, ok := sn.ConsulIndexes["svc"]; ok {
				t.Errorf("index 0 did not delete: %v", sn.ConsulIndexes)
			}
			if !bytes.Equal(sn.Prefix[ep], []byte("blob")) {
				t.Errorf("a rejected blob replaced the previous one: %q", sn.Prefix[ep])
			}
			if err := s.SavePrefix(ep.Pool, ep.Address, nil); err != nil {
				t.Fatal(err)
			}

			// Close flushes; afterwards everything says ErrClosed.
			final := load(t, s)
			if err := s.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if _, err := s.Load(); !errors.Is(err, store.ErrClosed) {
				t.Errorf("Load after Close: %v", err)
			}
			if err := s.Flush(t.Context()); !errors.Is(err, store.ErrClosed) {
				t.Errorf("Flush after Close: %v", err)
			}
			if err := s.SavePrefix("p", "x:1", []byte("b")); !errors.Is(err, store.ErrClosed) {
				t.Errorf("SavePrefix after Close: %v", err)
			}

			// A restart finds what Close made durable.
			final.Prefix = map[store.EndpointKey][]byte{} // deleted just before Close
			r := im.reopen(t, s, final)
			sn = load(t, r)
			if sn.StateVersion != 3 || len(sn.Prefix) != 0 || len(sn.Sessions) != 1 {
				t.Errorf("after reopen: state %d, prefix %v, sessions %v", sn.StateVersion, sn.Prefix, sn.Sessions)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestFakeInjectedFailures(t *testing.T) {
	f := storetest.New()
	boom := errors.New("disk full")
	f.FailFlushes(boom)
	f.SaveState(testState(1))
	if err := f.Flush(t.Context()); !errors.Is(err, boom) || !errors.Is(f.LastError(), boom) {
		t.Fatalf("Flush = %v, LastError = %v; want %v", err, f.LastError(), boom)
	}
	f.FailFlushes(nil)
	if err := f.Flush(t.Context()); err != nil || f.LastError() != nil {
		t.Fatalf("Flush after recovery = %v, LastError = %v", err, f.LastError())
	}
	if sn, _ := f.Load(); sn.StateVersion != 1 || f.Flushes() != 1 {
		t.Errorf("the failed flush's save was lost: state %d, flushes %d", sn.StateVersion, f.Flushes())
	}
}
