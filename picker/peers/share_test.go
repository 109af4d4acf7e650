package peers

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// sharer is an Applier that also shares readings: it keeps the readings
// it got, and hands out own as its latest.
type sharer struct {
	*recorder
	mu   sync.Mutex
	got  map[string][]Reading // by sender
	own  []Reading
	seen chan struct{} // 1-buffered: a reading came
}

func newSharer(own ...Reading) *sharer {
	return &sharer{recorder: newRecorder(), got: map[string][]Reading{}, own: own, seen: make(chan struct{}, 1)}
}

func (s *sharer) Reading(from string, r Reading) {
	s.mu.Lock()
	s.got[from] = append(s.got[from], r)
	s.mu.Unlock()
	select {
	case s.seen <- struct{}{}:
	default:
	}
}

func (s *sharer) Readings() []Reading {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.own)
}

func (s *sharer) readings(from string) []Reading {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.got[from])
}

// startSharingNode is startNode with a sharer for an Applier; reads says
// whether it reads endpoints for the others (SetSharing).
func startSharingNode(t *testing.T, name string, o Options, app *sharer, reads bool) *node {
	t.Helper()
	n := startNodeWith(t, name, "127.0.0.1:0", o, app)
	n.mesh.SetSharing(reads)
	return n
}

// sharerIDsOf returns the IDs n's mesh lists as sharers now.
func sharerIDsOf(n *node) []string {
	ss, _ := n.mesh.Sharers()
	return sharerIDs(ss)
}

func waitSharers(t *testing.T, n *node, want ...string) {
	t.Helper()
	slices.Sort(want)
	testutil.Eventually(t, 10*time.Second, n.name+"'s sharers", func() error {
		if got := sharerIDsOf(n); !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
			return fmt.Errorf("%s shares with %v, want %v", n.name, got, want)
		}
		return nil
	})
}

// TestMeshSharesReadings: replicas that share scrapes list each other as
// sharers, a reading published reaches every other one with its time, a
// replica that connects gets the latest readings at once, and one that
// stops reading for the others (SetSharing(false)) is a sharer no more.
func TestMeshSharesReadings(t *testing.T) {
	t.Parallel()
	at := time.Now().Add(-time.Second)
	latest := Reading{Pool: "p", Endpoint: "10.0.0.9:8000", At: at, Data: []byte("latest")}
	a, b := startSharingNode(t, "a", Options{}, newSharer(), true), startSharingNode(t, "b", Options{}, newSharer(latest), true)
	connectAll(a, b)
	waitConnected(t, a, b)
	waitSharers(t, a, "b")
	waitSharers(t, b, "a")
	// b's latest reading came without b reading anything again.
	testutil.Eventually(t, 5*time.Second, "a has b's latest reading", func() error {
		for _, r := range a.app.(*sharer).readings("b") {
			if string(r.Data) == "latest" {
				if d := r.At.Sub(at); d < -50*time.Millisecond || d > 50*time.Millisecond {
					return fmt.Errorf("reading at %v, read at %v", r.At, at)
				}
				return nil
			}
		}
		return errors.New("not yet")
	})

	c := startSharingNode(t, "c", Options{}, newSharer(), true)
	connectAll(a, b, c)
	waitConnected(t, a, b, c)
	for _, n := range []*node{a, b, c} {
		var others []string
		for _, o := range []string{"a", "b", "c"} {
			if o != n.name {
				others = append(others, o)
			}
		}
		waitSharers(t, n, others...)
	}
	fresh := Reading{Pool: "p", Endpoint: "10.0.0.1:8000", At: time.Now(), Data: []byte("fresh")}
	c.mesh.PublishReading(fresh)
	testutil.Eventually(t, 5*time.Second, "a and b get c's reading", func() error {
		for _, n := range []*node{a, b} {
			rs := n.app.(*sharer).readings("c")
			if len(rs) == 0 || string(rs[len(rs)-1].Data) != "fresh" {
				return fmt.Errorf("%s has %d readings of c", n.name, len(rs))
			}
		}
		return nil
	})
	if s := c.mesh.Stats(); s.Peers[0].ReadingsSent == 0 || s.Peers[0].Sent != 0 {
		t.Errorf("c's counts: %+v (readings are not picks)", s.Peers[0])
	}

	c.mesh.SetSharing(false)
	waitSharers(t, a, "b")
	waitSharers(t, b, "a")
	c.mesh.SetSharing(true)
	waitSharers(t, a, "b", "c")
}

// TestMeshOlderReplicaGetsPicksOnly: a replica that does not share scrapes
// (NoReadings: it announces no FeatureReadings, and, like a replica
// older than scrape sharing, ends any stream that brings a view or
// reading) is sent picks only: the streams both ways stay up, picks flow
// both ways, and neither side counts the other as a sharer.
func TestMeshOlderReplicaGetsPicksOnly(t *testing.T) {
	t.Parallel()
	neu := startSharingNode(t, "new", Options{}, newSharer(Reading{Pool: "p", Endpoint: "e", At: time.Now(), Data: []byte{1}}), true)
	old := startSharingNode(t, "old", Options{NoReadings: true}, newSharer(), true)
	connectAll(neu, old)
	waitConnected(t, neu, old)
	// Let the new side learn what the old one takes, and send what it
	// would.
	testutil.Eventually(t, 5*time.Second, "new knows old by name", func() error {
		if p := neu.mesh.Stats().Peers[0]; p.ID != "old" {
			return fmt.Errorf("%+v", p)
		}
		return nil
	})
	for range 20 {
		neu.mesh.PublishReading(Reading{Pool: "p", Endpoint: "e", At: time.Now(), Data: []byte{2}})
		neu.mesh.Published(Pick{ID: neu.mesh.NextID(), Pool: "p", Endpoint: "e"})
		old.mesh.Published(Pick{ID: old.mesh.NextID(), Pool: "p", Endpoint: "e"})
	}
	testutil.Eventually(t, 5*time.Second, "picks both ways", func() error {
		if neu.rec.seen("old") != 20 || old.rec.seen("new") != 20 {
			return fmt.Errorf("new saw %d of old's picks, old %d of new's", neu.rec.seen("old"), old.rec.seen("new"))
		}
		return nil
	})
	// Heartbeats would have gone out meanwhile, had the new side sent any.
	time.Sleep(3 * neu.mesh.opts.HeartbeatInterval) // the interval under test
	if s := neu.mesh.Stats().Peers[0]; s.Readings || s.ReadingsSent != 0 || s.Resets != 0 || !s.Connected {
		t.Errorf("new's stream to old: %+v", s)
	}
	if in := old.mesh.Stats().Inbound; len(in) != 1 || in[0].Readings != 0 || in[0].Received != 20 {
		t.Errorf("old's streams in: %+v", in)
	}
	if got := sharerIDsOf(neu); len(got) != 0 {
		t.Errorf("new counts %v as sharers", got)
	}
	if got := sharerIDsOf(old); len(got) != 0 {
		t.Errorf("old counts %v as sharers", got)
	}
}

// TestMeshDropsAQuietSharer: a replica whose stream brings nothing for
// DeadAfter (stalled, or its host gone without closing the connection)
// is no sharer until it is heard from again.
func TestMeshDropsAQuietSharer(t *testing.T) {
	t.Parallel()
	watcher := startSharingNode(t, "watcher", Options{HeartbeatInterval: 50 * time.Millisecond}, newSharer(), true)
	// The quiet one sends its view when the stream opens, then no
	// heartbeat for an hour: it looks stalled once it has nothing else
	// to send.
	quiet := startSharingNode(t, "quiet", Options{HeartbeatInterval: time.Hour}, newSharer(), true)
	connectAll(watcher, quiet)
	waitConnected(t, watcher, quiet)
	waitSharers(t, watcher, "quiet")
	_, changed := watcher.mesh.Sharers()
	start := time.Now()
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("the quiet replica is still a sharer after 10 s")
	}
	if got := sharerIDsOf(watcher); len(got) != 0 {
		t.Fatalf("sharers %v after the quiet one went", got)
	}
	t.Logf("a quiet sharer dropped %v after the change was awaited", time.Since(start).Round(time.Millisecond))
	// Anything it sends proves it alive.
	quiet.mesh.Published(Pick{ID: quiet.mesh.NextID(), Pool: "p", Endpoint: "e"})
	waitSharers(t, watcher, "quiet")
	if !slices.Contains(sharerIDsOf(quiet), "watcher") {
		t.Errorf("quiet's sharers %v: the watcher heartbeats", sharerIDsOf(quiet))
	}
}
