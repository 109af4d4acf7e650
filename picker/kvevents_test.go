package picker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/registry"
)

// A pool that declares KV events gets a subscriber per server while the
// picker runs: its view turns exact, follows what the server caches, and
// leaves with the server.
func TestPickerFollowsKVEvents(t *testing.T) {
	testutil.SkipProcesses(t, "vllm-sim")
	pubPort, replayPort := testutil.FreePort(t), testutil.FreePort(t)
	addrs := startSims(t, 1, "-block-size", "16", "-kv-events-port", strconv.Itoa(pubPort), "-kv-events-replay-port", strconv.Itoa(replayPort))
	other := startSims(t, 1) // no events: the estimating index serves it
	st := simState(append(addrs, other...), nil)
	st.Pools["alpha"].Endpoints[0].KVEvents = &registry.KVEvents{Port: pubPort, ReplayPort: replayPort}
	h := newScrapingHarness(t, st, fastScrape)

	testutil.Eventually(t, 10*time.Second, "exact view", func() error {
		ks := h.srv.KVEventsStatus()
		if len(ks) != 1 || ks[0].Address != addrs[0] || ks[0].State != kvevents.Synced {
			return fmt.Errorf("status %+v", ks)
		}
		return nil
	})
	body, _ := json.Marshal(map[string]any{"model": simModel, "max_tokens": 1,
		"messages": []map[string]string{{"role": "user", "content": "tell me about the long shared system prompt that every request of this group carries along"}}})
	resp, err := http.Post("http://"+addrs[0]+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	kv := h.srv.KVEvents()
	servers := append(addrs, other...)
	testutil.Eventually(t, 10*time.Second, "the cached prompt in the view", func() error {
		q, err := kv.Prepare(context.Background(), "alpha", addrs, kvevents.Prompt{Model: simModel, Chat: true, Body: body})
		if err != nil {
			return err
		}
		defer q.Release()
		n, exact := make([]int, 2), make([]bool, 2)
		q.CachedTokens(servers, n, exact)
		if !exact[0] || n[0] != (q.Tokens()-1)/16*16 || n[0] == 0 || exact[1] {
			return fmt.Errorf("cached %v exact %v of %d tokens", n, exact, q.Tokens())
		}
		return nil
	})
	// The server leaves the pool: its stream stops.
	next := simState(other, nil)
	next.Version = 2
	h.pub.Publish(next)
	testutil.Eventually(t, 10*time.Second, "stream stopped", func() error {
		if ks := h.srv.KVEventsStatus(); len(ks) != 0 || kv.Index("alpha") != nil {
			return fmt.Errorf("status %+v", ks)
		}
		return nil
	})
}
