package picker

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/internal/testutil/otlptest"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
)

// sseAnswer is a streamed chat answer of 3 tokens with vLLM's usage block.
var sseAnswer = []string{
	"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
	"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\nda",
	"ta: {\"choices\":[{\"delta\":{\"content\":\"c\"}}]}\n\n",
	"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":12,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
}

// streamedExchange runs one streamed request for model through h as Envoy would,
// with the served endpoint reported as served ("" = the primary), and
// returns the destination. md is the stream's gRPC metadata.
func streamedExchange(t *testing.T, h *harness, md metadata.MD, model, served string, gap time.Duration) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if md != nil {
		ctx = metadata.NewOutgoingContext(ctx, md)
	}
	c, err := h.client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := &extStream{t: t, c: c, cancel: cancel, first: true, reqM: modeDuplex, respM: modeDuplex, early: true}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"stream":true}`, model)
	s.send(postHeaders("/v1/chat/completions", "x-request-id", "rid-1", "content-length", fmt.Sprint(len(body))))
	s.send(reqBody([]byte(body), true))
	d := decisionOf(t, s.recv())
	s.readStreamedRequestBody()
	primary := strings.Split(d.dest, ",")[0]
	if served == "" {
		served = primary
	}
	s.send(withMetadata(respHeaders(false, ":status", "200", "content-type", "text/event-stream"),
		MetadataNamespace, MetadataServed, structpb.NewStringValue(served)))
	s.recv()
	for i, chunk := range sseAnswer {
		time.Sleep(gap) // the server's pace between tokens, not synchronisation
		s.send(respBody([]byte(chunk), i == len(sseAnswer)-1))
		s.recv()
	}
	_ = c.CloseSend()
	if _, err := c.Recv(); err == nil {
		t.Fatal("stream still open")
	}
	return d.dest
}

// latestRecord waits for rec's first record and returns the newest.
func latestRecord(t *testing.T, rec *decisions.Recorder) *decisions.Record {
	t.Helper()
	var r *decisions.Record
	testutil.Eventually(t, 5*time.Second, "a record", func() error {
		if got := rec.Query(decisions.Filter{}); len(got) > 0 {
			r = got[0]
			return nil
		}
		return fmt.Errorf("none yet")
	})
	return r
}

// Every request gets a decision record: the parsed request, every
// candidate with every scorer's score, the pick and fallbacks, the served
// endpoint and the outcome measured from the response stream.
func TestDecisionRecords(t *testing.T) {
	rec := decisions.New(decisions.Options{})
	h := newHarness(t, testState(), Options{Decisions: rec})
	dest := streamedExchange(t, h, nil, "chat", "10.0.0.3:8000", 2*time.Millisecond)
	r := latestRecord(t, rec)
	parts := strings.Split(dest, ",")
	if r.Model != "chat" || r.Target != "llama-3-8b-instruct" || r.Pool != "alpha" || r.RequestID != "rid-1" {
		t.Errorf("request: %+v", r)
	}
	if r.Picked != parts[0] || strings.Join(r.Fallbacks, ",") != strings.Join(parts[1:], ",") {
		t.Errorf("picked %q fallbacks %v, destination %q", r.Picked, r.Fallbacks, dest)
	}
	if r.PoolSize != 3 || len(r.Candidates) != 3 || len(r.Scorers) == 0 || len(r.Filters) == 0 {
		t.Fatalf("breakdown: pool %d, %d candidates, %d scorers, %d filters", r.PoolSize, len(r.Candidates), len(r.Scorers), len(r.Filters))
	}
	if len(r.Scores) != len(r.Candidates)*len(r.Scorers) {
		t.Fatalf("%d scores for %d candidates and %d scorers", len(r.Scores), len(r.Candidates), len(r.Scorers))
	}
	for ci := range r.Candidates {
		sum := 0.0
		for j := range r.Scorers {
			sum += r.Scorers[j].Weight * r.Score(ci, j)
		}
		if d := sum - float64(r.Totals[ci]); d > 1e-3 || d < -1e-3 {
			t.Errorf("%s total %v, weighted scores %v", r.Candidate(ci), r.Totals[ci], sum)
		}
	}
	if r.Status != 200 || r.Served != "10.0.0.3:8000" || r.OutputTokens != 3 {
		t.Errorf("outcome: status %d served %q tokens %d", r.Status, r.Served, r.OutputTokens)
	}
	if r.TTFT <= 0 || r.Duration < r.TTFT+6*time.Millisecond {
		t.Errorf("ttft %v duration %v: want the 3 later chunks' pace in between", r.TTFT, r.Duration)
	}

	// A local reply is recorded with its status and message.
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"nope","prompt":"x"}`), true))
	immediateOf(t, s.recv(), 404)
	testutil.Eventually(t, 5*time.Second, "the 404's record", func() error {
		got := rec.Query(decisions.Filter{Status: "404"})
		if len(got) != 1 || !strings.Contains(got[0].Error, "nope") {
			return fmt.Errorf("records %v", got)
		}
		return nil
	})
	// It keeps the client's model name, so a query by model finds it.
	if got := rec.Query(decisions.Filter{Model: "nope"}); len(got) != 1 || got[0].Model != "nope" || got[0].Target != "nope" {
		t.Errorf("the 404's record by model: %+v", got)
	}
	if got := rec.Query(decisions.Filter{Endpoint: "10.0.0.3:8000"}); len(got) != 1 {
		t.Errorf("endpoint filter found %d records", len(got))
	}
}

// With the predicted-ttft profile, a decision record carries every
// candidate's predicted wait, prefill and total, and its JSON shows them.
func TestDecisionRecordsPredictedTTFT(t *testing.T) {
	rec := decisions.New(decisions.Options{})
	h := newHarness(t, profileTestState(sched.ProfilePredictedTTFT), Options{Decisions: rec})
	streamedExchange(t, h, nil, "chat", "", 0)
	r := latestRecord(t, rec)
	if len(r.Candidates) != 3 || len(r.Predicted) != len(r.Candidates) {
		t.Fatalf("%d candidates, %d predictions", len(r.Candidates), len(r.Predicted))
	}
	for c, p := range r.Predicted {
		if p.Total <= 0 || p.Prefill <= 0 || p.Wait < 0 || p.Total < p.Wait+p.Prefill || p.Uncached <= 0 {
			t.Errorf("%s: prediction %+v", r.Candidate(c), p)
		}
	}
	b, err := r.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{`"predicted_ttft":{"wait_ms":`, `"prefill_ms":`, `"total_ms":`, `"uncached_tokens":`} {
		if !strings.Contains(string(b), k) {
			t.Errorf("record JSON lacks %s: %s", k, b)
		}
	}

	// Other profiles predict nothing.
	rec2 := decisions.New(decisions.Options{})
	h2 := newHarness(t, profileTestState(sched.ProfileWeighted), Options{Decisions: rec2})
	streamedExchange(t, h2, nil, "chat", "", 0)
	if r := latestRecord(t, rec2); r.Predicted != nil {
		t.Errorf("weighted profile recorded predictions %+v", r.Predicted)
	}
}

// Sampling: a recorder sampling nothing records nothing, and the picker
// then does not ask the scheduler for breakdowns.
func TestDecisionRecordsOff(t *testing.T) {
	rec := decisions.New(decisions.Options{Disabled: true})
	h := newHarness(t, testState(), Options{Decisions: rec})
	streamedExchange(t, h, nil, "llama", "", 0)
	if n := rec.Stats().Recorded; n != 0 {
		t.Fatalf("%d records with recording off", n)
	}
}

// The router measures TTFT, time per output token and the whole request
// from the response stream, per model and per served endpoint.
func TestRouterLatency(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	streamedExchange(t, h, nil, "llama", "10.0.0.2:8000", 3*time.Millisecond)
	var ep []EndpointLatency
	testutil.Eventually(t, 5*time.Second, "latency recorded", func() error {
		if ep = h.srv.EndpointLatency(); len(ep) == 0 {
			return fmt.Errorf("none")
		}
		return nil
	})
	if len(ep) != 1 || ep[0].Address != "10.0.0.2:8000" || ep[0].Pool != "alpha" {
		t.Fatalf("endpoint latency %+v", ep)
	}
	l := ep[0].Latency
	if l.TTFT.Count != 1 || l.Duration.Count != 1 || l.TPOT.Count != 1 || l.NTPOT.Count != 1 {
		t.Fatalf("counts ttft %d dur %d tpot %d ntpot %d", l.TTFT.Count, l.Duration.Count, l.TPOT.Count, l.NTPOT.Count)
	}
	// Three chunks 3 ms apart after the first: (duration - ttft) / 2
	// tokens after the first is at least 4.5 ms.
	if tpot := l.TPOT.SumSeconds; tpot < 0.0045 {
		t.Errorf("tpot %v s, want >= 4.5 ms", tpot)
	}
	if l.Duration.SumSeconds < l.TTFT.SumSeconds+0.009 {
		t.Errorf("duration %v s, ttft %v s", l.Duration.SumSeconds, l.TTFT.SumSeconds)
	}
	obs := h.srv.Observe(time.Now())
	found := false
	for _, o := range obs.Objectives {
		if o.Model == "llama" && o.Latency != nil && o.Latency.TTFT.Count == 1 {
			found = true
		}
		if o.Model == "chat" && o.Latency != nil {
			t.Errorf("chat has latency without requests")
		}
	}
	if !found {
		t.Errorf("no latency for model llama: %+v", obs.Objectives)
	}
}

// A traced request's span is a child of the trace context in the stream's
// gRPC metadata (Envoy's ext_proc span), reaches the collector, and names
// the pick and the served endpoint.
func TestTracedRequest(t *testing.T) {
	col := otlptest.Start(t)
	tr, err := tracing.New(tracing.Config{Endpoint: col.Addr, SampleRatio: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Shutdown(context.Background())
	rec := decisions.New(decisions.Options{})
	h := newHarness(t, testState(), Options{Tracer: tr, Decisions: rec})
	const traceID, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	md := metadata.Pairs("traceparent", "00-"+traceID+"-"+parent+"-01")
	dest := streamedExchange(t, h, md, "llama", "10.0.0.1:8000", 0)
	// An unsampled parent is not traced.
	streamedExchange(t, h, metadata.Pairs("traceparent", "00-"+traceID+"-"+parent+"-00"), "llama", "", 0)
	testutil.Eventually(t, 5*time.Second, "both records", func() error {
		if n := rec.Stats().Recorded; n != 2 {
			return fmt.Errorf("%d records", n)
		}
		return nil
	})
	if err := tr.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	var sp otlptest.Span
	testutil.Eventually(t, 10*time.Second, "the span", func() error {
		spans := col.Spans()
		if len(spans) == 0 {
			return fmt.Errorf("no span")
		}
		sp = spans[0]
		return nil
	})
	if n := len(col.Spans()); n != 1 {
		t.Errorf("%d spans, want 1 (the unsampled request has none)", n)
	}
	if sp.TraceID() != traceID || sp.ParentID() != parent {
		t.Errorf("span in trace %s under %s, want %s under %s", sp.TraceID(), sp.ParentID(), traceID, parent)
	}
	if got := sp.Attr("switchyard.endpoint.picked"); got != strings.Split(dest, ",")[0] {
		t.Errorf("picked %q, destination %q", got, dest)
	}
	if got := sp.Attr("switchyard.endpoint.served"); got != "10.0.0.1:8000" {
		t.Errorf("served %q", got)
	}
	if sp.Event("scheduled") == nil || sp.Attr("gen_ai.request.model") != "llama" {
		t.Errorf("events %v", sp.Span.GetEvents())
	}
	if got := sp.EventAttr("scheduled", "switchyard.candidates.count"); got != "3" {
		t.Errorf("scored %s candidates, want 3", got)
	}
	if got := sp.EventAttr("scheduled", "switchyard.scores"); !strings.Contains(got, strings.Split(dest, ",")[0]+" total=") || strings.Count(got, ";") != 2 || !strings.Contains(got, " queue=") {
		t.Errorf("scores %q: want the 3 candidates with every scorer's score", got)
	}
	// The record names the trace.
	if r := rec.Query(decisions.Filter{Limit: 2}); r[1].TraceID != traceID || r[0].TraceID != "" {
		t.Errorf("record trace IDs %q %q", r[1].TraceID, r[0].TraceID)
	}
}

// A 404 for a model nobody declared keeps the client's model name in its
// span, as the picker's other local replies do.
func TestTracedUnknownModel(t *testing.T) {
	col := otlptest.Start(t)
	tr, err := tracing.New(tracing.Config{Endpoint: col.Addr, SampleRatio: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Shutdown(context.Background())
	h := newHarness(t, testState(), Options{Tracer: tr})
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"nope","prompt":"x"}`), true))
	immediateOf(t, s.recv(), 404)
	s.cancel()
	var sp otlptest.Span
	testutil.Eventually(t, 10*time.Second, "the 404's span", func() error {
		if err := tr.ForceFlush(context.Background()); err != nil {
			return err
		}
		spans := col.Spans()
		if len(spans) == 0 {
			return fmt.Errorf("no span")
		}
		sp = spans[0]
		return nil
	})
	if got := sp.Attr("gen_ai.request.model"); got != "nope" {
		t.Errorf("gen_ai.request.model %q, want the client's %q", got, "nope")
	}
	if got := sp.Attr("http.response.status_code"); got != "404" {
		t.Errorf("status %q", got)
	}
}

func TestAppendFixed3(t *testing.T) {
	for v, want := range map[float64]string{0: "0.000", 1: "1.000", 0.5: "0.500", 4.6: "4.600", 0.0004: "0.000", 0.0005: "0.001", 12.3456: "12.346", -1: "-1.000"} {
		if got := string(appendFixed3(nil, v)); got != want {
			t.Errorf("%v: %q, want %q", v, got, want)
		}
	}
}
