package picker

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

// profileTestState is testState with pool alpha on the named profile.
func profileTestState(profile string) *registry.State {
	st := testState()
	st.Pools["alpha"].Scheduling = &registry.Scheduling{Profile: profile}
	return st
}

func (h *harness) endpoint(addr string) EndpointStats {
	h.t.Helper()
	for _, e := range h.srv.Stats().Endpoints {
		if e.Address == addr {
			return e
		}
	}
	h.t.Fatalf("no endpoint %s", addr)
	return EndpointStats{}
}

func pickBody(t *testing.T, h *harness, body []byte) (*extStream, []string) {
	t.Helper()
	s := h.duplex()
	s.send(postHeaders("/v1/chat/completions", "content-length", strconv.Itoa(len(body))))
	s.send(reqBody(body, true))
	d := decisionOf(t, s.recv())
	s.readStreamedRequestBody()
	return s, strings.Split(d.dest, ",")
}

// A streamed answer's first bytes end its prefill work on the endpoint
// and teach the endpoint's model one TTFT; the end of the answer
// releases the rest.
func TestTTFTObservedOnStreamedAnswer(t *testing.T) {
	h := newHarness(t, profileTestState(sched.ProfilePredictedTTFT), Options{})
	s, dest := pickBody(t, h, chatBody("llama", 4000)) // "stream":true, ~1,000 tokens
	e := h.endpoint(dest[0])
	if e.PrefillRequests != 1 || e.PrefillTokens < 1000 {
		t.Fatalf("after the pick: %d requests, %d tokens of prefill on %s; want 1 and the prompt", e.PrefillRequests, e.PrefillTokens, dest[0])
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream"))
	s.recv()
	if e := h.endpoint(dest[0]); e.PrefillRequests != 1 {
		t.Fatalf("headers ended the prefill: %+v", e)
	}
	s.send(respBody([]byte("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n"), false))
	s.recv()
	e = h.endpoint(dest[0])
	if e.PrefillRequests != 0 || e.PrefillTokens != 0 {
		t.Fatalf("after the first token: %d requests, %d tokens of prefill", e.PrefillRequests, e.PrefillTokens)
	}
	if e.TTFT.Compared != 1 || e.TTFT.Observed <= 0 {
		t.Fatalf("model after one observation: %+v", e.TTFT)
	}
	s.send(respBody(nil, true))
	s.recv()
	h.waitInFlight(0)
	if e := h.endpoint(dest[0]); e.TTFT.Compared != 1 {
		t.Errorf("the end of the answer was observed as a first token: %+v", e.TTFT)
	}
}

// An answer that is not streamed shows no first token: its prefill work
// ends when the prediction said it would, and nothing is learned.
func TestTTFTUnstreamedAnswerExpires(t *testing.T) {
	h := newHarness(t, profileTestState(sched.ProfilePredictedTTFT), Options{})
	body := []byte(fmt.Sprintf(`{"model":"llama","messages":[{"role":"user","content":%q}]}`, strings.Repeat("y", 400)))
	s, dest := pickBody(t, h, body)
	if e := h.endpoint(dest[0]); e.PrefillRequests != 1 {
		t.Fatalf("prefill requests %d after the pick", e.PrefillRequests)
	}
	testutil.Eventually(t, 5*time.Second, "prefill work expired", func() error {
		if e := h.endpoint(dest[0]); e.PrefillRequests != 0 || e.PrefillTokens != 0 {
			return fmt.Errorf("%d requests, %d tokens", e.PrefillRequests, e.PrefillTokens)
		}
		return nil
	})
	if h.inFlight() != 1 {
		t.Fatalf("in flight %d; the request is still running", h.inFlight())
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "application/json"))
	s.recv()
	s.send(respBody([]byte(`{"choices":[]}`), true))
	s.recv()
	h.waitInFlight(0)
	if e := h.endpoint(dest[0]); e.TTFT.Compared != 0 || e.PrefillRequests != 0 {
		t.Errorf("after a JSON answer: %+v", e)
	}
}

// When a fallback serves, the prefill work moves there and the primary's
// prediction teaches nothing.
func TestTTFTFollowsFallback(t *testing.T) {
	h := newHarness(t, profileTestState(sched.ProfilePredictedTTFT), Options{})
	s, dest := pickBody(t, h, chatBody("llama", 400))
	s.send(withMetadata(respHeaders(false, ":status", "200", "content-type", "text/event-stream"), MetadataNamespace, MetadataServed, structpb.NewStringValue(dest[1])))
	s.recv()
	if p, f := h.endpoint(dest[0]), h.endpoint(dest[1]); p.PrefillRequests != 0 || f.PrefillRequests != 1 {
		t.Fatalf("prefill requests: primary %d, fallback %d", p.PrefillRequests, f.PrefillRequests)
	}
	s.send(respBody([]byte("data: {}\n\n"), false))
	s.recv()
	if f := h.endpoint(dest[1]); f.PrefillRequests != 0 || f.TTFT.Compared != 0 {
		t.Fatalf("fallback after its first token: %+v", f)
	}
	s.send(respBody(nil, true))
	s.recv()
	h.waitInFlight(0)
}

// Another replica's pick counts as prefill work here, priced by this
// replica's own prediction, until it ends or the prediction's time passes.
func TestTTFTPeerPicks(t *testing.T) {
	h := newHarness(t, profileTestState(sched.ProfilePredictedTTFT), Options{})
	const addr = "10.0.0.2:8000"
	h.srv.Picked("replica-b", peers.Pick{ID: 7, Pool: "alpha", Endpoint: addr, Tokens: 2000})
	if e := h.endpoint(addr); e.PrefillRequests != 1 || e.PrefillTokens != 2000 || e.InFlightRequests != 1 {
		t.Fatalf("after a peer pick: %+v", e)
	}
	h.srv.Released("replica-b", peers.Pick{ID: 7, Pool: "alpha", Endpoint: addr, Tokens: 2000})
	if e := h.endpoint(addr); e.PrefillRequests != 0 || e.PrefillTokens != 0 || e.InFlightRequests != 0 {
		t.Fatalf("after its release: %+v", e)
	}
	// Not released: the work ends when predicted (cold start: 25 ms plus
	// 50 µs a token).
	h.srv.Picked("replica-b", peers.Pick{ID: 8, Pool: "alpha", Endpoint: addr, Tokens: 100})
	testutil.Eventually(t, 5*time.Second, "peer prefill work expired", func() error {
		if e := h.endpoint(addr); e.PrefillRequests != 0 {
			return fmt.Errorf("%d requests", e.PrefillRequests)
		}
		return nil
	})
	h.srv.Released("replica-b", peers.Pick{ID: 8, Pool: "alpha", Endpoint: addr, Tokens: 100})
	if e := h.endpoint(addr); e.PrefillRequests != 0 || e.InFlightRequests != 0 {
		t.Fatalf("after the expired pick's release: %+v", e)
	}
}

// Profiles that do not predict TTFT keep no prefill accounting.
func TestTTFTOnlyWithPredictor(t *testing.T) {
	h := newHarness(t, profileTestState(sched.ProfileWeighted), Options{})
	s, dest := pickBody(t, h, chatBody("llama", 400))
	if e := h.endpoint(dest[0]); e.PrefillRequests != 0 {
		t.Fatalf("the weighted profile counted prefill work: %+v", e)
	}
	s.send(respHeaders(true, ":status", "204"))
	s.recv()
	h.waitInFlight(0)
}
