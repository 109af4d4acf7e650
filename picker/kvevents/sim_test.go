package kvevents

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// simServer runs cmd/vllm-sim publishing KV events over TCP on loopback.
type simServer struct {
	*kvServer
	endpoint, replay string
}

func startSim(t *testing.T, format string, extra ...string) simServer {
	t.Helper()
	bin := testutil.Binary(t, "vllm-sim")
	addr := testutil.FreeAddr(t)
	_, port, _ := splitPort(addr)
	pubPort, replayPort := testutil.FreePort(t), testutil.FreePort(t)
	args := append([]string{"-port", port, "-model", "tiny", "-lora-modules", vllmAdapter, "-max-loras", "2",
		"-num-gpu-blocks", "64", "-block-size", "16", "-time-scale", "100", "-log-level", "warn",
		"-kv-events-port", strconv.Itoa(pubPort), "-kv-events-replay-port", strconv.Itoa(replayPort), "-kv-events-format", format}, extra...)
	p := testutil.Start(t, "vllm-sim "+addr, bin, args...)
	testutil.WaitHTTP(t, "http://"+addr+"/health", 10*time.Second)
	return simServer{kvServer: &kvServer{t: t, addr: addr, proc: p},
		endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort), replay: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort)}
}

func splitPort(addr string) (string, string, error) {
	for i := len(addr) - 1; i >= 0; i-- {
		if addr[i] == ':' {
			return addr[:i], addr[i+1:], nil
		}
	}
	return "", "", fmt.Errorf("no port in %q", addr)
}

// The simulator's events let the index predict its cached_tokens
// exactly, in every wire format, under eviction pressure, for chat and
// completions on the base model and an adapter; and the simulator's
// /reset_prefix_cache clears the view.
func TestSimulatorKVEventsAgree(t *testing.T) {
	for _, format := range []string{"tagged", "array", "map"} {
		t.Run(format, func(t *testing.T) {
			srv := startSim(t, format)
			m := NewManager(context.Background(), Options{MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, Warmup: -1}, TokenizerOptions{Timeout: 5 * time.Second})
			t.Cleanup(m.Stop)
			m.Sync([]Target{{Pool: "p", Address: srv.addr, Endpoint: srv.endpoint, Replay: srv.replay}})
			waitState(t, m, Synced)
			ctx := context.Background()
			w := newWorkload(5, 8)
			const n = 120
			agree := 0
			var misses []string
			for i := range n {
				p := w.next(i)
				// The simulator, like vLLM, sends a step's events before
				// its output, but the PUB socket delivers them on its own
				// time: wait until the view has every published batch, so
				// this counts the index's errors, not delivery races.
				caughtUp(t, m, srv.addr, srv.replay)
				want := predict(t, m, srv.addr, p)
				got, err := srv.generate(ctx, p)
				if err != nil {
					t.Fatal(err)
				}
				if got == want {
					agree++
				} else if len(misses) < 5 {
					misses = append(misses, fmt.Sprintf("request %d: predicted %d, simulator %d", i, want, got))
				}
			}
			st := statusOf(m, srv.addr)
			if agree != n || st.Server.Removed == 0 {
				t.Fatalf("%d of %d agree (%v); evictions %d", agree, n, misses, st.Server.Removed)
			}
			p := w.next(0)
			resp, err := http.Post("http://"+srv.addr+"/reset_prefix_cache", "application/json", nil)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if _, err := srv.generate(ctx, w.next(1)); err != nil { // the clear goes out with it
				t.Fatal(err)
			}
			waitPredict(t, m, srv.addr, p, 0)
		})
	}
}

// caughtUp waits until the subscriber has applied every batch the engine
// published: its replay socket has nothing after the last applied one.
func caughtUp(t *testing.T, m *Manager, addr, replay string) {
	t.Helper()
	o := Options{}
	o.setDefaults()
	probe := newSubscriber(Target{Replay: replay}, NewIndex().Server("probe"), &o)
	testutil.Eventually(t, 5*time.Second, "subscriber caught up", func() error {
		last := statusOf(m, addr).LastSeq
		got, err := probe.replay(context.Background(), last+1)
		if err != nil {
			return err
		}
		if len(got) > 0 {
			return fmt.Errorf("%d batches after %d not applied yet", len(got), last)
		}
		return nil
	})
}
