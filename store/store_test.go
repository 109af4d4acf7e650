package store

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

func TestStateRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s := openT(t, path, testOpts())
	if snap := loadT(t, s); snap.State() != nil || snap.StateVersion != 0 {
		t.Fatalf("fresh store has state %v (version %d)", snap.State(), snap.StateVersion)
	}
	want := makeState(4, 9, 42)
	s.SaveState(want)
	closeT(t, s)

	s = openT(t, path, testOpts())
	snap := loadT(t, s)
	if snap.StateVersion != 42 {
		t.Errorf("StateVersion = %d, want 42", snap.StateVersion)
	}
	got := snap.State()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("state round trip differs:\n got %+v\nwant %+v", got, want)
	}
	if err := registry.Validate(got, nil); err != nil {
		t.Errorf("loaded state does not validate: %v", err)
	}
	// State returns a copy each time: changing one must not change the next.
	got.Pools["pool-00"].Endpoints[0].Address = "changed"
	if snap.State().Pools["pool-00"].Endpoints[0].Address == "changed" {
		t.Error("Snapshot.State shares memory between calls")
	}
}

func TestEmptyStateRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s := openT(t, path, testOpts())
	want := registry.Empty()
	want.Version = 3
	s.SaveState(want)
	flushT(t, s)
	if got := loadT(t, s).State(); !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
}

func TestRecordsRoundTrip(t *testing.T) {
	now := time.Date(2026, 11, 22, 3, 0, 0, 0, time.UTC)
	clock := now
	o := testOpts()
	o.Now = func() time.Time { return clock }
	path := filepath.Join(t.TempDir(), "state.db")
	s := openT(t, path, o)

	a := EndpointKey{Pool: "chat", Address: "10.0.0.1:8000"}
	b := EndpointKey{Pool: "chat", Address: "[fd00::2]:8000"}
	metrics := map[EndpointKey]Metrics{
		a: {Waiting: 3, Running: 7, KVUsage: 0.25, ScrapedAt: now.Add(-time.Second)},
		b: {Waiting: 0, Running: 1, KVUsage: 0.9, ScrapedAt: now},
	}
	health := map[EndpointKey]Health{
		a: {Healthy: true, Since: now.Add(-time.Hour)},
		b: {Healthy: false, Draining: true, Reason: "scrape: connection refused", Since: now},
	}
	sessions := []Session{
		{ID: "s1", Pool: "chat", Endpoint: a.Address, Expires: now.Add(time.Minute)},
		{ID: "s2", Pool: "chat", Endpoint: b.Address, Expires: now.Add(time.Hour)},
	}
	s.SaveMetrics(metrics)
	s.SaveHealth(health)
	s.SaveSessions(sessions)
	for k, blob := range map[EndpointKey][]byte{a: {1, 2, 3}, b: []byte("prefix-index\x00bytes")} {
		if err := s.SavePrefix(k.Pool, k.Address, blob); err != nil {
			t.Fatal(err)
		}
	}
	s.SaveConsulIndex("service:vllm|tag:chat|dc:dc1", 1234)
	s.SaveConsulIndex("service:other", 99)
	closeT(t, s)

	s = openT(t, path, o)
	snap := loadT(t, s)
	if !reflect.DeepEqual(snap.Metrics, metrics) {
		t.Errorf("metrics: got %+v, want %+v", snap.Metrics, metrics)
	}
	if !reflect.DeepEqual(snap.Health, health) {
		t.Errorf("health: got %+v, want %+v", snap.Health, health)
	}
	if !reflect.DeepEqual(snap.Sessions, sessions) {
		t.Errorf("sessions: got %+v, want %+v", snap.Sessions, sessions)
	}
	wantPrefix := map[EndpointKey][]byte{a: {1, 2, 3}, b: []byte("prefix-index\x00bytes")}
	if !reflect.DeepEqual(snap.Prefix, wantPrefix) {
		t.Errorf("prefix: got %q, want %q", snap.Prefix, wantPrefix)
	}
	wantIdx := map[string]uint64{"service:vllm|tag:chat|dc:dc1": 1234, "service:other": 99}
	if !reflect.DeepEqual(snap.ConsulIndexes, wantIdx) {
		t.Errorf("consul indexes: got %v, want %v", snap.ConsulIndexes, wantIdx)
	}
	if !snap.CreatedAt.Equal(now) || !snap.FlushedAt.Equal(now) {
		t.Errorf("CreatedAt %v FlushedAt %v, want both %v", snap.CreatedAt, snap.FlushedAt, now)
	}

	// Expired sessions are dropped on load.
	clock = now.Add(2 * time.Minute)
	if got := loadT(t, s).Sessions; len(got) != 1 || got[0].ID != "s2" {
		t.Errorf("after s1 expired, sessions = %+v, want only s2", got)
	}

	// Deletions: an empty blob and a zero index delete; replacing maps
	// drops endpoints no longer present.
	if err := s.SavePrefix(a.Pool, a.Address, nil); err != nil {
		t.Fatal(err)
	}
	s.SaveConsulIndex("service:other", 0)
	s.SaveMetrics(map[EndpointKey]Metrics{b: metrics[b]})
	s.SaveHealth(nil)
	flushT(t, s)
	snap = loadT(t, s)
	if _, ok := snap.Prefix[a]; ok || len(snap.Prefix) != 1 {
		t.Errorf("prefix after delete = %q", snap.Prefix)
	}
	if _, ok := snap.ConsulIndexes["service:other"]; ok {
		t.Errorf("consul index not deleted: %v", snap.ConsulIndexes)
	}
	if len(snap.Metrics) != 1 || len(snap.Health) != 0 {
		t.Errorf("metrics %v health %v after replace", snap.Metrics, snap.Health)
	}
}

func TestSavesAreBatchedLatestWins(t *testing.T) {
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), testOpts())
	for v := uint64(1); v <= 200; v++ {
		s.SaveState(makeState(2, 3, v))
		s.SaveMetrics(map[EndpointKey]Metrics{{Pool: "p", Address: "1.2.3.4:1"}: {Waiting: int(v)}})
		if err := s.SavePrefix("p", "1.2.3.4:1", []byte{byte(v)}); err != nil {
			t.Fatal(err)
		}
		s.SaveConsulIndex("svc", v)
	}
	if n := s.flushes.Load(); n != 0 {
		t.Fatalf("%d flushes before Flush with a one-hour interval", n)
	}
	flushT(t, s)
	if n := s.flushes.Load(); n != 1 {
		t.Errorf("200 rounds of saves took %d flushes, want 1", n)
	}
	snap := loadT(t, s)
	if snap.StateVersion != 200 || snap.Metrics[EndpointKey{"p", "1.2.3.4:1"}].Waiting != 200 ||
		snap.Prefix[EndpointKey{"p", "1.2.3.4:1"}][0] != 200 || snap.ConsulIndexes["svc"] != 200 {
		t.Errorf("latest values did not win: state %d metrics %v prefix %v consul %v",
			snap.StateVersion, snap.Metrics, snap.Prefix, snap.ConsulIndexes)
	}
	// Nothing pending: another Flush commits nothing.
	flushT(t, s)
	if n := s.flushes.Load(); n != 1 {
		t.Errorf("empty Flush committed a batch (%d flushes)", n)
	}
}

func TestBackgroundWriterFlushes(t *testing.T) {
	o := testOpts()
	o.FlushInterval = 10 * time.Millisecond
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), o)
	s.SaveState(makeState(1, 1, 7))
	testutil.Eventually(t, 5*time.Second, "background flush", func() error {
		snap, err := s.Load()
		if err != nil {
			return err
		}
		if snap.StateVersion != 7 {
			return errors.New("state not flushed yet")
		}
		return nil
	})
}

func TestCloseFlushes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s := openT(t, path, testOpts())
	s.SaveState(makeState(1, 2, 5))
	s.SaveSessions([]Session{{ID: "x", Endpoint: "1.1.1.1:1", Expires: time.Now().Add(time.Hour)}})
	closeT(t, s)
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	s.SaveState(makeState(1, 2, 6)) // ignored after Close
	if _, err := s.Load(); !errors.Is(err, ErrClosed) {
		t.Errorf("Load after Close: %v, want ErrClosed", err)
	}
	if err := s.Flush(t.Context()); !errors.Is(err, ErrClosed) {
		t.Errorf("Flush after Close: %v, want ErrClosed", err)
	}

	s = openT(t, path, testOpts())
	snap := loadT(t, s)
	if snap.StateVersion != 5 || len(snap.Sessions) != 1 {
		t.Errorf("after Close and reopen: state version %d, sessions %v; want 5 and one session", snap.StateVersion, snap.Sessions)
	}
}

func TestSecondOpenFailsFastWhileLocked(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	first := openT(t, path, testOpts())
	first.SaveState(makeState(1, 1, 1))
	flushT(t, first)
	before := fileHash(t, path)

	o := testOpts()
	o.LockTimeout = 50 * time.Millisecond
	_, err := Open(path, o)
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Open: %v, want ErrLocked", err)
	}
	if !strings.Contains(err.Error(), "store "+path+" is locked by another process") {
		t.Errorf("error %q does not say the store is locked", err)
	}
	if fileHash(t, path) != before || len(corruptFiles(t, path)) != 0 {
		t.Error("a failed second Open changed or moved the file")
	}
	closeT(t, first)
	second := openT(t, path, o)
	if v := loadT(t, second).StateVersion; v != 1 {
		t.Errorf("after the first closed: state version %d, want 1", v)
	}
}

func TestFileMode0600(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "new.db")
	openT(t, path, testOpts())
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("new store mode = %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	// An existing store with looser permissions is tightened.
	loose := filepath.Join(dir, "loose.db")
	s := openT(t, loose, testOpts())
	closeT(t, s)
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	openT(t, loose, testOpts())
	if fi, err := os.Stat(loose); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("reopened store mode = %v (%v), want 0600", fi.Mode().Perm(), err)
	}
}

func TestPrefixBlobsAreBounded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	o := testOpts()
	o.MaxPrefixBlob = 100
	o.MaxPrefixTotal = 250
	s := openT(t, path, o)
	blob := func(n int) []byte { return make([]byte, n) }

	if err := s.SavePrefix("p", "a:1", blob(101)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("101-byte blob with a 100-byte cap: %v, want ErrTooLarge", err)
	}
	for _, ep := range []string{"a:1", "b:1"} {
		if err := s.SavePrefix("p", ep, blob(100)); err != nil {
			t.Fatalf("SavePrefix %s: %v", ep, err)
		}
	}
	if err := s.SavePrefix("p", "c:1", blob(100)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("third 100-byte blob with a 250-byte total: %v, want ErrTooLarge", err)
	}
	if err := s.SavePrefix("p", "a:1", blob(50)); err != nil {
		t.Errorf("shrinking an existing blob: %v", err)
	}
	if err := s.SavePrefix("p", "c:1", blob(100)); err != nil {
		t.Errorf("blob that fits after shrinking: %v", err)
	}
	if err := s.SavePrefix("", "c:1", blob(1)); err == nil {
		t.Error("empty pool name accepted")
	}
	closeT(t, s)

	// The budget is rebuilt from disk on open.
	s = openT(t, path, o)
	if got := len(loadT(t, s).Prefix); got != 3 {
		t.Fatalf("%d blobs persisted, want 3", got)
	}
	if err := s.SavePrefix("p", "d:1", blob(1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("blob past the reloaded budget: %v, want ErrTooLarge", err)
	}
	if err := s.SavePrefix("p", "b:1", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.SavePrefix("p", "d:1", blob(100)); err != nil {
		t.Errorf("blob after a delete freed the budget: %v", err)
	}
}

func TestSessionsAreBounded(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	o := testOpts()
	o.MaxSessions = 3
	o.Now = func() time.Time { return now }
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), o)
	in := []Session{
		{ID: "expired", Endpoint: "e:1", Expires: now.Add(-time.Second)},
		{ID: "s1", Endpoint: "e:1", Expires: now.Add(1 * time.Minute)},
		{ID: "s2", Endpoint: "e:2", Expires: now.Add(2 * time.Minute)},
		{ID: "s3", Endpoint: "e:3", Expires: now.Add(3 * time.Minute)},
		{ID: "s4", Endpoint: "e:4", Expires: now.Add(4 * time.Minute)},
		{ID: "s2", Endpoint: "e:9", Expires: now.Add(5 * time.Minute)}, // same id, later expiry wins
		{ID: "", Endpoint: "e:1", Expires: now.Add(time.Hour)},
		{ID: "no-endpoint", Expires: now.Add(time.Hour)},
		{ID: strings.Repeat("x", MaxKeyLen+1), Endpoint: "e:1", Expires: now.Add(time.Hour)},
	}
	s.SaveSessions(in)
	flushT(t, s)
	got := loadT(t, s).Sessions
	want := []Session{
		{ID: "s2", Endpoint: "e:9", Expires: now.Add(5 * time.Minute)},
		{ID: "s3", Endpoint: "e:3", Expires: now.Add(3 * time.Minute)},
		{ID: "s4", Endpoint: "e:4", Expires: now.Add(4 * time.Minute)},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("sessions = %+v\nwant %+v", got, want)
	}
}

func TestConcurrentUse(t *testing.T) {
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), Options{FlushInterval: time.Millisecond, Logger: testOpts().Logger})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				s.SaveState(makeState(1, 2, uint64(g*100+i)))
				s.SaveMetrics(map[EndpointKey]Metrics{{Pool: "p", Address: "a:1"}: {Running: i}})
				_ = s.SavePrefix("p", "a:1", []byte{byte(i)})
				if i%10 == 0 {
					if err := s.Flush(t.Context()); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	wg.Wait()
	if snap := loadT(t, s); snap.State() == nil {
		t.Error("no state after concurrent saves and flushes")
	}
}

func TestUnencodableRecordsDoNotBlockFlushes(t *testing.T) {
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), testOpts())
	bad := makeState(1, 1, 4)
	bad.Pools["pool-00"].Scheduling.KVThreshold = math.NaN() // JSON cannot encode NaN
	s.SaveState(bad)
	s.SaveMetrics(map[EndpointKey]Metrics{
		{Pool: "p", Address: "nan:1"}: {KVUsage: math.NaN()},
		{Pool: "p", Address: "ok:1"}:  {KVUsage: 0.5},
	})
	s.SaveConsulIndex("svc", 9)
	flushT(t, s)
	snap := loadT(t, s)
	if snap.State() != nil {
		t.Error("an unencodable state was persisted")
	}
	if snap.ConsulIndexes["svc"] != 9 {
		t.Error("the rest of the batch was not persisted")
	}
	if _, ok := snap.Metrics[EndpointKey{"p", "nan:1"}]; ok || len(snap.Metrics) != 1 {
		t.Errorf("metrics = %v, want only ok:1", snap.Metrics)
	}
	if err := s.LastError(); err != nil {
		t.Errorf("LastError = %v", err)
	}
}

func TestFailedFlushKeepsTheBatch(t *testing.T) {
	s := openT(t, filepath.Join(t.TempDir(), "state.db"), testOpts())
	s.SaveConsulIndex("a", 1)
	if err := s.db.Close(); err != nil { // make every commit fail
		t.Fatal(err)
	}
	s.SaveState(makeState(1, 1, 3))
	if err := s.Flush(t.Context()); err == nil {
		t.Fatal("Flush on a closed database succeeded")
	}
	if s.LastError() == nil {
		t.Error("LastError is nil after a failed flush")
	}
	s.SaveConsulIndex("b", 2) // saved after the failure: merged on top
	s.mu.Lock()
	p := s.pend
	s.mu.Unlock()
	if p.state == nil || p.state.Version != 3 || p.consul["a"] != 1 || p.consul["b"] != 2 {
		t.Errorf("pending after a failed flush = %+v, want the failed batch plus the newer save", p)
	}
	if err := s.Close(); err == nil || !strings.Contains(err.Error(), "final flush") {
		t.Errorf("Close = %v, want a final flush error", err)
	}
}
