package persist

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
	"github.com/switchyard/switchyard/store/storetest"
)

// fakePicker exports what the test sets and records what it imports.
type fakePicker struct {
	mu       sync.Mutex
	export   picker.Warm
	exports  int
	imported []picker.Warm
	stats    picker.WarmStats
	err      error
}

func (p *fakePicker) ExportWarm(time.Time, picker.WarmLimits) picker.Warm {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.exports++
	return p.export
}

func (p *fakePicker) ImportWarm(w picker.Warm, _ time.Time) (picker.WarmStats, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.imported = append(p.imported, w)
	return p.stats, p.err
}

func (p *fakePicker) set(w picker.Warm) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.export = w
}

func (p *fakePicker) exportCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exports
}

// prefixLog records the SavePrefix calls that reach the store.
type prefixLog struct {
	store.Store
	mu    sync.Mutex
	calls []string // "pool/endpoint=data", "pool/endpoint deleted"
}

func (s *prefixLog) SavePrefix(pool, endpoint string, blob []byte) error {
	s.mu.Lock()
	if blob == nil {
		s.calls = append(s.calls, pool+"/"+endpoint+" deleted")
	} else {
		s.calls = append(s.calls, pool+"/"+endpoint+"="+string(blob))
	}
	s.mu.Unlock()
	return s.Store.SavePrefix(pool, endpoint, blob)
}

func (s *prefixLog) take() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.calls
	s.calls = nil
	slices.Sort(out)
	return out
}

func flush(t *testing.T, s store.Store) {
	t.Helper()
	if err := s.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
}

func blob(endpoint, data string) picker.PrefixBlob {
	return picker.PrefixBlob{Pool: "p", Endpoint: endpoint, Data: []byte(data)}
}

func key(endpoint string) store.EndpointKey { return store.EndpointKey{Pool: "p", Address: endpoint} }

// TestWarmWritesOnlyChangedPrefixBlobs: the picker's prefix blobs are
// large and change slowly; each save writes the blobs that changed and
// deletes those of endpoints that left, nothing else.
func TestWarmWritesOnlyChangedPrefixBlobs(t *testing.T) {
	t.Parallel()
	fake := storetest.New()
	st := &prefixLog{Store: fake}
	p := &fakePicker{}
	w := NewWarm(st, p, WarmOptions{})
	now := time.Now()

	steps := []struct {
		desc   string
		blobs  []picker.PrefixBlob
		writes []string
		stored map[string]string
	}{
		{"first save writes every blob", []picker.PrefixBlob{blob("e1", "a1"), blob("e2", "b1")},
			[]string{"p/e1=a1", "p/e2=b1"}, map[string]string{"e1": "a1", "e2": "b1"}},
		{"unchanged blobs are not written again", []picker.PrefixBlob{blob("e1", "a1"), blob("e2", "b1")},
			nil, map[string]string{"e1": "a1", "e2": "b1"}},
		{"a changed blob is written alone", []picker.PrefixBlob{blob("e1", "a1"), blob("e2", "b2")},
			[]string{"p/e2=b2"}, map[string]string{"e1": "a1", "e2": "b2"}},
		{"an endpoint without a blob is deleted", []picker.PrefixBlob{blob("e2", "b2")},
			[]string{"p/e1 deleted"}, map[string]string{"e2": "b2"}},
		{"a deleted endpoint's blob comes back", []picker.PrefixBlob{blob("e1", "a1"), blob("e2", "b2")},
			[]string{"p/e1=a1"}, map[string]string{"e1": "a1", "e2": "b2"}},
	}
	for _, s := range steps {
		p.set(picker.Warm{Prefix: s.blobs})
		w.save(now)
		if got := st.take(); !slices.Equal(got, s.writes) {
			t.Errorf("%s: store writes %q, want %q", s.desc, got, s.writes)
		}
		flush(t, fake)
		got := map[string]string{}
		for k, b := range load(t, fake).Prefix {
			got[k.Address] = string(b)
		}
		if fmt.Sprint(got) != fmt.Sprint(s.stored) {
			t.Errorf("%s: store holds %v, want %v", s.desc, got, s.stored)
		}
	}
}

// TestWarmRestore checks the translation from the store's types to the
// picker's, and that what the previous run left is rewritten or deleted
// by the first save: its blobs were hashed by another process.
func TestWarmRestore(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	prev := store.NewSnapshot()
	prev.Prefix[key("e1")] = []byte("a1")
	prev.Prefix[key("gone")] = []byte("g1")
	prev.Sessions = []store.Session{{ID: "s1", Pool: "p", Endpoint: "e1", Expires: t0.Add(time.Hour)}}
	prev.Health[key("e1")] = store.Health{Healthy: true, Since: t0}
	prev.Health[key("e2")] = store.Health{Healthy: false, Reason: failingReason, Since: t0}
	fake := storetest.NewFrom(prev)
	st := &prefixLog{Store: fake}
	p := &fakePicker{stats: picker.WarmStats{PrefixEndpoints: 1, PrefixBlocks: 3, Sessions: 1, Failing: 1}, err: errors.New("one blob did not decode")}
	w := NewWarm(st, p, WarmOptions{})

	if got := w.Restored(); got != (picker.WarmStats{}) {
		t.Errorf("Restored before Restore = %+v, want zero", got)
	}
	got := w.Restore(prev, t0)
	if got != p.stats || w.Restored() != p.stats {
		t.Errorf("Restore = %+v, Restored = %+v, want the picker's %+v (a partial import still counts)", got, w.Restored(), p.stats)
	}
	if len(p.imported) != 1 {
		t.Fatalf("%d imports, want 1", len(p.imported))
	}
	im := p.imported[0]
	slices.SortFunc(im.Prefix, func(a, b picker.PrefixBlob) int { return cmpStr(a.Endpoint, b.Endpoint) })
	slices.SortFunc(im.Endpoints, func(a, b picker.WarmEndpoint) int { return cmpStr(a.Endpoint, b.Endpoint) })
	wantPrefix := []picker.PrefixBlob{blob("e1", "a1"), blob("gone", "g1")}
	if fmt.Sprint(im.Prefix) != fmt.Sprint(wantPrefix) {
		t.Errorf("imported prefix %v, want %v", im.Prefix, wantPrefix)
	}
	wantSessions := []picker.WarmSession{{Pool: "p", ID: "s1", Endpoint: "e1", Expires: t0.Add(time.Hour)}}
	if !slices.Equal(im.Sessions, wantSessions) {
		t.Errorf("imported sessions %v, want %v", im.Sessions, wantSessions)
	}
	wantEndpoints := []picker.WarmEndpoint{{Pool: "p", Endpoint: "e1", Known: true}, {Pool: "p", Endpoint: "e2", Known: true, Failing: true}}
	if !slices.Equal(im.Endpoints, wantEndpoints) {
		t.Errorf("imported endpoints %+v, want %+v", im.Endpoints, wantEndpoints)
	}

	// The first save rewrites e1 although its content is the same, and
	// deletes the blob of the endpoint the picker no longer has.
	p.set(picker.Warm{Prefix: []picker.PrefixBlob{blob("e1", "a1")}})
	w.save(t0.Add(time.Minute))
	if got, want := st.take(), []string{"p/e1=a1", "p/gone deleted"}; !slices.Equal(got, want) {
		t.Errorf("first save after restore wrote %q, want %q", got, want)
	}
}

func cmpStr(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// TestWarmHealthKeepsItsSince: the store records since when an endpoint
// has been in its state; a save that finds it in the same state keeps
// that time (across a restart too), a change starts a new one.
func TestWarmHealthKeepsItsSince(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	prev := store.NewSnapshot()
	prev.Health[key("e1")] = store.Health{Healthy: false, Reason: failingReason, Since: t0}
	fake := storetest.NewFrom(prev)
	p := &fakePicker{}
	w := NewWarm(fake, p, WarmOptions{})
	w.Restore(prev, t0.Add(time.Minute))

	health := func() map[store.EndpointKey]store.Health {
		t.Helper()
		flush(t, fake)
		return load(t, fake).Health
	}
	ep := func(name string, failing, known bool) picker.WarmEndpoint {
		return picker.WarmEndpoint{Pool: "p", Endpoint: name, Failing: failing, Known: known}
	}

	t1 := t0.Add(2 * time.Minute)
	p.set(picker.Warm{Endpoints: []picker.WarmEndpoint{ep("e1", true, true), ep("e2", false, true), ep("e3", false, false)}})
	w.save(t1)
	h := health()
	if got, want := h[key("e1")], (store.Health{Healthy: false, Reason: failingReason, Since: t0}); got != want {
		t.Errorf("e1 still failing after a restart: %+v, want %+v", got, want)
	}
	if got, want := h[key("e2")], (store.Health{Healthy: true, Since: t1}); got != want {
		t.Errorf("e2 first seen healthy: %+v, want %+v", got, want)
	}
	if _, ok := h[key("e3")]; ok || len(h) != 2 {
		t.Errorf("health %v: an endpoint not scraped yet has no health", h)
	}

	t2 := t1.Add(time.Minute)
	p.set(picker.Warm{Endpoints: []picker.WarmEndpoint{ep("e1", false, true), ep("e2", false, true)}})
	w.save(t2)
	h = health()
	if got, want := h[key("e1")], (store.Health{Healthy: true, Since: t2}); got != want {
		t.Errorf("e1 recovered: %+v, want %+v", got, want)
	}
	if got := h[key("e2")]; got.Since != t1 {
		t.Errorf("e2 still healthy: since %v, want %v", got.Since, t1)
	}

	// An endpoint that leaves forgets its history.
	t3 := t2.Add(time.Minute)
	p.set(picker.Warm{Endpoints: []picker.WarmEndpoint{ep("e1", false, true)}})
	w.save(t3)
	p.set(picker.Warm{Endpoints: []picker.WarmEndpoint{ep("e1", false, true), ep("e2", false, true)}})
	w.save(t3.Add(time.Minute))
	if got := health()[key("e2")]; got.Since != t3.Add(time.Minute) {
		t.Errorf("e2 back after leaving: since %v, want %v", got.Since, t3.Add(time.Minute))
	}
}

// TestWarmSavesLoadsAndSessions checks the translation of the picker's
// sessions and scraped loads into the store's types.
func TestWarmSavesLoadsAndSessions(t *testing.T) {
	t.Parallel()
	now := time.Now().UTC()
	fake := storetest.New()
	p := &fakePicker{export: picker.Warm{
		Sessions: []picker.WarmSession{{Pool: "p", ID: "s1", Endpoint: "e1", Expires: now.Add(time.Hour)}},
		Endpoints: []picker.WarmEndpoint{
			{Pool: "p", Endpoint: "e1", Known: true, Waiting: 3, Running: 2, KVUsage: 0.25, ScrapedAt: now},
			{Pool: "p", Endpoint: "e2", Known: true, Failing: true},
		},
	}}
	w := NewWarm(fake, p, WarmOptions{})
	w.save(now)
	flush(t, fake)
	sn := load(t, fake)
	if want := []store.Session{{ID: "s1", Pool: "p", Endpoint: "e1", Expires: now.Add(time.Hour)}}; !slices.Equal(sn.Sessions, want) {
		t.Errorf("sessions %v, want %v", sn.Sessions, want)
	}
	if want := (store.Metrics{Waiting: 3, Running: 2, KVUsage: 0.25, ScrapedAt: now}); len(sn.Metrics) != 1 || sn.Metrics[key("e1")] != want {
		t.Errorf("metrics %v, want only e1's %+v (e2 was never scraped)", sn.Metrics, want)
	}
}

// TestWarmRun checks the periodic loop: each save is flushed and counted,
// a failing flush is not counted and is retried, and the final save when
// the context ends is left for the store's close to commit.
func TestWarmRun(t *testing.T) {
	t.Parallel()
	fake := storetest.New()
	p := &fakePicker{}
	w := NewWarm(fake, p, WarmOptions{Interval: 5 * time.Millisecond})
	if n, last := w.Saves(); n != 0 || !last.IsZero() {
		t.Fatalf("Saves before Run = %d, %v", n, last)
	}
	fake.FailFlushes(errors.New("disk full"))
	start := time.Now()
	cancel := run(t, w.Run)
	testutil.Eventually(t, 10*time.Second, "three saves attempted", func() error {
		if n := p.exportCount(); n < 3 {
			return fmt.Errorf("%d exports", n)
		}
		return nil
	})
	if n, _ := w.Saves(); n != 0 {
		t.Errorf("%d saves counted while every flush failed", n)
	}
	fake.FailFlushes(nil)
	testutil.Eventually(t, 10*time.Second, "two durable saves", func() error {
		if n, _ := w.Saves(); n < 2 {
			return fmt.Errorf("%d saves", n)
		}
		return nil
	})
	if _, last := w.Saves(); last.Before(start) {
		t.Errorf("last save at %v, before Run started at %v", last, start)
	}

	p.set(picker.Warm{Sessions: []picker.WarmSession{{Pool: "p", ID: "last", Endpoint: "e1", Expires: time.Now().Add(time.Hour)}}})
	cancel()
	flush(t, fake) // what closing the store does
	if s := load(t, fake).Sessions; len(s) != 1 || s[0].ID != "last" {
		t.Errorf("sessions after Run returned %v, want the final save's", s)
	}
}

// TestWarmRoundTripThroughThePicker restores a previous run's memory into
// a real picker and saves it back: what the picker keeps (the sessions and
// health of its endpoints) survives, what it cannot use does not.
func TestWarmRoundTripThroughThePicker(t *testing.T) {
	t.Parallel()
	const e1, e2 = "127.0.0.1:18001", "127.0.0.1:18002"
	pk := picker.New(registry.NewPublisher(state(3, e1, e2)), picker.Options{DisableMetrics: true}, nil)
	t0 := time.Now().UTC().Truncate(time.Second)
	prev := store.NewSnapshot()
	prev.SetState(state(3, e1, e2))
	prev.Sessions = []store.Session{
		{ID: "s1", Pool: "p", Endpoint: e1, Expires: t0.Add(time.Hour)},
		{ID: "elsewhere", Pool: "p", Endpoint: "127.0.0.1:9", Expires: t0.Add(time.Hour)},
	}
	prev.Health[store.EndpointKey{Pool: "p", Address: e2}] = store.Health{Healthy: false, Reason: failingReason, Since: t0}
	prev.Prefix[store.EndpointKey{Pool: "p", Address: e1}] = []byte("not a prefix blob")
	fake := storetest.NewFrom(prev)
	w := NewWarm(fake, pk, WarmOptions{})

	got := w.Restore(prev, t0)
	if want := (picker.WarmStats{Sessions: 1, Failing: 1}); got != want {
		t.Errorf("restored %+v, want %+v (the session of an unknown endpoint and the bad blob skipped)", got, want)
	}
	w.save(t0.Add(time.Minute))
	flush(t, fake)
	sn := load(t, fake)
	if len(sn.Sessions) != 1 || sn.Sessions[0].ID != "s1" || sn.Sessions[0].Endpoint != e1 {
		t.Errorf("sessions saved back %v, want s1 on %s", sn.Sessions, e1)
	}
	if h, ok := sn.Health[store.EndpointKey{Pool: "p", Address: e2}]; !ok || h.Healthy || !h.Since.Equal(t0) {
		t.Errorf("health of %s saved back %+v, want failing since %v", e2, h, t0)
	}
	if len(sn.Prefix) != 0 {
		t.Errorf("prefix blobs saved back %v, want none (the picker could not use the bad one)", sn.Prefix)
	}
}
