package peers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/switchyard/switchyard/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWireRoundTrip(t *testing.T) {
	t.Parallel()
	at := time.Unix(0, 1_790_000_000_123_456_789)
	evs := []event{
		{pick: Pick{ID: 1, Pool: "llama", Endpoint: "10.0.0.1:8000", Tokens: 4096, Hashes: []uint64{1, 2, 1 << 63}, Session: "s-1"}},
		{pick: Pick{ID: 1}, done: true},
		{pick: Pick{ID: 300000, Pool: "p", Endpoint: "[2001:db8::1]:8000", Tokens: -1}},
		{view: &shareView{reads: true, live: []string{"r2", "r3"}}},
		{view: &shareView{}},
		{reading: &Reading{Pool: "llama", Endpoint: "10.0.0.1:8000", At: at.Add(-40 * time.Millisecond), Data: []byte{1, 2, 3}}},
	}
	b := encodeBatch(nil, at, evs)
	// A reading's time travels as its age: on arrival 5 ms after it was
	// sent (whatever the receiver's clock says), it is 45 ms old.
	sent, got, err := decodeBatchAt(b, nil, at.Add(5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if r := got[5].reading; r == nil || !r.At.Equal(at.Add(-35*time.Millisecond)) {
		t.Fatalf("reading %+v, want At 35 ms before the send time", r)
	}
	sent, got, err = decodeBatchAt(b, nil, at)
	if err != nil {
		t.Fatal(err)
	}
	if !sent.Equal(at) || !reflect.DeepEqual(got, evs) {
		t.Fatalf("round trip:\n got %v %+v\nwant %v %+v", sent, got, at, evs)
	}
	if from, err := decodeHello(encodeHello("replica-7")); err != nil || from != "replica-7" {
		t.Fatalf("hello: %q %v", from, err)
	}
	// Every truncation is an error, never a panic or a partial result
	// taken for whole.
	for i := range len(b) {
		if _, _, err := decodeBatch(b[:i], nil); err == nil {
			t.Fatalf("batch cut at %d of %d decoded without error", i, len(b))
		}
	}
	if _, _, err := decodeBatch(append(b, 0), nil); err == nil {
		t.Fatal("trailing byte accepted")
	}
}

func TestReportRoundTrip(t *testing.T) {
	t.Parallel()
	for _, r := range []Report{
		{ID: "r1", Ready: true, Versions: map[string]string{"ClusterLoadAssignment": "abc", "Listener": "def"}, Features: FeatureReadings},
		{ID: "10.0.0.1:9002"},
	} {
		b := encodeReport(r)
		got, err := decodeReport(b)
		if err != nil || !reflect.DeepEqual(got, r) {
			t.Fatalf("round trip of %+v: %+v, %v", r, got, err)
		}
		// Fields a later version appends are ignored; a cut is an error,
		// except right before the features, where an older replica's
		// report ends: that one has none.
		if got, err := decodeReport(append(b, 7, 7)); err != nil || !reflect.DeepEqual(got, r) {
			t.Fatalf("with trailing bytes: %+v, %v", got, err)
		}
		old := len(b) - 1
		for i := range len(b) {
			got, err := decodeReport(b[:i])
			switch {
			case i == old:
				want := r
				want.Features = 0
				if err != nil || !reflect.DeepEqual(got, want) {
					t.Fatalf("an older replica's report: %+v, %v; want %+v", got, err, want)
				}
			case err == nil:
				t.Fatalf("report cut at %d of %d decoded without error", i, len(b))
			}
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add(encodeBatch(nil, time.Unix(1, 0), []event{{pick: Pick{ID: 9, Pool: "a", Endpoint: "b", Hashes: []uint64{7}}}}))
	f.Add(encodeBatch(nil, time.Unix(1, 0), []event{{view: &shareView{reads: true, live: []string{"a"}}},
		{reading: &Reading{Pool: "p", Endpoint: "e", At: time.Unix(0, 9e8), Data: []byte{1}}}}))
	f.Add([]byte{msgBatch, 0, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		sent, _, err := decodeBatch(b, nil)
		if err != nil {
			return
		}
		// What decodes re-encodes to a batch that decodes the same (the
		// bytes may differ: varints have redundant encodings). A
		// reading's age is measured on arrival: decode both as if they
		// arrived when the batch says it was sent.
		_, evs, _ := decodeBatchAt(b, nil, sent)
		sent2, evs2, err := decodeBatchAt(encodeBatch(nil, sent, evs), nil, sent)
		if err != nil || !sent2.Equal(sent) || !reflect.DeepEqual(evs2, evs) {
			t.Fatalf("re-encoding %x does not decode the same: %v", b, err)
		}
	})
}

// recorder is an Applier that keeps every replica's open picks.
type recorder struct {
	mu     sync.Mutex
	open   map[string]map[uint64]Pick
	hashes map[string]int // picks seen per sender
}

func newRecorder() *recorder {
	return &recorder{open: map[string]map[uint64]Pick{}, hashes: map[string]int{}}
}

func (r *recorder) Picked(from string, p Pick) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open[from] == nil {
		r.open[from] = map[uint64]Pick{}
	}
	r.open[from][p.ID] = p
	r.hashes[from]++
}

func (r *recorder) Released(from string, p Pick) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.open[from], p.ID)
}

func (r *recorder) openCount(from string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.open[from])
}

func (r *recorder) seen(from string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hashes[from]
}

// node is one replica of a test mesh: its Mesh, Applier and gRPC server.
type node struct {
	name   string
	addr   string
	mesh   *Mesh
	rec    *recorder
	app    Applier
	srv    *grpc.Server
	cancel context.CancelFunc
	done   chan struct{}
}

func startNode(t *testing.T, name string, o Options) *node {
	t.Helper()
	return startNodeAt(t, name, "127.0.0.1:0", o)
}

// startNodeAt starts a node listening on addr (a restarted node reuses
// its predecessor's). Backoffs are short unless o sets them.
func startNodeAt(t *testing.T, name, addr string, o Options) *node {
	t.Helper()
	return startNodeWith(t, name, addr, o, nil)
}

// startNodeWith is startNodeAt with app for the node's Applier (nil: a
// recorder, which shares no scrapes).
func startNodeWith(t *testing.T, name, addr string, o Options, app *sharer) *node {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{name: name, addr: lis.Addr().String(), rec: newRecorder(), srv: grpc.NewServer(), done: make(chan struct{})}
	n.app = n.rec
	if app != nil {
		n.rec, n.app = app.recorder, app
	}
	o.Self, o.Address = name, n.addr
	if o.MinBackoff == 0 {
		o.MinBackoff, o.MaxBackoff = 10*time.Millisecond, 50*time.Millisecond
	}
	n.mesh = New(n.app, o)
	n.mesh.Register(n.srv)
	go func() { _ = n.srv.Serve(lis) }()
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	go func() { defer close(n.done); _ = n.mesh.Run(ctx) }()
	t.Cleanup(n.stop)
	return n
}

// stop ends the node: its outgoing streams close and its server stops.
func (n *node) stop() {
	n.cancel()
	<-n.done
	n.srv.Stop()
}

func connectAll(nodes ...*node) {
	for _, n := range nodes {
		var others []string
		for _, o := range nodes {
			if o != n {
				others = append(others, o.addr)
			}
		}
		n.mesh.SetPeers(others)
	}
}

func waitConnected(t *testing.T, nodes ...*node) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "every stream up", func() error {
		for _, n := range nodes {
			for _, p := range n.mesh.Stats().Peers {
				if !p.Connected {
					return fmt.Errorf("%s -> %s not connected", n.name, p.Address)
				}
			}
			if got := len(n.mesh.Stats().Inbound); got != len(nodes)-1 {
				return fmt.Errorf("%s has %d inbound streams", n.name, got)
			}
		}
		return nil
	})
}

// TestMeshSharesPicksAndReleasesThem: three replicas learn each other's
// picks and their ends; when one replica stops, the others release every
// pick it still had open.
func TestMeshSharesPicksAndReleasesThem(t *testing.T) {
	a, b, c := startNode(t, "a", Options{}), startNode(t, "b", Options{}), startNode(t, "c", Options{})
	connectAll(a, b, c)
	waitConnected(t, a, b, c)

	var ids []uint64
	for i := range 10 {
		p := Pick{ID: a.mesh.NextID(), Pool: "p", Endpoint: fmt.Sprintf("10.0.0.%d:8000", i%3), Tokens: 100, Hashes: []uint64{uint64(i)}}
		a.mesh.Published(p)
		ids = append(ids, p.ID)
	}
	for _, id := range ids[:4] {
		a.mesh.Finished(id)
	}
	testutil.Eventually(t, 5*time.Second, "b and c see a's picks", func() error {
		for _, n := range []*node{b, c} {
			if n.rec.seen("a") != 10 || n.rec.openCount("a") != 6 {
				return fmt.Errorf("%s: %d picks seen, %d open", n.name, n.rec.seen("a"), n.rec.openCount("a"))
			}
		}
		return nil
	})
	a.stop()
	testutil.Eventually(t, 5*time.Second, "a's open picks released", func() error {
		for _, n := range []*node{b, c} {
			if got := n.rec.openCount("a"); got != 0 {
				return fmt.Errorf("%s still holds %d of a's picks", n.name, got)
			}
		}
		return nil
	})
}

// TestMeshResetsAPeerThatCannotKeepUp: with a tiny queue, an overflow
// resets the stream (the receiver releases what it held) and later picks
// flow again on the new stream.
func TestMeshResetsAPeerThatCannotKeepUp(t *testing.T) {
	a, b := startNode(t, "a", Options{QueueLen: 1, BatchMax: 1}), startNode(t, "b", Options{})
	connectAll(a, b)
	waitConnected(t, a, b)
	for range 2000 {
		a.mesh.Published(Pick{ID: a.mesh.NextID(), Pool: "p", Endpoint: "e"})
	}
	testutil.Eventually(t, 5*time.Second, "a reset its stream to b", func() error {
		if s := a.mesh.Stats().Peers[0]; s.Resets == 0 || s.Dropped == 0 {
			return fmt.Errorf("stats %+v", s)
		}
		return nil
	})
	waitConnected(t, a, b)
	before := b.rec.seen("a")
	a.mesh.Published(Pick{ID: a.mesh.NextID(), Pool: "p", Endpoint: "e"})
	testutil.Eventually(t, 5*time.Second, "picks flow after the reset", func() error {
		if b.rec.seen("a") <= before {
			return fmt.Errorf("b saw %d picks of a", b.rec.seen("a"))
		}
		return nil
	})
}

// TestMeshNamesPeersAsTheyNameThemselves: each side of a stream learns
// the other's replica ID and picker address, whatever it was configured
// with (a static peers list has addresses only), and Ask reports what
// Options.Report says.
func TestMeshNamesPeersAsTheyNameThemselves(t *testing.T) {
	t.Parallel()
	report := func() Report {
		return Report{ID: "b", Ready: true, Versions: map[string]string{"ClusterLoadAssignment": "v1"}}
	}
	a, b := startNode(t, "a", Options{}), startNode(t, "b", Options{Report: report})
	connectAll(a, b)
	waitConnected(t, a, b)
	testutil.Eventually(t, 5*time.Second, "a knows b by its ID", func() error {
		if p := a.mesh.Stats().Peers[0]; p.Address != b.addr || p.ID != "b" {
			return fmt.Errorf("a's stream to b: %+v", p)
		}
		return nil
	})
	if in := b.mesh.Stats().Inbound[0]; in.From != "a" || in.Address != a.addr {
		t.Errorf("b's stream from a: %+v, want from a at %s", in, a.addr)
	}
	got, err := a.mesh.Ask(context.Background(), b.addr)
	if err != nil || !reflect.DeepEqual(got, report()) {
		t.Fatalf("Ask(b) = %+v, %v; want %+v", got, err, report())
	}
	if got, err := b.mesh.Ask(context.Background(), a.addr); err != nil || got.ID != "a" || got.Ready {
		t.Fatalf("Ask(a) without Options.Report = %+v, %v; want ID a, not ready", got, err)
	}
}

// reconnected waits until a's stream to addr is up again and returns how
// long that took from since.
func reconnected(t *testing.T, a *node, addr string, since time.Time) time.Duration {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "a reconnects", func() error {
		for _, p := range a.mesh.Stats().Peers {
			if p.Address == addr && p.Connected {
				return nil
			}
		}
		return errors.New("not connected")
	})
	return time.Since(since)
}

// disconnected waits until a noticed that its stream to addr ended.
func disconnected(t *testing.T, a *node, addr string) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "a notices the replica left", func() error {
		for _, p := range a.mesh.Stats().Peers {
			if p.Address == addr && p.Connected {
				return errors.New("still connected")
			}
		}
		return nil
	})
}

// TestMeshRejoinsARestartedReplicaQuickly: a stream that was good resets
// the reconnection delay, so a replica that restarts after a long uptime
// is reconnected to within about MinBackoff even if earlier failures had
// grown the delay to MaxBackoff; and a replica that comes back after a
// long outage (the delay at MaxBackoff) is reconnected to as soon as its
// own stream arrives.
func TestMeshRejoinsARestartedReplicaQuickly(t *testing.T) {
	t.Parallel()
	slow := Options{MinBackoff: 50 * time.Millisecond, MaxBackoff: 2 * time.Second, StableAfter: 200 * time.Millisecond}
	a := startNode(t, "a", slow)
	// Reserve b's address, then let a fail against it until its delay
	// reached the maximum (50 ms doubling: 1.55 s of failures).
	b := startNode(t, "b", Options{})
	addr := b.addr
	b.stop()
	a.mesh.SetPeers([]string{addr})
	time.Sleep(2 * time.Second) // the outage under test, not a wait for an outcome
	// b comes back without dialling a: a finds it by its own schedule.
	b = startNodeAt(t, "b", addr, Options{})
	reconnected(t, a, addr, time.Now())
	time.Sleep(300 * time.Millisecond) // longer than StableAfter: a good stream

	b.stop()
	disconnected(t, a, addr)
	restarted := time.Now()
	b = startNodeAt(t, "b", addr, Options{})
	took := reconnected(t, a, addr, restarted)
	t.Logf("after a good stream, a restarted replica is reconnected to in %v", took.Round(time.Millisecond))
	if took > 600*time.Millisecond {
		t.Errorf("reconnected after %v, want about MinBackoff (50 ms): the delay was not reset", took)
	}

	// A long outage grows the delay to MaxBackoff again; b's own stream
	// to a ends it.
	b.stop()
	disconnected(t, a, addr)
	time.Sleep(4 * time.Second) // the outage under test
	back := time.Now()
	b = startNodeAt(t, "b", addr, Options{})
	b.mesh.SetPeers([]string{a.addr})
	took = reconnected(t, a, addr, back)
	t.Logf("after a 4 s outage, a replica that dials in is reconnected to in %v", took.Round(time.Millisecond))
	if took > 600*time.Millisecond {
		t.Errorf("reconnected after %v, want at once when the replica's own stream arrives", took)
	}
}
