package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// scriptSource is a Source the test drives: every value sent on ch is
// forwarded to the manager.
type scriptSource struct {
	ch      chan Update
	reloads atomic.Int32
}

func newScript() *scriptSource { return &scriptSource{ch: make(chan Update)} }

func (s *scriptSource) Run(ctx context.Context, up chan<- Update) {
	for {
		select {
		case u := <-s.ch:
			select {
			case up <- u:
			case <-ctx.Done():
				return
			}
		case <-ctx.Done():
			return
		}
	}
}

func (s *scriptSource) Reload() { s.reloads.Add(1) }

func (s *scriptSource) send(t *testing.T, u Update) {
	t.Helper()
	select {
	case s.ch <- u:
	case <-time.After(5 * time.Second):
		t.Fatal("source not running")
	}
}

type named struct {
	name string
	src  Source
}

func startManager(t *testing.T, srcs []named, opts ...ManagerOption) (*Manager, *Publisher) {
	t.Helper()
	pub := NewPublisher(nil)
	opts = append([]ManagerOption{WithDebounce(0, 0), WithLogger(slog.New(slog.NewTextHandler(t.Output(), nil)))}, opts...)
	m := NewManager(pub, opts...)
	for _, s := range srcs {
		if err := m.AddSource(s.name, s.src); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return m, pub
}

func waitVersion(t *testing.T, v View, version uint64) *State {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := WaitFor(ctx, v, func(s *State) bool { return s.Version >= version })
	if err != nil {
		t.Fatalf("waiting for version %d: %v (at %d)", version, err, s.Version)
	}
	return s
}

func waitErr(t *testing.T, m *Manager, substr string) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "LastError containing "+substr, func() error {
		err := m.LastError()
		if (substr == "" && err == nil) || (substr != "" && err != nil && strings.Contains(err.Error(), substr)) {
			return nil
		}
		return fmt.Errorf("LastError = %v", err)
	})
}

func poolUpdate(pool string, addrs ...string) Update {
	p := &Pool{Engine: EngineVLLM, FailureMode: FailClosed, MetricsPath: "/metrics"}
	for _, a := range addrs {
		p.Endpoints = append(p.Endpoints, Endpoint{Address: a})
	}
	return Update{Pools: map[string]*Pool{pool: p}, Models: map[string]*Model{"m-" + pool: {Pool: pool}}}
}

func TestManagerWaitsForEverySource(t *testing.T) {
	t.Parallel()
	a, b := newScript(), newScript()
	m, pub := startManager(t, []named{{"a", a}, {"b", b}})
	a.send(t, poolUpdate("pa", "127.0.0.1:1"))
	// Once a is recorded, nothing may be published while b is silent.
	testutil.Eventually(t, 5*time.Second, "source a ready", func() error {
		if !m.Status().Sources[0].Ready {
			return errors.New("not ready")
		}
		return nil
	})
	if s, _ := pub.Current(); s.Version != 0 {
		t.Fatalf("published version %d before every source reported", s.Version)
	}
	b.send(t, Update{Endpoints: map[string][]Endpoint{"pa": {{Address: "127.0.0.1:2"}}}})
	s := waitVersion(t, pub, 1)
	if s.Version != 1 {
		t.Fatalf("version = %d, want 1", s.Version)
	}
	eps := s.Pools["pa"].Endpoints
	if len(eps) != 2 || eps[0].Source != "a" || eps[1].Source != "b" {
		t.Fatalf("merged endpoints = %+v", eps)
	}
}

func TestManagerVersions(t *testing.T) {
	t.Parallel()
	a := newScript()
	m, pub := startManager(t, []named{{"a", a}}, WithInitialVersion(41))
	a.send(t, poolUpdate("p", "127.0.0.1:1"))
	if s := waitVersion(t, pub, 42); s.Version != 42 {
		t.Fatalf("first version = %d, want 42 (initial 41 + 1)", s.Version)
	}
	// Identical content is not republished: the next change is 43.
	a.send(t, poolUpdate("p", "127.0.0.1:1"))
	a.send(t, poolUpdate("p", "127.0.0.1:1", "127.0.0.1:2"))
	s := waitVersion(t, pub, 43)
	if s.Version != 43 || len(s.Pools["p"].Endpoints) != 2 {
		t.Fatalf("got version %d with %d endpoints, want 43 with 2", s.Version, len(s.Pools["p"].Endpoints))
	}
	// An empty update withdraws everything the source contributed.
	a.send(t, Update{})
	if s := waitVersion(t, pub, 44); len(s.Pools) != 0 || len(s.Models) != 0 {
		t.Fatalf("withdrawn source still contributes: %s", s.Summary())
	}
	if st := m.Status(); st.Version != 44 || st.Published.IsZero() {
		t.Fatalf("Status = %+v", st)
	}
}

func TestManagerKeepsLastGoodState(t *testing.T) {
	t.Parallel()
	a := newScript()
	m, pub := startManager(t, []named{{"a", a}})
	a.send(t, poolUpdate("p", "127.0.0.1:1"))
	good := waitVersion(t, pub, 1)

	// A failed refresh keeps the previous contribution.
	a.send(t, Update{Err: errors.New("parse error at x.hcl:3:1")})
	waitErr(t, m, `source "a": parse error at x.hcl:3:1`)
	if s, _ := pub.Current(); s != good {
		t.Fatalf("state changed after a failed refresh: version %d", s.Version)
	}

	// A contribution that does not validate is rejected as a whole.
	bad := poolUpdate("p", "127.0.0.1:1")
	bad.Models["m-p"].Pool = "nope"
	a.send(t, bad)
	waitErr(t, m, `pool "nope" is not defined`)
	if !errors.Is(m.LastError(), ErrUnknownPool) || m.Status().Err == nil {
		t.Fatalf("LastError = %v, Status.Err = %v", m.LastError(), m.Status().Err)
	}
	if s, _ := pub.Current(); s != good {
		t.Fatalf("invalid state was published: version %d", s.Version)
	}

	// The next good contribution is published and clears the error.
	a.send(t, poolUpdate("p", "127.0.0.1:9"))
	s := waitVersion(t, pub, 2)
	if s.Pools["p"].Endpoints[0].Address != "127.0.0.1:9" {
		t.Fatalf("version 2 = %+v", s.Pools["p"].Endpoints)
	}
	waitErr(t, m, "")
}

func TestManagerCoalescesBursts(t *testing.T) {
	t.Parallel()
	a := newScript()
	// The holdoff is long enough that three back-to-back sends land in one
	// burst; the publish then carries only the last of them.
	_, pub := startManager(t, []named{{"a", a}}, WithDebounce(300*time.Millisecond, time.Minute))
	a.send(t, poolUpdate("p", "127.0.0.1:1"))
	a.send(t, poolUpdate("p", "127.0.0.1:2"))
	a.send(t, poolUpdate("p", "127.0.0.1:3"))
	s := waitVersion(t, pub, 1)
	if s.Version != 1 || s.Pools["p"].Endpoints[0].Address != "127.0.0.1:3" {
		t.Fatalf("got version %d with %v, want version 1 with the last update", s.Version, s.Pools["p"].Endpoints)
	}
}

func TestManagerMaxDelay(t *testing.T) {
	t.Parallel()
	a := newScript()
	// With an hour of holdoff only the max delay can trigger the publish.
	_, pub := startManager(t, []named{{"a", a}}, WithDebounce(time.Hour, 20*time.Millisecond))
	a.send(t, poolUpdate("p", "127.0.0.1:1"))
	waitVersion(t, pub, 1)
}

func TestManagerReload(t *testing.T) {
	t.Parallel()
	a, b := newScript(), newScript()
	plain := struct{ Source }{b} // hides b's Reload method
	m, _ := startManager(t, []named{{"a", a}, {"b", plain}})
	m.Reload()
	if a.reloads.Load() != 1 || b.reloads.Load() != 0 {
		t.Fatalf("reloads: a=%d b=%d, want 1 and 0", a.reloads.Load(), b.reloads.Load())
	}
}

func TestManagerRegistration(t *testing.T) {
	t.Parallel()
	m := NewManager(NewPublisher(nil))
	if err := m.Run(context.Background()); err == nil {
		t.Fatal("Run without sources succeeded")
	}
	m = NewManager(NewPublisher(nil))
	if err := m.AddSource("a", newScript()); err != nil {
		t.Fatal(err)
	}
	if err := m.AddSource("a", newScript()); err == nil {
		t.Fatal("duplicate source name accepted")
	}
}
