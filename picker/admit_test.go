package picker

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/registry"
)

// admissionState is testState with alpha's admission block set to a.
func admissionState(a *registry.Admission) *registry.State {
	st := testState()
	st.Pools["alpha"].Admission = a
	return st
}

// saturate opens n picks on alpha (MaxInFlightPerEndpoint 1 and three
// endpoints: three saturate it) and returns their streams.
func saturate(t *testing.T, h *harness) []*extStream {
	t.Helper()
	var out []*extStream
	for range 3 {
		s, _ := openAndPick(t, h, "llama")
		out = append(out, s)
	}
	if !h.srv.Saturated(time.Now())["alpha"] {
		t.Fatal("alpha not saturated after three picks")
	}
	return out
}

// startRequest sends a whole request for model, with extra headers.
func startRequest(h *harness, model string, extra ...string) *extStream {
	s := h.duplex()
	s.send(postHeaders("/v1/completions", extra...))
	s.send(reqBody([]byte(`{"model":"`+model+`","prompt":"p"}`), true))
	return s
}

// waiting polls alpha's queue until n requests wait.
func waiting(t *testing.T, h *harness, n int) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, fmt.Sprintf("%d waiting", n), func() error {
		for _, st := range h.srv.AdmissionStats() {
			if st.Pool != "alpha" {
				continue
			}
			got := 0
			for _, w := range st.Waiting {
				got += w.Requests
			}
			if got != n {
				return fmt.Errorf("%d waiting", got)
			}
			return nil
		}
		return errors.New("alpha has no queue")
	})
}

// recvAsync receives s's next message in the background.
func recvAsync(s *extStream) <-chan *extprocv3.ProcessingResponse {
	ch := make(chan *extprocv3.ProcessingResponse, 1)
	go func() {
		r, err := s.c.Recv()
		if err != nil {
			close(ch)
			return
		}
		ch <- r
	}()
	return ch
}

// picked waits for a decision on ch.
func picked(t *testing.T, what string, ch <-chan *extprocv3.ProcessingResponse) decision {
	t.Helper()
	select {
	case r, ok := <-ch:
		if !ok {
			t.Fatalf("%s: stream ended without a decision", what)
		}
		return decisionOf(t, r)
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no decision within 10s", what)
	}
	return decision{}
}

// notYet asserts nothing arrived on ch so far.
func notYet(t *testing.T, what string, ch <-chan *extprocv3.ProcessingResponse) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("%s answered while it should wait: %v", what, r)
	default:
	}
}

// admissionHeaders returns the reason and retry-after headers of a local
// reply.
func admissionHeaders(r *extprocv3.ProcessingResponse) (reason, retry string) {
	for _, h := range r.GetImmediateResponse().GetHeaders().GetSetHeaders() {
		switch h.GetHeader().GetKey() {
		case HeaderAdmission:
			reason = string(h.GetHeader().GetRawValue())
		case "retry-after":
			retry = string(h.GetHeader().GetRawValue())
		}
	}
	return reason, retry
}

// A saturated pool holds requests instead of forwarding them, and lets
// them go as capacity frees: the highest band first (the sheddable model,
// queued because the operator asked for it, waits behind the normal one,
// though it came first).
func TestSaturatedRequestsWaitAndGoByPriority(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{QueueSheddable: true}), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	bulk := startRequest(h, "bulk")
	bulkCh := recvAsync(bulk)
	waiting(t, h, 1)
	llama := startRequest(h, "llama")
	llamaCh := recvAsync(llama)
	waiting(t, h, 2)
	notYet(t, "bulk", bulkCh)
	notYet(t, "llama", llamaCh)

	busy[0].cancel() // a request ends: one slot frees
	d := picked(t, "llama", llamaCh)
	if !alpha[strings.Split(d.dest, ",")[0]] {
		t.Errorf("llama dest %q", d.dest)
	}
	waiting(t, h, 1)
	notYet(t, "bulk", bulkCh)
	busy[1].cancel()
	picked(t, "bulk", bulkCh)
	waiting(t, h, 0)

	st := h.srv.AdmissionStats()[0]
	if st.Enqueued != 2 || st.Dispatched != 2 {
		t.Errorf("stats %+v: want 2 enqueued and dispatched", st)
	}
}

// Requests that wait their whole TTL get 429 with the reason and a retry
// hint; the queue keeps nothing.
func TestAdmissionTTL(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{TTL: 100 * time.Millisecond}), Options{MaxInFlightPerEndpoint: 1})
	saturate(t, h)
	s := startRequest(h, "llama")
	r := s.recv()
	body := immediateOf(t, r, 429)
	if !strings.Contains(body, "admission TTL") {
		t.Errorf("body %s does not say the TTL passed", body)
	}
	if reason, retry := admissionHeaders(r); reason != admission.ReasonTTL || retry != "1" {
		t.Errorf("headers: %s=%q retry-after=%q", HeaderAdmission, reason, retry)
	}
	waiting(t, h, 0)
	if got := h.srv.AdmissionStats()[0].Rejected[admission.ReasonTTL]; got != 1 {
		t.Errorf("ttl rejections %d, want 1", got)
	}
}

// A full queue turns the newest request away at once with 429 overflow.
func TestAdmissionOverflow(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{MaxQueued: 1}), Options{MaxInFlightPerEndpoint: 1})
	saturate(t, h)
	first := startRequest(h, "llama")
	firstCh := recvAsync(first)
	waiting(t, h, 1)
	r := startRequest(h, "llama").recv()
	immediateOf(t, r, 429)
	if reason, _ := admissionHeaders(r); reason != admission.ReasonOverflow {
		t.Errorf("reason %q, want overflow", reason)
	}
	notYet(t, "the first request", firstCh)
}

// By default (the protocol's rule) sheddable requests get 429 at once
// when the pool is saturated, with the admission queue on; normal
// requests wait; and while they wait, a sheddable request that would go
// behind them is shed too.
func TestSheddableShedByDefault(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	shed := func(what string) {
		t.Helper()
		r := startRequest(h, "bulk").recv()
		body := immediateOf(t, r, 429)
		if !strings.Contains(body, "sheddable") {
			t.Errorf("%s: body %s", what, body)
		}
		if reason, retry := admissionHeaders(r); reason != admission.ReasonShed || retry == "" {
			t.Errorf("%s: headers: reason %q retry-after %q", what, reason, retry)
		}
	}
	shed("saturated")
	// A normal request waits rather than being shed.
	ch := recvAsync(startRequest(h, "llama"))
	waiting(t, h, 1)
	notYet(t, "llama", ch)
	shed("behind a waiting request")
	// Once there is room and nobody waits, a sheddable request goes.
	busy[0].cancel()
	picked(t, "llama", ch)
	busy[1].cancel()
	waiting(t, h, 0)
	testutil.Eventually(t, 5*time.Second, "room for the sheddable request", func() error {
		if h.srv.Saturated(time.Now())["alpha"] {
			return errors.New("still saturated")
		}
		return nil
	})
	decisionOf(t, startRequest(h, "bulk").recv())
	if got := h.srv.AdmissionStats()[0]; got.Enqueued != 1 || got.Waiting != nil {
		t.Errorf("queue stats %+v: only the normal request waited", got)
	}
}

// shed_sheddable = false is the operator's opt-in to queueing sheddable
// requests: they wait in the lowest band instead of getting 429.
func TestQueueSheddable(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{QueueSheddable: true}), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	ch := recvAsync(startRequest(h, "bulk"))
	waiting(t, h, 1)
	notYet(t, "bulk", ch)
	busy[0].cancel()
	picked(t, "bulk", ch)
}

// With admission off, saturated requests are forwarded (sheddable ones
// shed), as before the queue existed.
func TestAdmissionOff(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{Disabled: true}), Options{MaxInFlightPerEndpoint: 1})
	saturate(t, h)
	immediateOf(t, startRequest(h, "bulk").recv(), 429)
	d := decisionOf(t, startRequest(h, "llama").recv())
	if !alpha[strings.Split(d.dest, ",")[0]] {
		t.Errorf("dest %q", d.dest)
	}
}

// A request whose client gives up leaves the queue at once.
func TestCancelledWhileQueued(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	saturate(t, h)
	s := startRequest(h, "llama")
	waiting(t, h, 1)
	s.cancel()
	waiting(t, h, 0)
	testutil.Eventually(t, 5*time.Second, "cancellation counted", func() error {
		if c := h.srv.AdmissionStats()[0].Cancelled; c != 1 {
			return fmt.Errorf("cancelled %d", c)
		}
		return nil
	})
}

// The operator's priority header moves a request up, within the bounds
// the operator set: a sheddable model's request asking for priority 9
// (clamped to 1) goes before a normal one that came first.
func TestPriorityHeader(t *testing.T) {
	h := newHarness(t, admissionState(&registry.Admission{PriorityHeader: "x-priority", PriorityMin: -1, PriorityMax: 1}),
		Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	llamaCh := recvAsync(startRequest(h, "llama"))
	waiting(t, h, 1)
	bulkCh := recvAsync(startRequest(h, "bulk", "x-priority", "9"))
	waiting(t, h, 2)
	var bands []int
	for _, w := range h.srv.AdmissionStats()[0].Waiting {
		bands = append(bands, w.Priority)
	}
	if fmt.Sprint(bands) != "[1 0]" {
		t.Errorf("bands %v, want [1 0] (9 clamped to 1)", bands)
	}
	busy[0].cancel()
	picked(t, "bulk", bulkCh)
	notYet(t, "llama", llamaCh)
}

// A pool with no ready endpoint holds requests for the no-endpoint wait:
// an endpoint that appears in time serves them; otherwise 503.
func TestNoEndpointWait(t *testing.T) {
	st := testState()
	st.Pools["alpha"].Endpoints = []registry.Endpoint{{Address: "10.0.0.1:8000", Draining: true}}
	st.Pools["alpha"].Admission = &registry.Admission{NoEndpointWait: 150 * time.Millisecond}
	h := newHarness(t, st, Options{})

	r := startRequest(h, "llama").recv()
	immediateOf(t, r, 503)
	if reason, _ := admissionHeaders(r); reason != admission.ReasonNoEndpoint {
		t.Errorf("reason %q, want no-endpoint", reason)
	}

	st2 := admissionState(&registry.Admission{NoEndpointWait: time.Minute})
	st2.Pools["alpha"].Endpoints = []registry.Endpoint{{Address: "10.0.0.1:8000", Draining: true}}
	st2.Version = 2
	h.pub.Publish(st2)
	testutil.Eventually(t, 5*time.Second, "state 2", func() error {
		if v := h.srv.Stats().Version; v != 2 {
			return fmt.Errorf("version %d", v)
		}
		return nil
	})
	ch := recvAsync(startRequest(h, "llama"))
	waiting(t, h, 1)
	st3 := admissionState(&registry.Admission{NoEndpointWait: time.Minute})
	st3.Version = 3
	h.pub.Publish(st3)
	d := picked(t, "llama", ch)
	if !alpha[strings.Split(d.dest, ",")[0]] {
		t.Errorf("dest %q", d.dest)
	}
}

// In BUFFERED mode Envoy times the picker's answer, so a waiting request
// first asks Envoy for more time (override_message_timeout), then gets
// its decision once capacity frees.
func TestQueuedBufferedExtendsMessageTimeout(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	s := h.open(extprocfilterv3.ProcessingMode_BUFFERED, extprocfilterv3.ProcessingMode_NONE)
	s.send(postHeaders("/v1/completions"))
	s.recv() // headers answered at once in BUFFERED mode
	s.send(reqBody([]byte(`{"model":"llama","prompt":"p"}`), true))
	r := s.recv()
	if d := r.GetOverrideMessageTimeout().AsDuration(); d < admission.DefaultTTL {
		t.Fatalf("first answer while waiting %v: want override_message_timeout >= the TTL", r)
	}
	ch := recvAsync(s)
	waiting(t, h, 1)
	busy[0].cancel()
	picked(t, "buffered request", ch)
}

// A reload keeps waiting requests and applies the new settings.
func TestReloadKeepsQueuedRequests(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	ch := recvAsync(startRequest(h, "llama"))
	waiting(t, h, 1)
	st := admissionState(&registry.Admission{MaxQueued: 7})
	st.Version = 2
	h.pub.Publish(st)
	testutil.Eventually(t, 5*time.Second, "reload applied", func() error {
		if c := h.srv.AdmissionStats()[0].Config.MaxQueued; c != 7 {
			return fmt.Errorf("max_queued %d", c)
		}
		return nil
	})
	waiting(t, h, 1)
	busy[0].cancel()
	picked(t, "llama", ch)
}

// A request the queue lets go goes where the dispatcher saw room, even if
// the scorers prefer a server without it (here its session's server,
// whose own queue would hold it).
func TestAdmittedRequestGoesWhereThereIsRoom(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	openSession := func() (*extStream, string) {
		s := startRequest(h, "llama", "x-session-id", "s1")
		return s, strings.Split(decisionOf(t, s.recv()).dest, ",")[0]
	}
	first, home := openSession()
	first.readStreamedRequestBody()
	var others []*extStream
	for range 2 {
		s, _ := openAndPick(t, h, "llama")
		others = append(others, s)
	}
	ch := recvAsync(startRequest(h, "llama", "x-session-id", "s1"))
	waiting(t, h, 1)
	others[0].cancel() // room frees on a server that is not the session's
	d := picked(t, "session request", ch)
	if got := strings.Split(d.dest, ",")[0]; got == home {
		t.Fatalf("sent to its session's server %s, which has no room", home)
	}
}

// With tenants, the tenant is the request's flow and its priority the
// request's band.
func TestTenantIsTheQueuesFlow(t *testing.T) {
	st := tenantState(registry.Limits{})
	h := newHarness(t, st, Options{MaxInFlightPerEndpoint: 1})
	for range 3 { // saturate alpha
		s := startRequest(h, "llama", "authorization", "Bearer key-b")
		decisionOf(t, s.recv())
		s.readStreamedRequestBody()
	}
	startRequest(h, "llama", "authorization", "Bearer key-b")
	startRequest(h, "llama", "authorization", "Bearer key-a")
	waiting(t, h, 2)
	got := map[string]int{}
	for _, w := range h.srv.AdmissionStats()[0].Waiting {
		got[w.Flow] = w.Priority
	}
	if len(got) != 2 || got["team-a"] != 4 || got["team-b"] != 0 {
		t.Errorf("waiting flows and bands %v, want team-a in band 4 and team-b in band 0", got)
	}
}

// A request the admission queue held is resolved again when it leaves
// the queue; it still counts once in its model's requests and in the
// rewrites, and keeps the target it drew.
func TestQueuedRequestCountedOnce(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	busy := saturate(t, h)
	before := h.srv.Stats().Rewritten
	ch := recvAsync(startRequest(h, "chat"))
	waiting(t, h, 1)
	busy[0].cancel()
	picked(t, "chat", ch)
	if got := h.srv.Stats().Rewritten - before; got != 1 {
		t.Errorf("rewrites counted %d times, want 1", got)
	}
	var seen bool
	for _, o := range h.srv.Observe(time.Now()).Objectives {
		if o.Model != "chat" {
			continue
		}
		seen = true
		if o.Target != "llama-3-8b-instruct" || o.Requests != 1 {
			t.Errorf("objective %s/%s counted %d requests, want 1", o.Model, o.Target, o.Requests)
		}
	}
	if !seen {
		t.Error("no objective counters for chat")
	}
}
