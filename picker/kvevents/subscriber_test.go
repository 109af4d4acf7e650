package kvevents

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

const addr = "127.0.0.1:8000" // the server's name in its pool

// engine is a fake engine publishing the stores of prompts it "computes".
type engine struct {
	t    testing.TB
	pub  *Publisher
	seed uint64 // its block hashes (a restarted engine may use others)
}

func newEngine(t testing.TB, opts PublisherOptions) *engine {
	t.Helper()
	if opts.Endpoint == "" {
		opts.Endpoint = "tcp://127.0.0.1:0"
	}
	p, err := NewPublisher(opts)
	if err != nil {
		t.Fatal(err)
	}
	e := &engine{t: t, pub: p, seed: 1}
	t.Cleanup(func() { p.Close() })
	return e
}

// store publishes the stores of a prompt's full blocks of 4 tokens; lost
// buffers them for replay without sending.
func (e *engine) store(prompt []uint32, lost bool) {
	h := engineHashes(prompt, 4, e.seed)
	ev := []EncodeEvent{{Event: storeRun(prompt, 4, 0, len(h), h, "")}}
	if lost {
		e.pub.PublishLost(ev)
	} else {
		e.pub.Publish(ev)
	}
}

func (e *engine) evict(prompt []uint32, block int) {
	h := engineHashes(prompt, 4, e.seed)
	e.pub.Publish([]EncodeEvent{{Event: Event{Kind: BlockRemoved, Hashes: h[block : block+1], Medium: MediumGPU}}})
}

func (e *engine) target() Target {
	return Target{Pool: "p", Address: addr, Endpoint: e.pub.Endpoint(), Replay: e.pub.Replay()}
}

func fastOptions() Options {
	return Options{MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, ReplayTimeout: 2 * time.Second,
		ProbeInterval: 50 * time.Millisecond, Warmup: -1}
}

func startManager(t *testing.T, opts Options, targets ...Target) *Manager {
	t.Helper()
	m := NewManager(context.Background(), opts, TokenizerOptions{})
	t.Cleanup(m.Stop)
	m.Sync(targets)
	return m
}

// status is the status of the manager's only stream.
func status(m *Manager) Status {
	if st := m.Status(); len(st) == 1 {
		return st[0]
	}
	return Status{}
}

// waitCached polls until prompt's cached tokens on the server are want
// (-1: not exact).
func waitCached(t *testing.T, m *Manager, prompt []uint32, want int) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, fmt.Sprintf("%d cached tokens", want), func() error {
		x := m.Index("p")
		if x == nil {
			return fmt.Errorf("no index")
		}
		if got := cached(x, prompt, "", addr)[0]; got != want {
			return fmt.Errorf("cached %d (status %+v)", got, status(m))
		}
		return nil
	})
}

func waitState(t *testing.T, m *Manager, want State) Status {
	t.Helper()
	var st Status
	testutil.Eventually(t, 5*time.Second, "state "+want.String(), func() error {
		if st = status(m); st.State != want || !st.Connected {
			return fmt.Errorf("state %v, connected %v, last error %q", st.State, st.Connected, st.LastError)
		}
		return nil
	})
	return st
}

func TestSubscriberFollowsEngine(t *testing.T) {
	for _, f := range []Format{FormatArray, FormatTagged, FormatMap} {
		t.Run(f.String(), func(t *testing.T) {
			e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: f})
			p1, p2 := seqTokens(0, 21), seqTokens(1000, 13)
			e.store(p1, false) // before the subscriber: replayed on connect
			m := startManager(t, fastOptions(), e.target())
			waitState(t, m, Synced)
			waitCached(t, m, p1, 20)
			e.store(p2, false)
			waitCached(t, m, p2, 12)
			e.evict(p1, 1)
			waitCached(t, m, p1, 4)
			e.pub.Publish([]EncodeEvent{{Event: Event{Kind: AllBlocksCleared}}})
			waitCached(t, m, p2, 0)
			st := status(m)
			if st.Server.Stored != 2 || st.Server.Removed != 1 || st.Server.Cleared != 1 || st.LastSeq != 3 || st.Lost != 0 || st.Restarts != 0 {
				t.Fatalf("status %+v", st)
			}
		})
	}
}

// A batch lost on the wire is recovered from the replay socket: by the
// next live batch, or by the probe when the engine goes quiet.
func TestSubscriberRecoversGapsByReplay(t *testing.T) {
	e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged})
	m := startManager(t, fastOptions(), e.target())
	waitState(t, m, Synced)
	p1, p2, p3 := seqTokens(0, 9), seqTokens(100, 9), seqTokens(200, 9)
	e.store(p1, true)
	e.store(p2, false)
	waitCached(t, m, p1, 8)
	waitCached(t, m, p2, 8)
	e.store(p3, true) // the last batch: only the probe can find it
	waitCached(t, m, p3, 8)
	st := status(m)
	if st.Gaps < 2 || st.Lost != 0 || st.State != Synced {
		t.Fatalf("status %+v", st)
	}
}

// Batches gone from the replay buffer are lost: the view is dropped and
// stays Partial (not exact) until its warm-up passes.
func TestSubscriberLosesWhatReplayCannotServe(t *testing.T) {
	e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatMap, BufferSteps: 2})
	opts := fastOptions()
	opts.ProbeInterval = -1
	m := startManager(t, opts, e.target())
	waitState(t, m, Synced)
	p1 := seqTokens(0, 9)
	e.store(p1, false)
	waitCached(t, m, p1, 8)
	for i := range 3 {
		e.store(seqTokens(100*(i+1), 9), true)
	}
	p2 := seqTokens(900, 9)
	e.store(p2, false)
	st := waitState(t, m, Partial)
	if st.Lost != 1 || st.Gaps != 1 {
		t.Fatalf("status %+v", st)
	}
	x := m.Index("p")
	// p1's blocks were dropped with the view; p2's are known but not
	// trusted.
	if s := x.Lookup(addr); !s.Holds(AppendKeys(nil, p2, 4, 0, nil)[0]) || s.Holds(AppendKeys(nil, p1, 4, 0, nil)[0]) {
		t.Fatal("view after the loss does not hold exactly what followed it")
	}
	waitCached(t, m, p2, -1)
}

// A restarted engine begins its sequence anew with an empty cache: the
// subscriber notices on reconnecting and drops the old engine's blocks.
func TestSubscriberNoticesRestart(t *testing.T) {
	e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged})
	m := startManager(t, fastOptions(), e.target())
	waitState(t, m, Synced)
	old := seqTokens(0, 17)
	for i := range 3 {
		e.store(seqTokens(5000*(i+1), 9), false)
	}
	e.store(old, false)
	waitCached(t, m, old, 16)
	endpoint, replay := e.pub.Endpoint(), e.pub.Replay()
	e.pub.Close()
	waitStateDisconnected(t, m)
	// The new process, on the same ports, computes one other prompt.
	e2 := newEngine(t, PublisherOptions{Endpoint: endpoint, Replay: replay, Format: FormatTagged})
	e2.seed = 99
	fresh := seqTokens(300, 9)
	e2.store(fresh, false)
	waitCached(t, m, fresh, 8)
	waitCached(t, m, old, 0)
	st := status(m)
	if st.Restarts != 1 || st.State != Synced {
		t.Fatalf("status %+v", st)
	}
}

func waitStateDisconnected(t *testing.T, m *Manager) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "disconnected", func() error {
		if st := status(m); st.Connected || st.State != Disconnected {
			return fmt.Errorf("state %v connected %v", st.State, st.Connected)
		}
		return nil
	})
	// Not exact while disconnected.
	if got := cached(m.Index("p"), seqTokens(0, 9), "", addr)[0]; got != -1 {
		t.Fatalf("disconnected server is exact (%d)", got)
	}
}

// Without a replay socket the first batch decides: the engine's very
// first one begins the view exactly, a later one leaves it Partial.
func TestSubscriberWithoutReplay(t *testing.T) {
	e := newEngine(t, PublisherOptions{Format: FormatArray})
	e.store(seqTokens(0, 9), false) // published before anyone listened
	opts := fastOptions()
	opts.Warmup = 200 * time.Millisecond
	m := startManager(t, opts, e.target())
	testutil.Eventually(t, 5*time.Second, "connected", func() error {
		if !status(m).Connected {
			return fmt.Errorf("not connected")
		}
		return nil
	})
	p := seqTokens(40, 9)
	// The subscription may still be travelling: publish until one lands.
	testutil.Eventually(t, 5*time.Second, "a batch received", func() error {
		if status(m).LastSeq >= 0 {
			return nil
		}
		e.store(p, false)
		return fmt.Errorf("nothing received")
	})
	if st := status(m); st.State != Partial && st.State != Synced {
		t.Fatalf("state %v", st.State)
	}
	// The warm-up turns it Synced.
	waitState(t, m, Synced)
	waitCached(t, m, p, 8)
}

// A changed target restarts its stream with an empty view; a removed one
// leaves the index.
func TestManagerSync(t *testing.T) {
	e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged})
	p := seqTokens(0, 9)
	e.store(p, false)
	m := startManager(t, fastOptions(), e.target())
	waitCached(t, m, p, 8)
	t2 := e.target()
	t2.Topic = "kv"
	m.Sync([]Target{t2})
	// The publisher's topic is "": a "kv" subscription receives nothing
	// live, but the view is rebuilt from replay.
	waitCached(t, m, p, 8)
	m.Sync(nil)
	if m.Index("p") != nil || len(m.Status()) != 0 {
		t.Fatal("pool kept after its last stream left")
	}
}

// Replay answers come in vLLM 0.32's shape (with the topic) and the
// earlier one (without).
func TestReplayFrames(t *testing.T) {
	seq5 := []byte{0, 0, 0, 0, 0, 0, 0, 5}
	end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	for _, c := range []struct {
		frames  [][]byte
		seq     uint64
		payload string
	}{
		{[][]byte{{}, []byte("kv"), seq5, []byte("p")}, 5, "p"},
		{[][]byte{{}, {}, end, {}}, endSeq, ""},
		{[][]byte{{}, seq5, []byte("p")}, 5, "p"},
		{[][]byte{{}, end, {}}, endSeq, ""},
	} {
		seq, p, err := replayFrames(c.frames)
		if err != nil || seq != c.seq || string(p) != c.payload {
			t.Errorf("%q: %d %q %v", c.frames, seq, p, err)
		}
	}
	if _, _, err := replayFrames([][]byte{{}, []byte("x")}); err == nil {
		t.Error("a one-frame answer was accepted")
	}
}
