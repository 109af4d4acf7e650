package ready

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// world is what a Gate looks at, changed by the test as it goes.
type world struct {
	mu          sync.Mutex
	versions    map[string]string
	fromSources bool
	peers       map[string]*Peer // nil value: the peer does not answer
}

func (w *world) served() (map[string]string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.versions, w.fromSources
}

func (w *world) peerAddrs() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for a := range w.peers {
		out = append(out, a)
	}
	return out
}

func (w *world) ask(_ context.Context, addr string) (Peer, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if p := w.peers[addr]; p != nil {
		return *p, nil
	}
	return Peer{}, errors.New("connection refused")
}

func (w *world) set(f func(w *world)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	f(w)
}

func cla(v string) map[string]string {
	return map[string]string{"ClusterLoadAssignment": v, "Listener": "l-" + v}
}

func run(t *testing.T, w *world, o Options) *Gate {
	t.Helper()
	o.Served, o.Peers, o.Ask = w.served, w.peerAddrs, w.ask
	if o.Poll == 0 {
		o.Poll = 5 * time.Millisecond
	}
	g := New(o)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = g.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return g
}

// stays checks that g is still not ready, for a few polls, and that its
// reason mentions want.
func stays(t *testing.T, g *Gate, want string) {
	t.Helper()
	time.Sleep(50 * time.Millisecond) // ten polls: nothing should change
	if g.Ready() {
		t.Fatalf("ready, want not ready (%s)", want)
	}
	if r := g.Reason(); !strings.Contains(r, want) {
		t.Fatalf("reason %q, want it to mention %q", r, want)
	}
}

func becomes(t *testing.T, g *Gate) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "ready", func() error {
		if !g.Ready() {
			return errors.New(g.Reason())
		}
		return nil
	})
	if g.Reason() != "" {
		t.Errorf("ready with reason %q", g.Reason())
	}
}

// TestAloneReadyOnceTheSourcesAnswered: one switchyard is ready once it
// serves a snapshot of what its sources said, not before (no snapshot, or
// only the persisted state's).
func TestAloneReadyOnceTheSourcesAnswered(t *testing.T) {
	t.Parallel()
	w := &world{}
	g := run(t, w, Options{})
	stays(t, g, "no xDS snapshot")
	w.set(func(w *world) { w.versions = cla("old") })
	stays(t, g, "persisted state")
	w.set(func(w *world) { w.versions, w.fromSources = cla("new"), true })
	becomes(t, g)
}

// TestReadyOnlyWhenServingWhatReadyPeersServe: a ready peer serving other
// endpoints holds the gate; peers that are not ready or do not answer do
// not; agreement opens it, and it then stays open whatever the peers do.
func TestReadyOnlyWhenServingWhatReadyPeersServe(t *testing.T) {
	t.Parallel()
	w := &world{versions: cla("mine"), fromSources: true, peers: map[string]*Peer{
		"10.0.0.2:9002": {Ready: true, Versions: cla("theirs")},
		"10.0.0.3:9002": {Ready: false, Versions: cla("stale")}, // restarting too
		"10.0.0.4:9002": nil,                                    // down
	}}
	g := run(t, w, Options{})
	stays(t, g, "10.0.0.2:9002 serves ClusterLoadAssignment theirs, this replica mine")
	// Only the compared types count: listeners may differ.
	w.set(func(w *world) {
		w.peers["10.0.0.2:9002"].Versions = map[string]string{"ClusterLoadAssignment": "mine", "Listener": "other"}
	})
	becomes(t, g)
	var hooks atomic.Int32
	g.OnReady(func() { hooks.Add(1) })
	if hooks.Load() != 1 {
		t.Errorf("OnReady on a ready gate ran %d times, want at once", hooks.Load())
	}
	w.set(func(w *world) { w.peers["10.0.0.2:9002"].Versions = cla("changed") })
	time.Sleep(30 * time.Millisecond) // a few polls
	if !g.Ready() {
		t.Error("a ready gate closed again")
	}
}

// TestTimeoutEndsTheWait: a replica whose peers never agree, or whose
// sources never answer, is ready after Timeout on what it serves.
func TestTimeoutEndsTheWait(t *testing.T) {
	t.Parallel()
	w := &world{versions: cla("mine"), peers: map[string]*Peer{"10.0.0.2:9002": {Ready: true, Versions: cla("theirs")}}}
	var hooks atomic.Int32
	start := time.Now()
	g := run(t, w, Options{Timeout: 200 * time.Millisecond})
	g.OnReady(func() { hooks.Add(1) })
	becomes(t, g)
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Errorf("ready after %v, before the 200ms timeout", d)
	}
	if hooks.Load() != 1 {
		t.Errorf("hook ran %d times, want once", hooks.Load())
	}
	// Without any snapshot, not even the timeout makes it ready.
	g = run(t, &world{}, Options{Timeout: 10 * time.Millisecond})
	stays(t, g, "no xDS snapshot")
}
