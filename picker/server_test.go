package picker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

var alpha = map[string]bool{"10.0.0.1:8000": true, "10.0.0.2:8000": true, "10.0.0.3:8000": true}

func chatBody(model string, promptBytes int) []byte {
	return []byte(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"stream":true,"temperature":0.5}`,
		model, strings.Repeat("x", promptBytes)))
}

func TestDuplexPicksAndReleasesHeldMessages(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	body := chatBody("llama", 100)
	s.send(postHeaders("/v1/chat/completions", "content-length", strconv.Itoa(len(body))))
	s.send(reqBody(body[:10], false))
	s.send(reqBody(body[10:], true))
	d := decisionOf(t, s.recv())
	if d.pool != "alpha" {
		t.Errorf("pool %q", d.pool)
	}
	eps := strings.Split(d.dest, ",")
	if len(eps) != 3 {
		t.Fatalf("destination %q: want primary + 2 fallbacks", d.dest)
	}
	seen := map[string]bool{}
	for _, e := range eps {
		if !alpha[e] || seen[e] {
			t.Errorf("bad or duplicate endpoint %q in %q", e, d.dest)
		}
		seen[e] = true
	}
	if d.contentLength != strconv.Itoa(len(body)) {
		t.Errorf("content-length %q, want %d", d.contentLength, len(body))
	}
	got, _ := s.readStreamedRequestBody()
	if !bytes.Equal(got, body) {
		t.Errorf("body changed without a rewrite")
	}
	if h.inFlight() != 1 {
		t.Errorf("in-flight %d after pick, want 1", h.inFlight())
	}
	// Response path without a rewrite: chunks pass through unchanged.
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream"))
	if s.recv().GetResponseHeaders() == nil {
		t.Fatal("want response headers response")
	}
	chunk := []byte("data: {\"model\":\"llama\"}\n\n")
	s.send(respBody(chunk, false))
	sr := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if !bytes.Equal(sr.GetBody(), chunk) || sr.GetEndOfStream() {
		t.Errorf("passthrough chunk %q eos=%v", sr.GetBody(), sr.GetEndOfStream())
	}
	s.send(respBody(nil, true))
	if !s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
		t.Error("final response chunk lacks end_of_stream")
	}
	h.waitInFlight(0)
	if st := h.srv.Stats(); st.Picked != 1 || st.Requests != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestDuplexLargePromptRewrite(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	body := chatBody("chat", 1<<20)
	s.send(postHeaders("/v1/chat/completions"))
	for off := 0; off < len(body); off += 64 << 10 {
		end := min(off+64<<10, len(body))
		s.send(reqBody(body[off:end], end == len(body)))
	}
	d := decisionOf(t, s.recv())
	want := bytes.Replace(body, []byte(`"model":"chat"`), []byte(`"model":"llama-3-8b-instruct"`), 1)
	if d.contentLength != strconv.Itoa(len(want)) {
		t.Errorf("content-length %q, want %d", d.contentLength, len(want))
	}
	got, chunks := s.readStreamedRequestBody()
	if !bytes.Equal(got, want) {
		t.Fatalf("rewritten body differs (len %d vs %d)", len(got), len(want))
	}
	if chunks < 16 {
		t.Errorf("body streamed back in %d chunks, want >= 16 of <= 64 KiB", chunks)
	}
	if _, tok := h.srv.InFlight(); tok < (1<<20)/4 {
		t.Errorf("in-flight tokens %d, want ~len/4", tok)
	}
	// The JSON response's model is rewritten back to what the client sent.
	s.send(respHeaders(false, ":status", "200", "content-type", "application/json", "content-length", "60"))
	hr := s.recv().GetResponseHeaders().GetResponse()
	if rm := hr.GetHeaderMutation().GetRemoveHeaders(); len(rm) != 1 || rm[0] != "content-length" {
		t.Errorf("rewritten JSON response must drop content-length, got remove=%v", rm)
	}
	s.send(respBody([]byte(`{"id":"x","model":"llama-3`), false))
	s.send(respBody([]byte(`-8b-instruct","choices":[]}`), true))
	sr := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if string(sr.GetBody()) != `{"id":"x","model":"chat","choices":[]}` || !sr.GetEndOfStream() {
		t.Errorf("response rewrite: %q eos=%v", sr.GetBody(), sr.GetEndOfStream())
	}
	h.waitInFlight(0)
}

// TestDuplexBodyPieces sends one body in the shapes Envoy uses (the whole
// body then an empty end-of-stream message, as Envoy 1.40 does for a body
// read at once; pieces with empty messages between) and checks that the
// picker decides on the whole body and streams it back unchanged.
func TestDuplexBodyPieces(t *testing.T) {
	body := chatBody("llama", 100<<10)
	for _, tc := range []struct {
		desc   string
		cuts   []int // piece boundaries; each piece is one message
		length bool  // send content-length
	}{
		{"whole body, then empty end", []int{0, len(body), len(body)}, true},
		{"whole body, then empty end, no length", []int{0, len(body), len(body)}, false},
		{"pieces and empty messages", []int{0, 0, 1000, 1000, 70000, len(body), len(body)}, true},
		{"pieces, no length", []int{0, 3, 50000, len(body)}, false},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			h := newHarness(t, testState(), Options{})
			s := h.duplex()
			if tc.length {
				s.send(postHeaders("/v1/chat/completions", "content-length", strconv.Itoa(len(body))))
			} else {
				s.send(postHeaders("/v1/chat/completions"))
			}
			for i := 1; i < len(tc.cuts); i++ {
				s.send(reqBody(body[tc.cuts[i-1]:tc.cuts[i]], i == len(tc.cuts)-1))
			}
			if d := decisionOf(t, s.recv()); d.contentLength != strconv.Itoa(len(body)) {
				t.Errorf("content-length %q, want %d", d.contentLength, len(body))
			}
			if got, _ := s.readStreamedRequestBody(); !bytes.Equal(got, body) {
				t.Errorf("body streamed back differs (%d bytes, want %d)", len(got), len(body))
			}
		})
	}
}

func TestDuplexSSERewriteSplitEvent(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"chat","prompt":"hi","stream":true}`), true))
	decisionOf(t, s.recv())
	s.readStreamedRequestBody()
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream; charset=utf-8"))
	s.recv()
	stream := "data: {\"id\":1,\"model\":\"llama-3-8b-instruct\",\"choices\":[{\"text\":\"a\"}]}\n\n" +
		"data: {\"id\":2,\"model\":\"llama-3-8b-instruct\",\"choices\":[{\"text\":\"b\"}]}\r\n\r\n" +
		"data: [DONE]\n\n"
	want := strings.ReplaceAll(stream, "llama-3-8b-instruct", "chat")
	var got []byte
	// Split in the middle of the model value and of a line terminator.
	cuts := []int{0, 20, 31, 75, 77, 120, len(stream)}
	for i := 1; i < len(cuts); i++ {
		eos := i == len(cuts)-1
		s.send(respBody([]byte(stream[cuts[i-1]:cuts[i]]), eos))
		if !eos && !bytes.Contains([]byte(stream[cuts[i-1]:cuts[i]]), []byte("\n")) {
			continue // held back: nothing is answered for a partial line
		}
		sr := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		got = append(got, sr.GetBody()...)
		if sr.GetEndOfStream() != eos {
			t.Fatalf("chunk %d: eos=%v", i, sr.GetEndOfStream())
		}
	}
	if string(got) != want {
		t.Errorf("SSE rewrite:\n got %q\nwant %q", got, want)
	}
	h.waitInFlight(0)
}

func TestCompressedResponsePassesThrough(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"chat","prompt":"x"}`), true))
	decisionOf(t, s.recv())
	s.readStreamedRequestBody()
	s.send(respHeaders(false, ":status", "200", "content-type", "application/json", "content-encoding", "gzip"))
	if rm := s.recv().GetResponseHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders(); len(rm) != 0 {
		t.Errorf("compressed response headers mutated: %v", rm)
	}
	gz := []byte{0x1f, 0x8b, 8, 0, 1, 2, 3}
	s.send(respBody(gz, true))
	if got := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); !bytes.Equal(got, gz) {
		t.Errorf("compressed body changed: %v", got)
	}
}

func TestDuplexTrailers(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	body := []byte(`{"model":"llama","input":"x"}`)
	s.send(postHeaders("/v1/embeddings"))
	s.send(reqBody(body, false))
	s.send(reqTrailers())
	decisionOf(t, s.recv())
	sr := s.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if !bytes.Equal(sr.GetBody(), body) || sr.GetEndOfStream() {
		t.Errorf("body before trailers: %q eos=%v (want no end_of_stream: trailers follow)", sr.GetBody(), sr.GetEndOfStream())
	}
	if s.recv().GetRequestTrailers() == nil {
		t.Fatal("want request trailers response")
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "application/json"))
	s.recv()
	s.send(respBody([]byte(`{}`), false))
	s.recv()
	if h.inFlight() != 1 {
		t.Errorf("in-flight %d before response trailers", h.inFlight())
	}
	s.send(respTrailers())
	if s.recv().GetResponseTrailers() == nil {
		t.Fatal("want response trailers response")
	}
	h.waitInFlight(0)
}

func TestBufferedMode(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.open(extprocfilterv3.ProcessingMode_BUFFERED, extprocfilterv3.ProcessingMode_BUFFERED)
	s.send(postHeaders("/v1/chat/completions", HeaderDestination, "6.6.6.6:1"))
	// Headers are answered at once (Envoy buffers the body only afterwards).
	hr := s.recv().GetRequestHeaders()
	if hr == nil || len(hr.GetResponse().GetHeaderMutation().GetRemoveHeaders()) != 1 {
		t.Fatalf("want immediate headers response stripping the client header, got %v", hr)
	}
	body := chatBody("chat", 50)
	s.send(reqBody(body, true))
	r := s.recv()
	d := decisionOf(t, r)
	want := bytes.Replace(body, []byte(`"chat"`), []byte(`"llama-3-8b-instruct"`), 1)
	if got := r.GetRequestBody().GetResponse().GetBodyMutation().GetBody(); !bytes.Equal(got, want) {
		t.Errorf("buffered body mutation %q", got)
	}
	if d.contentLength != strconv.Itoa(len(want)) || !alpha[strings.Split(d.dest, ",")[0]] {
		t.Errorf("decision %+v", d)
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "application/json"))
	s.recv()
	s.send(respBody([]byte(`{"model":"llama-3-8b-instruct","x":1}`), true))
	cr := s.recv().GetResponseBody().GetResponse()
	if string(cr.GetBodyMutation().GetBody()) != `{"model":"chat","x":1}` {
		t.Errorf("buffered response rewrite %q", cr.GetBodyMutation().GetBody())
	}
	h.waitInFlight(0)
}

func TestBufferedModeLargeBody(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.open(extprocfilterv3.ProcessingMode_BUFFERED, extprocfilterv3.ProcessingMode_BUFFERED)
	body := chatBody("chat", 6<<20) // one 6 MiB message: beyond gRPC's default 4 MiB limit
	s.send(postHeaders("/v1/chat/completions"))
	s.recv()
	s.send(reqBody(body, true))
	r := s.recv()
	d := decisionOf(t, r)
	if got := len(r.GetRequestBody().GetResponse().GetBodyMutation().GetBody()); strconv.Itoa(got) != d.contentLength || got != len(body)+len("llama-3-8b-instruct")-len("chat") {
		t.Errorf("body mutation of %d bytes, content-length %s", got, d.contentLength)
	}
}

func TestStreamedMode(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.open(extprocfilterv3.ProcessingMode_STREAMED, extprocfilterv3.ProcessingMode_STREAMED)
	s.early = true // send_body_without_waiting_for_header_response
	body := chatBody("chat", 300)
	s.send(postHeaders("/v1/chat/completions"))
	cuts := []int{0, 5, 12, 100, len(body)}
	for i := 1; i < len(cuts); i++ {
		s.send(reqBody(body[cuts[i-1]:cuts[i]], i == len(cuts)-1))
	}
	decisionOf(t, s.recv())
	var got []byte
	for i := 1; i < len(cuts); i++ {
		cr := s.recv().GetRequestBody().GetResponse()
		if cr == nil {
			t.Fatalf("want one body response per chunk")
		}
		got = append(got, cr.GetBodyMutation().GetBody()...)
	}
	want := bytes.Replace(body, []byte(`"chat"`), []byte(`"llama-3-8b-instruct"`), 1)
	if !bytes.Equal(got, want) {
		t.Errorf("streamed rewrite reassembled %q", got)
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream"))
	s.recv()
	s.send(respBody([]byte("data: {\"model\":\"llama-3-8b-instruct\"}\n\ndata: {\"mod"), false))
	s.send(respBody([]byte("el\":\"llama-3-8b-instruct\"}\n\n"), true))
	a := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetBody()
	b := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetBody()
	if string(a)+string(b) != "data: {\"model\":\"chat\"}\n\ndata: {\"model\":\"chat\"}\n\n" {
		t.Errorf("streamed SSE rewrite %q + %q", a, b)
	}
	h.waitInFlight(0)
}

func TestStreamedModeWithoutEarlyBodyUpgradesToDuplex(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.open(extprocfilterv3.ProcessingMode_STREAMED, extprocfilterv3.ProcessingMode_STREAMED)
	s.send(postHeaders("/v1/completions"))
	mo := s.recv().GetModeOverride()
	if mo.GetRequestBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
		mo.GetRequestTrailerMode() != extprocfilterv3.ProcessingMode_SEND ||
		mo.GetResponseBodyMode() != extprocfilterv3.ProcessingMode_STREAMED {
		t.Fatalf("want standalone mode_override to FULL_DUPLEX_STREAMED + trailers SEND, got %v", mo)
	}
	// Envoy now streams the body full-duplex.
	body := []byte(`{"model":"llama","prompt":"x"}`)
	s.send(reqBody(body, true))
	decisionOf(t, s.recv())
	if got, _ := s.readStreamedRequestBody(); !bytes.Equal(got, body) {
		t.Errorf("body %q", got)
	}
}

func TestHeaderOnlyRequests(t *testing.T) {
	for _, tc := range []struct {
		desc, defaultPool, wantPool string
	}{
		{"first pool by name", "", "alpha"},
		{"routing default pool", "beta", "beta"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			st := testState()
			st.Routing.DefaultPool = tc.defaultPool
			h := newHarness(t, st, Options{})
			s := h.duplex()
			s.send(reqHeaders(true, ":method", "GET", ":path", "/health"))
			d := decisionOf(t, s.recv())
			if d.pool != tc.wantPool {
				t.Errorf("pool %q, want %q", d.pool, tc.wantPool)
			}
			if d.contentLength != "" {
				t.Errorf("header-only request got content-length %q", d.contentLength)
			}
			s.send(respHeaders(true, ":status", "200"))
			s.recv()
			h.waitInFlight(0)
		})
	}
	t.Run("single pool", func(t *testing.T) {
		st := testState()
		delete(st.Pools, "alpha")
		h := newHarness(t, st, Options{})
		s := h.duplex()
		s.send(reqHeaders(true, ":method", "GET", ":path", "/health"))
		if d := decisionOf(t, s.recv()); d.pool != "beta" || d.dest != "10.0.1.2:8000,10.0.1.3:8000" && d.dest != "10.0.1.3:8000,10.0.1.2:8000" {
			t.Errorf("decision %+v (draining endpoint must be skipped)", d)
		}
	})
}

func TestLocalReplies(t *testing.T) {
	for _, tc := range []struct {
		desc    string
		path    string
		body    string
		headers []string
		code    int
		opts    Options
		defPool string
	}{
		{desc: "invalid JSON", path: "/v1/chat/completions", body: `{"model":"llama"`, code: 400},
		{desc: "missing model", path: "/v1/completions", body: `{"prompt":"x"}`, code: 400},
		{desc: "non-string model", path: "/v1/completions", body: `{"model":7}`, code: 400},
		{desc: "nested model only", path: "/v1/responses", body: `{"input":{"model":"llama"}}`, code: 400},
		{desc: "empty POST body", path: "/v1/chat/completions", body: "", code: 400},
		{desc: "unknown model", path: "/v1/chat/completions", body: `{"model":"gpt-9"}`, code: 404},
		{desc: "too large by content-length", path: "/v1/completions", body: `{"model":"llama"}`, headers: []string{"content-length", "99999999"}, code: 413},
		{desc: "too large by body", path: "/v1/completions", body: `{"model":"llama","prompt":"` + strings.Repeat("y", 200) + `"}`, opts: Options{MaxBodyBytes: 100}, code: 413},
		{desc: "no eligible endpoint", path: "/v1/completions", body: `{"model":"beta-gone"}`, code: 503},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			st := testState()
			st.Routing.DefaultPool = tc.defPool
			h := newHarness(t, st, tc.opts)
			s := h.duplex()
			if tc.body == "" {
				s.send(reqHeaders(true, ":method", "POST", ":path", tc.path))
			} else {
				s.send(postHeaders(tc.path, tc.headers...))
				if tc.code != 413 || tc.headers == nil {
					s.send(reqBody([]byte(tc.body), true))
				}
			}
			immediateOf(t, s.recv(), tc.code)
			if _, err := s.c.Recv(); !errors.Is(err, io.EOF) {
				t.Errorf("stream should end after a local reply, got %v", err)
			}
			if h.inFlight() != 0 {
				t.Errorf("rejected request left in-flight %d", h.inFlight())
			}
			if h.srv.Stats().Rejected[tc.code] != 1 {
				t.Errorf("rejected counter %v", h.srv.Stats().Rejected)
			}
		})
	}
}

func TestUnknownModelWithDefaultPool(t *testing.T) {
	st := testState()
	st.Routing.DefaultPool = "alpha"
	h := newHarness(t, st, Options{})
	s := h.duplex()
	body := []byte(`{"model":"gpt-9","prompt":"x"}`)
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody(body, true))
	if d := decisionOf(t, s.recv()); d.pool != "alpha" {
		t.Errorf("pool %q", d.pool)
	}
	if got, _ := s.readStreamedRequestBody(); !bytes.Equal(got, body) {
		t.Errorf("body %q", got)
	}
}

func TestNonInferencePathWithoutModelUsesDefault(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	s.send(postHeaders("/tokenize"))
	s.send(reqBody([]byte(`not json`), true))
	if d := decisionOf(t, s.recv()); d.pool != "alpha" {
		t.Errorf("pool %q", d.pool)
	}
}

func TestModelFilterUsesEndpointModels(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	for i := 0; i < 5; i++ {
		s := h.duplex()
		s.send(postHeaders("/v1/completions"))
		s.send(reqBody([]byte(`{"model":"beta-small"}`), true))
		if d := decisionOf(t, s.recv()); d.dest != "10.0.1.2:8000" {
			t.Fatalf("destination %q, want only the endpoint advertising beta-small", d.dest)
		}
	}
}

func TestProtocolHeadersStripped(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	s.send(postHeaders("/v1/completions",
		"x-gateway-destination-endpoint", "6.6.6.6:80",
		"x-gateway-destination-endpoint-subset", "6.6.6.6:80",
		"x-gateway-destination-endpoint-served", "6.6.6.6:80",
		"x-switchyard-pool", "evil",
		"X-Switchyard-Debug", "1",
		"x-request-id", "keep"))
	s.send(reqBody([]byte(`{"model":"llama"}`), true))
	d := decisionOf(t, s.recv())
	if strings.Contains(d.dest, "6.6.6.6") || d.pool != "alpha" {
		t.Errorf("client headers leaked into the decision: %+v", d)
	}
	want := map[string]bool{"x-gateway-destination-endpoint-subset": true, "x-gateway-destination-endpoint-served": true, "x-switchyard-debug": true}
	if len(d.remove) != len(want) {
		t.Errorf("remove_headers %v, want %v", d.remove, want)
	}
	for _, k := range d.remove {
		if !want[k] {
			t.Errorf("unexpected removal %q", k)
		}
	}
}

func TestSubsetHint(t *testing.T) {
	for _, tc := range []struct {
		desc string
		v    *structpb.Value
		want string // "" means 503
	}{
		{"list restricts", listValue("10.0.0.2:8000", "192.168.9.9:1"), "10.0.0.2:8000"},
		{"comma string", structpb.NewStringValue("10.0.0.3:8000, 10.9.9.9:1"), "10.0.0.3:8000"},
		{"empty list", listValue(), ""},
		{"nothing eligible", listValue("192.168.9.9:1"), ""},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			h := newHarness(t, testState(), Options{})
			s := h.duplex()
			s.send(withMetadata(postHeaders("/v1/completions"), SubsetNamespace, MetadataSubset, tc.v))
			s.send(reqBody([]byte(`{"model":"llama"}`), true))
			r := s.recv()
			if tc.want == "" {
				immediateOf(t, r, 503)
				return
			}
			if d := decisionOf(t, r); d.dest != tc.want {
				t.Errorf("destination %q, want %q", d.dest, tc.want)
			}
		})
	}
}

// openAndPick starts a duplex request for model and returns the stream and
// its destination list, leaving the request in flight.
func openAndPick(t *testing.T, h *harness, model string) (*extStream, []string) {
	t.Helper()
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"`+model+`","prompt":"p"}`), true))
	d := decisionOf(t, s.recv())
	s.readStreamedRequestBody()
	return s, strings.Split(d.dest, ",")
}

func TestLeastInFlightAndFallbackOrder(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	_, d1 := openAndPick(t, h, "llama")
	_, d2 := openAndPick(t, h, "llama")
	_, d3 := openAndPick(t, h, "llama")
	if d1[0] == d2[0] || d2[0] == d3[0] || d1[0] == d3[0] {
		t.Fatalf("least-in-flight should spread: %v %v %v", d1, d2, d3)
	}
	if d3[1] == d3[0] || d3[2] == d3[0] || d3[1] == d3[2] {
		t.Errorf("fallbacks %v must be distinct", d3)
	}
	// Second stream's fallbacks: the untouched endpoint (0 in flight) before the busy one.
	if d2[1] == d1[0] {
		t.Errorf("fallback order %v: idle endpoint must precede %s (1 in flight)", d2, d1[0])
	}
	if h.inFlight() != 3 {
		t.Errorf("in-flight %d", h.inFlight())
	}
}

func TestSheddableGets429WhenSaturated(t *testing.T) {
	h := newHarness(t, testState(), Options{MaxInFlightPerEndpoint: 1})
	if h.srv.Saturated(time.Now())["alpha"] {
		t.Fatal("idle pool reported saturated")
	}
	for i := 0; i < 3; i++ {
		openAndPick(t, h, "llama")
	}
	if sat := h.srv.Saturated(time.Now()); !sat["alpha"] || sat["beta"] {
		t.Errorf("saturation %v: want alpha only", sat)
	}
	s := h.duplex()
	s.send(postHeaders("/v1/completions"))
	s.send(reqBody([]byte(`{"model":"bulk"}`), true))
	immediateOf(t, s.recv(), 429)
}

func TestInFlightReleasedExactlyOnce(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	t.Run("response end of stream", func(t *testing.T) {
		s, _ := openAndPick(t, h, "llama")
		s.send(respHeaders(false, ":status", "200"))
		s.recv()
		s.send(respBody([]byte("x"), true))
		s.recv()
		h.waitInFlight(0)
		s.c.CloseSend()
		if _, err := s.c.Recv(); !errors.Is(err, io.EOF) {
			t.Errorf("recv after close: %v", err)
		}
		if h.inFlight() != 0 {
			t.Errorf("double release: in-flight %d", h.inFlight())
		}
	})
	t.Run("stream closed mid-response", func(t *testing.T) {
		s, _ := openAndPick(t, h, "llama")
		s.send(respHeaders(false, ":status", "200"))
		s.recv()
		if h.inFlight() != 1 {
			t.Fatalf("in-flight %d", h.inFlight())
		}
		s.c.CloseSend()
		h.waitInFlight(0)
	})
	t.Run("client cancel", func(t *testing.T) {
		s, _ := openAndPick(t, h, "llama")
		if h.inFlight() != 1 {
			t.Fatalf("in-flight %d", h.inFlight())
		}
		s.cancel()
		h.waitInFlight(0)
	})
	t.Run("cancel while body held", func(t *testing.T) {
		s := h.duplex()
		s.send(postHeaders("/v1/completions"))
		s.send(reqBody([]byte(`{"model":"llama",`), false))
		s.cancel()
		h.waitInFlight(0)
		if _, tok := h.srv.InFlight(); tok != 0 {
			t.Errorf("tokens %d", tok)
		}
	})
}

func TestServedEndpointRecorded(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s, dest := openAndPick(t, h, "llama")
	fallback := dest[1]
	s.send(withMetadata(respHeaders(false, ":status", "200"), MetadataNamespace, MetadataServed, structpb.NewStringValue(fallback)))
	s.recv()
	st := h.srv.Stats()
	if st.FallbackServed != 1 {
		t.Errorf("fallback served %d", st.FallbackServed)
	}
	for _, e := range st.Endpoints {
		want := int64(0)
		if e.Address == fallback {
			want = 1
		}
		if e.Served != want || e.InFlightRequests != want {
			t.Errorf("%s: served %d in-flight %d, want %d (accounting moves to the serving endpoint)", e.Address, e.Served, e.InFlightRequests, want)
		}
	}
	s.send(respBody(nil, true))
	s.recv()
	h.waitInFlight(0)
}

func TestCountersSurviveRebuild(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	s, dest := openAndPick(t, h, "llama")
	st := testState()
	st.Version = 2
	st.Pools["alpha"].Endpoints = append(st.Pools["alpha"].Endpoints, registry.Endpoint{Address: "10.0.0.4:8000"})
	h.pub.Publish(st)
	testutil.Eventually(t, 5*time.Second, "state v2 applied", func() error {
		if v := h.srv.Stats().Version; v != 2 {
			return fmt.Errorf("version %d", v)
		}
		return nil
	})
	if h.inFlight() != 1 {
		t.Fatalf("in-flight %d after rebuild, want 1", h.inFlight())
	}
	for _, e := range h.srv.Stats().Endpoints {
		if e.Address == dest[0] && e.InFlightRequests != 1 {
			t.Errorf("%s lost its counter", e.Address)
		}
	}
	s.send(respHeaders(true, ":status", "204"))
	s.recv()
	h.waitInFlight(0)
}

func TestConcurrentStreams(t *testing.T) {
	h := newHarness(t, testState(), Options{})
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs <- oneRequest(h, i)
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	h.waitInFlight(0)
	var picked int64
	for _, e := range h.srv.Stats().Endpoints {
		picked += e.Picked
	}
	if picked != n {
		t.Errorf("picked %d, want %d", picked, n)
	}
}

// oneRequest runs a full rewritten request/response exchange without
// testing.T (it runs on its own goroutine).
func oneRequest(h *harness, i int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := h.client.Process(ctx)
	if err != nil {
		return err
	}
	body := chatBody("chat", 1000+i)
	msgs := []*extprocv3.ProcessingRequest{postHeaders("/v1/chat/completions"), reqBody(body[:7], false), reqBody(body[7:], true)}
	msgs[0].ProtocolConfig = &extprocv3.ProtocolConfiguration{
		RequestBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	for _, m := range msgs {
		if err := c.Send(m); err != nil {
			return err
		}
	}
	r, err := c.Recv()
	if err != nil {
		return err
	}
	if r.GetRequestHeaders() == nil {
		return fmt.Errorf("request %d: want headers response, got %v", i, r)
	}
	var got []byte
	for {
		r, err := c.Recv()
		if err != nil {
			return err
		}
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		got = append(got, sr.GetBody()...)
		if sr.GetEndOfStream() {
			break
		}
	}
	if want := bytes.Replace(body, []byte(`"chat"`), []byte(`"llama-3-8b-instruct"`), 1); !bytes.Equal(got, want) {
		return fmt.Errorf("request %d: body mismatch", i)
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		respHeaders(false, ":status", "200", "content-type", "text/event-stream"),
		respBody([]byte("data: {\"model\":\"llama-3-8b-instruct\"}\n\n"), true),
	} {
		if err := c.Send(m); err != nil {
			return err
		}
		if _, err := c.Recv(); err != nil {
			return err
		}
	}
	return c.CloseSend()
}

func TestHealthServices(t *testing.T) {
	h := newHarness(t, registry.Empty(), Options{})
	hc := healthpb.NewHealthClient(h.conn)
	check := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatalf("health %q: %v", svc, err)
		}
		return r.GetStatus()
	}
	if check(HealthLiveness) != healthpb.HealthCheckResponse_SERVING {
		t.Error("liveness must always serve")
	}
	for _, svc := range []string{HealthReadiness, HealthExtProc, ""} {
		if got := check(svc); got != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Errorf("%q before any pool: %v", svc, got)
		}
	}
	// No pools: requests get 503.
	s := h.duplex()
	s.send(reqHeaders(true, ":method", "GET", ":path", "/health"))
	immediateOf(t, s.recv(), 503)

	h.pub.Publish(testState())
	for _, svc := range []string{HealthReadiness, HealthExtProc, ""} {
		testutil.Eventually(t, 5*time.Second, svc+" serving", func() error {
			if got := check(svc); got != healthpb.HealthCheckResponse_SERVING {
				return fmt.Errorf("%v", got)
			}
			return nil
		})
	}
}

// TestHoldReadiness: a held picker reports NOT_SERVING whatever states it
// gets, serves once released, and a drain wins over a release.
func TestHoldReadiness(t *testing.T) {
	s := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	status := func() healthpb.HealthCheckResponse_ServingStatus {
		r, err := s.Health().Check(context.Background(), &healthpb.HealthCheckRequest{Service: HealthReadiness})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetStatus()
	}
	if got := status(); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("with pools and no hold: %v", got)
	}
	s.HoldReadiness()
	s.apply(testState())
	if got := status(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("held, after a new state: %v, want NOT_SERVING", got)
	}
	s.ReleaseReadiness()
	if got := status(); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("released: %v, want SERVING", got)
	}
	s.HoldReadiness()
	s.Drain()
	s.ReleaseReadiness()
	if got := status(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("released while draining: %v, want NOT_SERVING", got)
	}
}
