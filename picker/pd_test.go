package picker

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/contract"
	pdwire "github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/internal/testutil/otlptest"
	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/openai"
	pdpick "github.com/switchyard/switchyard/picker/pd"
	"github.com/switchyard/switchyard/picker/tracing"
	"github.com/switchyard/switchyard/registry"
)

// The disaggregated pool of these tests: two prefill servers and two
// decode servers (their sidecars' addresses).
var (
	pdPrefill = []string{"10.0.5.1:8000", "10.0.5.2:8000"}
	pdDecode  = []string{"10.0.5.11:8000", "10.0.5.12:8000"}
)

// pdTestState is testState plus pool "big": prefill and decode servers, split
// from 256 uncached tokens for prompts of 512 or more; model "big-m" uses
// the pool's policy, "big-whole" turns it off.
func pdTestState() *registry.State {
	st := testState()
	p := &registry.Pool{Name: "big", Engine: registry.EngineVLLM,
		Disaggregation: &registry.Disaggregation{UncachedTokens: 256, MinPromptTokens: 512}}
	for _, a := range pdPrefill {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a, Role: registry.RolePrefill})
	}
	for _, a := range pdDecode {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a, Role: registry.RoleDecode})
	}
	st.Pools["big"] = p
	st.Models["big-m"] = &registry.Model{Name: "big-m", Pool: "big"}
	st.Models["big-whole"] = &registry.Model{Name: "big-whole", Pool: "big", Disaggregation: &registry.Disaggregation{Disabled: true}}
	return st
}

// pdBody is a completions body of about n tokens (4 characters each).
func pdBody(model string, tokens int, stream bool, seed string) []byte {
	prompt := seed + strings.Repeat("abcd", tokens)
	return fmt.Appendf(nil, `{"model":%q,"prompt":%q,"stream":%v}`, model, prompt, stream)
}

// pdDecision is a P/D decision as Envoy receives it.
type pdDecision struct {
	decision
	prefill, sig string
	meta         map[string]string // switchyard.pd metadata (numbers formatted)
}

// pdSend sends one request and returns its decision, the stream left open
// with the request in flight.
func pdSend(t *testing.T, h *harness, body []byte, headers ...string) (*extStream, pdDecision) {
	t.Helper()
	s := h.duplex()
	s.send(postHeaders("/v1/completions", headers...))
	s.send(reqBody(body, true))
	r := s.recv()
	d := pdDecision{decision: decisionOf(t, r)}
	d.prefill, d.sig = d.set[pdwire.PrefillerHeader], d.set[pdwire.SignatureHeader]
	if f := r.GetDynamicMetadata().GetFields()[pdNamespace].GetStructValue().GetFields(); f != nil {
		d.meta = map[string]string{}
		for k, v := range f {
			switch v.GetKind().(type) {
			case *structpb.Value_StringValue:
				d.meta[k] = v.GetStringValue()
			default:
				d.meta[k] = fmt.Sprint(v.GetNumberValue())
			}
		}
	}
	s.readStreamedRequestBody()
	return s, d
}

const pdNamespace = contract.PDNamespace

// endpointStats returns addr's counters in h.
func endpointStats(t *testing.T, h *harness, addr string) EndpointStats {
	t.Helper()
	for _, e := range h.srv.Stats().Endpoints {
		if e.Address == addr {
			return e
		}
	}
	t.Fatalf("no endpoint %s", addr)
	return EndpointStats{}
}

// pdCounts returns pool big's decision counters.
func pdCounts(h *harness) map[string]int64 {
	for _, p := range h.srv.Observe(time.Now()).Pools {
		if p.Name == "big" {
			return p.PDDecisions
		}
	}
	return nil
}

// A long, uncached prompt is split: the destination is decode servers
// only, the prefill server is named (a client's header never is), the
// decision is in the metadata and counted, the prefill counts on its
// server until the sidecar answers, and both servers learn the prompt.
func TestPDSplitsLongPrompt(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	body := pdBody("big-m", 2000, true, "a")
	s, d := pdSend(t, h, body,
		pdwire.PrefillerHeader, "6.6.6.6:80", "x-kv-cache-source-host-port", "6.6.6.6:81")
	for _, a := range strings.Split(d.dest, ",") {
		if !slices.Contains(pdDecode, a) {
			t.Errorf("destination %q names %s, not a decode server", d.dest, a)
		}
	}
	if !slices.Contains(pdPrefill, d.prefill) {
		t.Fatalf("%s = %q, want one of the pool's prefill servers", pdwire.PrefillerHeader, d.prefill)
	}
	if slices.Contains(d.remove, pdwire.PrefillerHeader) || !slices.Contains(d.remove, "x-kv-cache-source-host-port") {
		t.Errorf("removals %v: the client's llm-d header goes, the prefill header is set instead", d.remove)
	}
	if d.sig != "" {
		t.Errorf("signed %q without a signer", d.sig)
	}
	if d.meta["decision"] != "split" || d.meta["prefill"] != d.prefill || d.meta["uncached_tokens"] == "0" {
		t.Errorf("switchyard.pd metadata %v", d.meta)
	}
	pe := endpointStats(t, h, d.prefill)
	if pe.InFlightRequests != 1 || pe.PrefillRequests != 1 || pe.PrefillTokens < 1900 {
		t.Errorf("prefill server %s: %d in flight, %d prefills of %d tokens; want the prefill counted", d.prefill, pe.InFlightRequests, pe.PrefillRequests, pe.PrefillTokens)
	}
	primary := strings.Split(d.dest, ",")[0]
	if de := endpointStats(t, h, primary); de.PrefillRequests != 0 || de.InFlightRequests != 1 {
		t.Errorf("decode server %s: %d prefills, %d in flight; want the request, not its prefill", primary, de.PrefillRequests, de.InFlightRequests)
	}
	pv := h.srv.snap.Load().pools["big"]
	parsed, _, err := openai.ModelSpan(body)
	if err != nil {
		t.Fatal(err)
	}
	hashes := pv.state.hasher.Load().h.Hash(nil, "big-m", parsed.Prompt(body))
	m := make([]int, 2)
	pv.state.index.MatchInto(hashes, []string{d.prefill, primary}, m)
	if m[0] == 0 || m[1] == 0 {
		t.Errorf("prefix index: %d blocks on the prefill server, %d on the decode server; want both", m[0], m[1])
	}
	// The sidecar answers once the prefill is over.
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream", pdwire.ResultHeader, "split"))
	s.recv()
	if pe := endpointStats(t, h, d.prefill); pe.InFlightRequests != 0 || pe.PrefillRequests != 0 || pe.PrefillTokens != 0 {
		t.Errorf("after the answer, prefill server: %d in flight, %d prefills, %d tokens", pe.InFlightRequests, pe.PrefillRequests, pe.PrefillTokens)
	}
	s.send(respBody([]byte("data: [DONE]\n\n"), true))
	s.recv()
	h.waitInFlight(0)
	if c := pdCounts(h); c["split"] != 1 || len(c) != len(pdpick.Reasons) {
		t.Errorf("decision counters %v", c)
	}
}

// A prompt the decode server holds, a short prompt and a model whose
// policy is off go whole: no prefill server named, a client's header
// removed, the decision counted by its reason.
func TestPDWholeRequests(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	body := pdBody("big-m", 2000, false, "b")
	s, first := pdSend(t, h, body)
	s.cancel()
	h.waitInFlight(0)
	for _, c := range []struct {
		desc, reason string
		body         []byte
	}{
		{"the prompt again: cached on its decode server", "below-threshold", body},
		{"short prompt", "short-prompt", pdBody("big-m", 300, false, "c")},
		{"model with the split off", "off", pdBody("big-whole", 2000, false, "d")},
	} {
		s, d := pdSend(t, h, c.body, pdwire.PrefillerHeader, pdPrefill[0], pdwire.SignatureHeader, "v1.1.x")
		if d.prefill != "" || d.meta["decision"] != c.reason {
			t.Errorf("%s: prefill %q, metadata %v; want whole, %s", c.desc, d.prefill, d.meta, c.reason)
		}
		if !slices.Contains(d.remove, pdwire.PrefillerHeader) || !slices.Contains(d.remove, pdwire.SignatureHeader) {
			t.Errorf("%s: removals %v lack the client's P/D headers", c.desc, d.remove)
		}
		if c.reason == "below-threshold" && d.dest != first.dest {
			t.Errorf("%s: destination %q, the first went to %q", c.desc, d.dest, first.dest)
		}
		s.cancel()
		h.waitInFlight(0)
	}
	for _, a := range pdPrefill {
		if e := endpointStats(t, h, a); e.InFlightRequests != 0 || e.PrefillTokens != 0 {
			t.Errorf("prefill server %s: %d in flight, %d tokens after every request ended", a, e.InFlightRequests, e.PrefillTokens)
		}
	}
	c := pdCounts(h)
	if c["split"] != 1 || c["below-threshold"] != 1 || c["short-prompt"] != 1 || c["off"] != 1 {
		t.Errorf("decision counters %v", c)
	}
}

// A pool without a disaggregation block has no P/D stage: its requests
// carry no P/D metadata, and a client's prefill header is still removed.
func TestPDPoolWithoutPolicy(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	snap := h.srv.snap.Load()
	for name, pv := range snap.pools {
		has := slices.ContainsFunc(pv.chain.picked, func(st pickedStage) bool { _, ok := st.(*pdStage); return ok })
		if has != (name == "big") {
			t.Errorf("pool %s: P/D stage in its chain %v", name, has)
		}
	}
	s, d := pdSend(t, h, []byte(`{"model":"llama","prompt":"`+strings.Repeat("abcd", 2000)+`"}`), pdwire.PrefillerHeader, "10.0.0.2:8000")
	defer s.cancel()
	if d.meta != nil || d.prefill != "" || !slices.Contains(d.remove, pdwire.PrefillerHeader) {
		t.Errorf("pool alpha: metadata %v, prefill %q, removals %v", d.meta, d.prefill, d.remove)
	}
	if pdCounts(h)["split"] != 0 {
		t.Error("alpha's request counted as a P/D decision")
	}
	for _, p := range h.srv.Observe(time.Now()).Pools {
		if p.Name != "big" && p.PDDecisions != nil {
			t.Errorf("pool %s has P/D counters", p.Name)
		}
	}
}

// Prefill servers never get a client's request, whatever the load on the
// decode servers; once the decode servers are draining, the pool has no
// ready endpoint although its prefill servers are up.
func TestPDRoleFilter(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	var open []*extStream
	for i := range 12 {
		s, d := pdSend(t, h, pdBody("big-m", 10, false, fmt.Sprint(i)))
		open = append(open, s)
		for _, a := range strings.Split(d.dest, ",") {
			if slices.Contains(pdPrefill, a) {
				t.Fatalf("request %d: destination %q names a prefill server", i, d.dest)
			}
		}
	}
	for _, s := range open {
		s.cancel()
	}
	st := pdTestState()
	st.Version = 2
	st.Pools["big"].Admission = &registry.Admission{NoEndpointWait: 50 * time.Millisecond}
	for i := range st.Pools["big"].Endpoints {
		if st.Pools["big"].Endpoints[i].Role == registry.RoleDecode {
			st.Pools["big"].Endpoints[i].Draining = true
		}
	}
	h.pub.Publish(st)
	testutil.Eventually(t, 5*time.Second, "state v2", func() error {
		if v := h.srv.Stats().Version; v != 2 {
			return fmt.Errorf("version %d", v)
		}
		return nil
	})
	if got := h.srv.capacity("big"); got != admission.NoEndpoint {
		t.Errorf("capacity of a pool whose decode servers drain: %v, want no endpoint", got)
	}
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody(pdBody("big-m", 10, false, "x"), true))
	immediateOf(t, s.recv(), 503)
}

// With a signing key, the prefill server named carries switchyard's
// signature, which a sidecar holding the key verifies.
func TestPDSigned(t *testing.T) {
	signer, err := pdwire.NewSigner([]byte("sixteen-byte-key!"))
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, pdTestState(), Options{PDSigner: signer})
	s, d := pdSend(t, h, pdBody("big-m", 2000, true, "e"))
	defer s.cancel()
	if d.prefill == "" {
		t.Fatalf("not split: %v", d.meta)
	}
	if err := signer.Verify(d.prefill, d.sig, time.Minute); err != nil {
		t.Errorf("signature %q of %s: %v", d.sig, d.prefill, err)
	}
}

// The decision record and the trace carry the decision and what the
// sidecar reported.
func TestPDDecisionRecord(t *testing.T) {
	col := otlptest.Start(t)
	tr, err := tracing.New(tracing.Config{Endpoint: col.Addr, SampleRatio: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Shutdown(context.Background())
	rec := decisions.New(decisions.Options{})
	h := newHarness(t, pdTestState(), Options{Decisions: rec, Tracer: tr})
	s, d := pdSend(t, h, pdBody("big-m", 2000, true, "f"))
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream", pdwire.ResultHeader, "fallback"))
	s.recv()
	s.send(respBody([]byte("data: [DONE]\n\n"), true))
	s.recv()
	s.cancel()
	r := latestRecord(t, rec)
	want := decisions.PD{Decision: "split", Prefill: d.prefill, Result: "fallback"}
	if r.PD == nil || r.PD.Decision != want.Decision || r.PD.Prefill != want.Prefill || r.PD.Result != want.Result || r.PD.UncachedTokens < 1900 {
		t.Errorf("record's P/D %+v, want %+v with the uncached tokens", r.PD, want)
	}
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
	for k, v := range map[string]string{"switchyard.pd.decision": "split", "switchyard.pd.prefill": d.prefill, "switchyard.pd.result": "fallback",
		"switchyard.pd.uncached_tokens": fmt.Sprint(r.PD.UncachedTokens)} {
		if got := sp.Attr(k); got != v {
			t.Errorf("span attribute %s = %q, want %q", k, got, v)
		}
	}
}

// A request the stage splits in BUFFERED mode carries the prefill header
// in the body response that releases it.
func TestPDBufferedMode(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	s := h.open(modeBuffered, modeBuffered)
	s.send(postHeaders("/v1/completions", pdwire.PrefillerHeader, "6.6.6.6:80"))
	r := s.recv()
	if rm := r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders(); !slices.Contains(rm, pdwire.PrefillerHeader) {
		t.Errorf("headers answer removes %v, want the client's prefill header", rm)
	}
	s.send(reqBody(pdBody("big-m", 2000, false, "g"), true))
	d := decisionOf(t, s.recv())
	if !slices.Contains(pdPrefill, d.set[pdwire.PrefillerHeader]) || slices.Contains(d.remove, pdwire.PrefillerHeader) {
		t.Errorf("body answer sets %v, removes %v", d.set, d.remove)
	}
	s.cancel()
}

// A prefill the sidecar reports failed (fallback) keeps its server from
// being chosen again until a scrape shows it up: with both prefill
// servers failed, a long prompt goes whole.
func TestPDFailedPrefillServerSkipped(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	chosen := map[string]bool{}
	for i := range 2 {
		s, d := pdSend(t, h, pdBody("big-m", 2000, true, fmt.Sprintf("fail-%d", i)))
		if d.prefill == "" || chosen[d.prefill] {
			t.Fatalf("request %d: prefill %q after %v failed", i, d.prefill, chosen)
		}
		chosen[d.prefill] = true
		s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream", pdwire.ResultHeader, pdwire.ResultFallback))
		s.recv()
		s.cancel()
	}
	s, d := pdSend(t, h, pdBody("big-m", 2000, true, "fail-2"))
	defer s.cancel()
	if d.prefill != "" || d.meta["decision"] != string(pdpick.NoPrefillServer) {
		t.Errorf("with both prefill servers failed: prefill %q, metadata %v", d.prefill, d.meta)
	}
}

// A prompt longer than the hashed span (4,096 tokens) that its decode
// server holds in full goes whole: the unhashed tail is taken as cached.
func TestPDLongCachedPromptWhole(t *testing.T) {
	h := newHarness(t, pdTestState(), Options{})
	body := pdBody("big-m", 8000, false, "long")
	s, d := pdSend(t, h, body)
	s.cancel()
	if d.meta["decision"] != "split" {
		t.Fatalf("first: %v, want split", d.meta)
	}
	h.waitInFlight(0)
	s, d = pdSend(t, h, body)
	defer s.cancel()
	if d.meta["decision"] != "below-threshold" || d.meta["uncached_tokens"] != "0" {
		t.Errorf("again: %v, want whole with nothing uncached", d.meta)
	}
}
