package kvevents

import (
	"fmt"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// replicaHistory publishes n batches, as a busy engine does: stores of
// distinct prompts, every fourth batch evicting a block of an earlier
// one. It returns some of the prompts, to compare views by.
func replicaHistory(e *engine, n int) [][]uint32 {
	var sample [][]uint32
	var prompts [][]uint32
	for i := range n {
		if i%4 == 3 {
			e.evict(prompts[len(prompts)-2], 2)
			continue
		}
		p := seqTokens(10_000*(i+1), 16+i%16)
		prompts = append(prompts, p)
		e.store(p, false)
		if i%97 == 0 {
			sample = append(sample, p)
		}
	}
	return append(sample, prompts[len(prompts)-1], prompts[len(prompts)-3])
}

// A replica that starts while the engine's replay buffer still holds the
// engine's whole history (vLLM keeps 10,000 batches by default) replays
// it on connecting and is exact at once, with the same view as a
// replica that followed from the start. One that starts later than that
// is partial: the estimate serves the engine until its warm-up passes.
func TestNewReplicaSyncsByReplay(t *testing.T) {
	e := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged})
	first := startManager(t, fastOptions(), e.target())
	waitState(t, first, Synced)
	sample := replicaHistory(e, 3000)
	testutil.Eventually(t, 10*time.Second, "first replica caught up", func() error {
		if st := status(first); st.LastSeq != 2999 {
			return fmt.Errorf("last seq %d", st.LastSeq)
		}
		return nil
	})
	start := time.Now()
	late := startManager(t, fastOptions(), e.target())
	st := waitState(t, late, Synced)
	testutil.Eventually(t, 10*time.Second, "late replica replayed", func() error {
		if st = status(late); st.LastSeq != 2999 {
			return fmt.Errorf("last seq %d", st.LastSeq)
		}
		return nil
	})
	t.Logf("a replica joining after 3,000 batches was exact in %v (%d batches replayed)", time.Since(start).Round(time.Millisecond), st.Replayed)
	for _, p := range sample {
		a, b := cached(first.Index("p"), p, "", addr)[0], cached(late.Index("p"), p, "", addr)[0]
		if a != b || a < 0 {
			t.Fatalf("prompt %v: the first replica says %d cached tokens, the late one %d", p[:2], a, b)
		}
	}
	if a, b := status(first).Server, status(late).Server; a.Blocks != b.Blocks || a.Keys != b.Keys {
		t.Fatalf("views differ: %+v and %+v", a, b)
	}

	// Past the replay buffer: partial.
	short := newEngine(t, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged, BufferSteps: 100})
	replicaHistory(short, 300)
	if st := waitState(t, startManager(t, fastOptions(), short.target()), Partial); st.Replayed != 100 {
		t.Fatalf("status %+v", st)
	}
}

// BenchmarkReplicaJoin is how long a new replica takes to have an exact
// view of an engine whose replay buffer is full (vLLM's default 10,000
// batches, each a run of 4-token blocks or an eviction): connect, replay
// and apply everything.
//
//	go test -run '^$' -bench ReplicaJoin -benchtime 5x ./picker/kvevents/
func BenchmarkReplicaJoin(b *testing.B) {
	e := newEngine(b, PublisherOptions{Replay: "tcp://127.0.0.1:0", Format: FormatTagged})
	replicaHistory(e, 10_000)
	for b.Loop() {
		m := NewManager(b.Context(), fastOptions(), TokenizerOptions{})
		m.Sync([]Target{e.target()})
		for st := status(m); st.State != Synced || st.LastSeq != 9_999; st = status(m) {
			time.Sleep(100 * time.Microsecond) // the measurement's resolution
		}
		m.Stop()
	}
}
