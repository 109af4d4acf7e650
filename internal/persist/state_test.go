package persist

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/store"
	"github.com/switchyard/switchyard/store/storetest"
)

func state(version uint64, endpoints ...string) *registry.State {
	st := registry.Empty()
	st.Version = version
	p := &registry.Pool{Name: "p", Engine: registry.EngineVLLM, FailureMode: registry.FailClosed}
	for _, e := range endpoints {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: e, Source: "file"})
	}
	st.Pools["p"] = p
	st.Models["m"] = &registry.Model{Name: "m", Pool: "p"}
	return st
}

func load(t *testing.T, s store.Store) *store.Snapshot {
	t.Helper()
	sn, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	return sn
}

// run runs fn in a goroutine until the test ends and checks it returned
// nil once ctx was cancelled.
func run(t *testing.T, fn func(context.Context) error) (cancel func()) {
	t.Helper()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var stopped bool
	cancel = func() {
		if stopped {
			return
		}
		stopped = true
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run returned %v after cancel, want nil", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after cancel")
		}
	}
	t.Cleanup(cancel)
	return cancel
}

// TestStateSaverPersistsEveryPublishedState checks that each state the
// view publishes, with the Consul indexes of that moment, becomes durable
// without anyone else flushing, and that the empty state before the first
// publish is never written.
func TestStateSaverPersistsEveryPublishedState(t *testing.T) {
	t.Parallel()
	fake := storetest.New()
	pub := registry.NewPublisher(nil) // version 0
	sel := registry.ConsulSelector{Service: "vllm", Tag: "llama", PassingOnly: true}
	indexes := make(chan map[registry.ConsulSelector]uint64, 1)
	indexes <- map[registry.ConsulSelector]uint64{sel: 7}
	cur := map[registry.ConsulSelector]uint64{}
	saver := NewStateSaver(fake, pub, func() map[registry.ConsulSelector]uint64 {
		select {
		case cur = <-indexes:
		default:
		}
		return cur
	}, nil)
	run(t, saver.Run)

	pub.Publish(state(1, "127.0.0.1:8001"))
	testutil.Eventually(t, 10*time.Second, "version 1 durable", func() error {
		if v := load(t, fake).StateVersion; v != 1 {
			return fmt.Errorf("durable version %d", v)
		}
		return nil
	})
	sn := load(t, fake)
	if got := ConsulIndexes(sn); got[sel] != 7 || len(got) != 1 {
		t.Errorf("durable Consul indexes %v, want {%v: 7}", got, sel)
	}
	if eps := sn.State().Pools["p"].Endpoints; len(eps) != 1 || eps[0].Address != "127.0.0.1:8001" {
		t.Errorf("durable endpoints %v", eps)
	}

	indexes <- map[registry.ConsulSelector]uint64{sel: 9}
	pub.Publish(state(2, "127.0.0.1:8001", "127.0.0.1:8002"))
	testutil.Eventually(t, 10*time.Second, "version 2 durable", func() error {
		sn := load(t, fake)
		if sn.StateVersion != 2 {
			return fmt.Errorf("durable version %d", sn.StateVersion)
		}
		if idx := ConsulIndexes(sn)[sel]; idx != 9 {
			return fmt.Errorf("durable index %d", idx)
		}
		return nil
	})
	if n := len(load(t, fake).State().Pools["p"].Endpoints); n != 2 {
		t.Errorf("durable state has %d endpoints, want 2", n)
	}
}

// TestStateSaverNeverSavesTheEmptyState: before the registry publishes,
// the view holds version 0; writing it would replace a previous run's
// state with nothing.
func TestStateSaverNeverSavesTheEmptyState(t *testing.T) {
	t.Parallel()
	prev := store.NewSnapshot()
	prev.SetState(state(5, "127.0.0.1:8001"))
	fake := storetest.NewFrom(prev)
	pub := registry.NewPublisher(nil)
	cancel := run(t, NewStateSaver(fake, pub, nil, nil).Run)
	pub.Publish(registry.Empty()) // still version 0: wakes the saver
	cancel()
	if err := fake.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
	if v := load(t, fake).StateVersion; v != 5 {
		t.Errorf("durable version %d after an empty state, want the previous run's 5", v)
	}
	if n := fake.Flushes(); n != 0 {
		t.Errorf("%d flushes committed something, want 0", n)
	}
}

// TestStateSaverRetriesAfterAFailedFlush: a state whose flush failed
// stays pending and becomes durable with the next successful flush.
func TestStateSaverRetriesAfterAFailedFlush(t *testing.T) {
	t.Parallel()
	fake := storetest.New()
	fake.FailFlushes(errors.New("disk full"))
	pub := registry.NewPublisher(nil)
	run(t, NewStateSaver(fake, pub, nil, nil).Run)
	pub.Publish(state(1, "127.0.0.1:8001"))
	testutil.Eventually(t, 10*time.Second, "the failed flush reported", func() error {
		if fake.LastError() == nil {
			return errors.New("no flush error yet")
		}
		return nil
	})
	if v := load(t, fake).StateVersion; v != 0 {
		t.Fatalf("durable version %d while flushes fail", v)
	}
	fake.FailFlushes(nil)
	pub.Publish(state(2, "127.0.0.1:8002"))
	testutil.Eventually(t, 10*time.Second, "version 2 durable", func() error {
		if v := load(t, fake).StateVersion; v != 2 {
			return fmt.Errorf("durable version %d", v)
		}
		return nil
	})
}

func TestConsulIndexes(t *testing.T) {
	t.Parallel()
	if got := ConsulIndexes(nil); len(got) != 0 {
		t.Errorf("ConsulIndexes(nil) = %v", got)
	}
	a := registry.ConsulSelector{Service: "a"}
	b := registry.ConsulSelector{Service: "b", Tag: "t", Datacenter: "dc1", PassingOnly: true}
	sn := store.NewSnapshot()
	sn.ConsulIndexes[consulIndexKey(a)] = 3
	sn.ConsulIndexes[consulIndexKey(b)] = 4
	sn.ConsulIndexes[`{"Service":`] = 5 // written by a switchyard with another encoding
	got := ConsulIndexes(sn)
	if len(got) != 2 || got[a] != 3 || got[b] != 4 {
		t.Errorf("ConsulIndexes = %v, want a:3 b:4 (the key that does not decode skipped)", got)
	}
}

// TestOpen opens a real store file: a new file loads empty, a file a
// previous run left loads its state, and a missing directory is an error
// naming the path.
func TestOpen(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "switchyard.db")
	st, snap, err := Open(path, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if snap.State() != nil || snap.StateVersion != 0 {
		t.Errorf("new store loaded version %d", snap.StateVersion)
	}
	st.SaveState(state(4, "127.0.0.1:8001"))
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	st, snap, err = Open(path, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if snap.StateVersion != 4 {
		t.Errorf("reopened store loaded version %d, want 4", snap.StateVersion)
	}

	missing := filepath.Join(t.TempDir(), "no", "such", "switchyard.db")
	if _, _, err := Open(missing, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("Open(%s) = %v, want an error naming the path", missing, err)
	}
}
