package picker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/registry"
)

// startEventSim starts one simulator publishing KV events (16-token
// blocks) and returns its address and event ports.
func startEventSim(t *testing.T) (addr string, kv registry.KVEvents) {
	t.Helper()
	pub, replay := testutil.FreePort(t), testutil.FreePort(t)
	addr = startSims(t, 1, "-block-size", "16", "-kv-events-port", strconv.Itoa(pub), "-kv-events-replay-port", strconv.Itoa(replay))[0]
	return addr, registry.KVEvents{Port: pub, ReplayPort: replay}
}

func waitSynced(t *testing.T, h *harness, n int) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "exact views", func() error {
		ks := h.srv.KVEventsStatus()
		if len(ks) != n {
			return fmt.Errorf("status %+v", ks)
		}
		for _, s := range ks {
			if s.State != kvevents.Synced {
				return fmt.Errorf("status %+v", ks)
			}
		}
		return nil
	})
}

// A pool that declares KV events gets a subscriber per server while the
// picker runs: its view turns exact, follows what the server caches, and
// leaves with the server.
func TestPickerFollowsKVEvents(t *testing.T) {
	testutil.SkipProcesses(t, "vllm-sim")
	addr, kv := startEventSim(t)
	other := startSims(t, 1) // no events: the estimating index serves it
	st := simState([]string{addr, other[0]}, nil)
	for i := range st.Pools["alpha"].Endpoints {
		if st.Pools["alpha"].Endpoints[i].Address == addr {
			st.Pools["alpha"].Endpoints[i].KVEvents = &kv
		}
	}
	h := newScrapingHarness(t, st, fastScrape)
	waitSynced(t, h, 1)
	body := chatJSON("tell me about the long shared system prompt that every request of this group carries along", "and a question", 1)
	if err := postDirect(addr, body); err != nil {
		t.Fatal(err)
	}
	m := h.srv.KVEvents()
	servers := []string{addr, other[0]}
	testutil.Eventually(t, 10*time.Second, "the cached prompt in the view", func() error {
		tok, err := m.Tokenizer("alpha").Tokenize(context.Background(), []string{addr}, kvevents.Prompt{Model: simModel, Chat: true, Body: body})
		if err != nil {
			return err
		}
		q := m.Index("alpha").NewQuery(tok.IDs, tok.Adapter, tok.Salt)
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
		if ks := h.srv.KVEventsStatus(); len(ks) != 0 || m.Index("alpha") != nil {
			return fmt.Errorf("status %+v", ks)
		}
		return nil
	})
}

// kvPick routes one chat request through the picker and answers it with
// resp (content type ct; nil: headers only), returning the primary.
func kvPick(t *testing.T, h *harness, body []byte, ct string, resp [][]byte) string {
	t.Helper()
	return kvPickIn(t, h, "", body, ct, resp)
}

// kvPickIn is kvPick restricted to the endpoint subset (Envoy's subset
// hint; "" none).
func kvPickIn(t *testing.T, h *harness, subset string, body []byte, ct string, resp [][]byte) string {
	t.Helper()
	s := h.duplex()
	headers := postHeaders("/v1/chat/completions")
	if subset != "" {
		headers = withMetadata(headers, SubsetNamespace, MetadataSubset, listValue(subset))
	}
	s.send(headers)
	s.send(reqBody(body, true))
	r := s.recv()
	if ir := r.GetImmediateResponse(); ir != nil {
		t.Fatalf("local reply %d: %s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	d := decisionOf(t, r)
	s.readStreamedRequestBody()
	primary, _, _ := strings.Cut(d.dest, ",")
	if resp == nil {
		s.send(respHeaders(true, ":status", "200"))
		s.recv()
		return primary
	}
	s.send(respHeaders(false, ":status", "200", "content-type", ct))
	s.recv()
	for i, chunk := range resp {
		s.send(respBody(chunk, i == len(resp)-1))
		s.recv()
	}
	return primary
}

// sendDirect sends body straight to a server and returns its answer.
func sendDirect(t *testing.T, addr string, body []byte) []byte {
	t.Helper()
	resp, err := http.Post("http://"+addr+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%s: %d %s (%v)", addr, resp.StatusCode, b, err)
	}
	return b
}

// The kv-events stage routes by what the servers' events say they hold:
// a system prompt that another sender put on one server (behind the
// picker's back) draws the requests sharing it there, though the
// estimating index believes another server holds it, once its stable
// prefix is tokenized (in the background: the first request is routed by
// the estimate). The
// response's cached_tokens, JSON or streamed with usage, check the
// prediction.
func TestKVStageRoutesByTheEnginesCache(t *testing.T) {
	testutil.SkipProcesses(t, "vllm-sim")
	a, kva := startEventSim(t)
	b, kvb := startEventSim(t)
	st := simState([]string{a, b}, nil)
	for i, e := range st.Pools["alpha"].Endpoints {
		kv := kva
		if e.Address == b {
			kv = kvb
		}
		st.Pools["alpha"].Endpoints[i].KVEvents = &kv
	}
	h := newScrapingHarness(t, st, fastScrape)
	waitSynced(t, h, 2)
	system := strings.Repeat("a long system prompt that another client sent straight to one server ", 8)
	sendDirect(t, a, chatJSON(system, "a question from the other client", 1))

	// The first request through the picker goes to b (a subset hint):
	// the estimating index now believes b holds the system prompt. Its
	// stable prefix is tokenized meanwhile.
	if p := kvPickIn(t, h, b, chatJSON(system, "question 0", 1), "", nil); p != b {
		t.Fatalf("subset hint: routed to %s", p)
	}
	testutil.Eventually(t, 10*time.Second, "the system prompt's tokens cached", func() error {
		if s := h.srv.KVEvents().Tokenizer("alpha").Stats(); s.CachedTokens == 0 || s.Failures > 0 {
			return fmt.Errorf("tokenizer %+v", s)
		}
		return nil
	})
	testutil.Eventually(t, 10*time.Second, "requests drawn to the server holding the prompt", func() error {
		if p := kvPick(t, h, chatJSON(system, "question 1", 1), "", nil); p != a {
			return fmt.Errorf("routed to %s, want %s (which holds the system prompt)", p, a)
		}
		return nil
	})
	for i := range 6 {
		if p := kvPick(t, h, chatJSON(system, fmt.Sprint("question ", 2+i), 1), "", nil); p != a {
			t.Fatalf("request %d routed to %s, want %s", i, p, a)
		}
	}
	if s := h.srv.KVEvents().Tokenizer("alpha").Stats(); s.PrefixHits < 7 || s.Mismatches > 0 {
		t.Fatalf("tokenizer %+v: want the requests keyed by the system prompt", s)
	}

	// Responses check the prediction: a JSON answer, and a stream that
	// asked for usage, each as the server gave it.
	before := h.srv.KVEventsStatus()
	body := chatJSON(system, "question 10", 1)
	answer := sendDirect(t, a, body)
	if p := kvPick(t, h, body, "application/json", [][]byte{answer[:len(answer)/2], answer[len(answer)/2:]}); p != a {
		t.Fatalf("routed to %s", p)
	}
	var streamed map[string]any
	_ = json.Unmarshal(chatJSON(system, "question 11", 1), &streamed)
	streamed["stream"], streamed["stream_options"] = true, map[string]any{"include_usage": true}
	sb, _ := json.Marshal(streamed)
	events := sendDirect(t, a, sb)
	if !bytes.Contains(events, []byte(`"cached_tokens"`)) {
		t.Fatalf("stream without usage: %s", events)
	}
	if p := kvPick(t, h, sb, "text/event-stream", [][]byte{events[:len(events)-20], events[len(events)-20:]}); p != a {
		t.Fatalf("routed to %s", p)
	}
	checked := func(s []kvevents.Status) (n int64) {
		for _, x := range s {
			if x.Address == a {
				n = x.Server.Agreed + x.Server.Bounded + x.Server.Over + x.Server.Under
			}
		}
		return n
	}
	after := h.srv.KVEventsStatus()
	if got := checked(after) - checked(before); got != 2 {
		t.Fatalf("%d predictions checked on %s, want 2: %+v", got, a, after)
	}
	for _, x := range after {
		if x.Server.Over+x.Server.Under > 0 {
			t.Fatalf("predictions missed: %+v", x.Server)
		}
	}
}
