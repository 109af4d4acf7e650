package picker

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/registry"
)

// usageLog is a tenant.Recorder for tests.
type usageLog struct {
	mu  sync.Mutex
	all []tenant.Usage
}

func (l *usageLog) Record(u tenant.Usage) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all = append(l.all, u)
}

func (l *usageLog) wait(t *testing.T, n int) []tenant.Usage {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		l.mu.Lock()
		out := append([]tenant.Usage(nil), l.all...)
		l.mu.Unlock()
		if len(out) >= n {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d usage records, want %d: %+v", len(out), n, out)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func tenantState(limits registry.Limits) *registry.State {
	st := testState()
	prio := 4
	st.Tenants = map[string]*registry.Tenant{
		"team-a": {Name: "team-a", KeyHashes: []string{apikey.Hash("key-a")}, Models: []string{"llama", "chat"}, Priority: &prio, Limits: limits},
		"team-b": {Name: "team-b", KeyHashes: []string{apikey.Hash("key-b")}},
	}
	return st
}

// setOf returns a header mutation's set headers as a map.
func setOf(hm *extprocv3.HeaderMutation) map[string]string {
	out := map[string]string{}
	for _, h := range hm.GetSetHeaders() {
		out[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	return out
}

func TestTenantAuthentication(t *testing.T) {
	log := &usageLog{}
	h := newHarness(t, tenantState(registry.Limits{}), Options{Usage: log})
	for _, tc := range []struct {
		desc    string
		headers []string
		msg     string
	}{
		{"no key", nil, "no API key"},
		{"unknown key", []string{"authorization", "Bearer key-zzz"}, "the API key is not valid"},
		{"basic auth", []string{"authorization", "Basic a2V5LWE="}, "the Authorization header must use the Bearer scheme"},
		{"two different keys", []string{"authorization", "Bearer key-a", "x-api-key", "key-b"}, "the request carries more than one API key"},
	} {
		s := h.duplex()
		s.send(postHeaders("/v1/chat/completions", tc.headers...))
		body := immediateOf(t, s.recv(), 401)
		want := `{"error":{"message":"` + tc.msg
		if !strings.HasPrefix(body, want) || !strings.Contains(body, `"type":"authentication_error","code":401}}`) {
			t.Errorf("%s: body %s, want %s...authentication_error", tc.desc, body, want)
		}
		if strings.Contains(body, "key-zzz") || strings.Contains(body, "a2V5") {
			t.Errorf("%s: the reply echoes the client's key: %s", tc.desc, body)
		}
		if _, err := s.c.Recv(); !errors.Is(err, io.EOF) {
			t.Errorf("%s: stream should end after 401, got %v", tc.desc, err)
		}
	}
	if got := h.srv.Stats().Rejected[401]; got != 4 {
		t.Errorf("401 counter %d", got)
	}
	// A good key: picked, the client's key headers removed.
	for _, hdr := range [][]string{{"authorization", "Bearer key-a"}, {"x-api-key", "key-a"}} {
		s := h.duplex()
		body := chatBody("llama", 10)
		s.send(postHeaders("/v1/chat/completions", hdr...))
		s.send(reqBody(body, true))
		d := decisionOf(t, s.recv())
		if !containsStr(d.remove, hdr[0]) {
			t.Errorf("%s not removed: remove=%v", hdr[0], d.remove)
		}
		if _, ok := d.set["authorization"]; ok {
			t.Error("authorization set without an upstream key")
		}
	}
	if n := len(h.srv.Stats().Rejected); n != 1 {
		t.Errorf("rejections besides the 401s: %v", h.srv.Stats().Rejected)
	}
}

func TestTenantModelsAndHiding(t *testing.T) {
	st := tenantState(registry.Limits{})
	h := newHarness(t, st, Options{})
	s := h.duplex()
	s.send(postHeaders("/v1/completions", "x-api-key", "key-a"))
	s.send(reqBody([]byte(`{"model":"bulk","prompt":"x"}`), true))
	body := immediateOf(t, s.recv(), 403)
	if want := `{"error":{"message":"tenant \"team-a\" may not use model \"bulk\"","type":"permission_error","code":403}}`; body != want {
		t.Errorf("403 body %s\nwant %s", body, want)
	}
	// team-b may use every model.
	s = h.duplex()
	s.send(postHeaders("/v1/completions", "x-api-key", "key-b"))
	s.send(reqBody([]byte(`{"model":"bulk","prompt":"x"}`), true))
	decisionOf(t, s.recv())
	// The model list shows a tenant what it may use.
	s = h.duplex()
	s.send(reqHeaders(true, ":method", "GET", ":path", "/v1/models", "x-api-key", "key-a"))
	list := string(s.recv().GetImmediateResponse().GetBody())
	if !strings.Contains(list, `"id":"chat"`) || !strings.Contains(list, `"id":"llama"`) || strings.Contains(list, "bulk") {
		t.Errorf("team-a's model list %s", list)
	}
	// Hidden: a forbidden model is answered as if it did not exist.
	st = tenantState(registry.Limits{})
	st.TenantSettings.HideForbiddenModels = true
	h.pub.Publish(st)
	waitFor(t, "hide applied", func() bool { return h.srv.snap.Load().tenants.Hide })
	s = h.duplex()
	s.send(postHeaders("/v1/completions", "x-api-key", "key-a"))
	s.send(reqBody([]byte(`{"model":"bulk","prompt":"x"}`), true))
	if body := immediateOf(t, s.recv(), 404); body != `{"error":{"message":"model \"bulk\" does not exist","type":"not_found_error","code":404}}` {
		t.Errorf("hidden 404 body %s", body)
	}
}

// Usage of a request for a model nobody declared (404) is filed under
// "other", as every undeclared name is, not under "".
func TestTenantUsageOfUnknownModel(t *testing.T) {
	log := &usageLog{}
	h := newHarness(t, tenantState(registry.Limits{}), Options{Usage: log})
	s := h.duplex()
	s.send(postHeaders("/v1/completions", "x-api-key", "key-b"))
	s.send(reqBody([]byte(`{"model":"nope","prompt":"x"}`), true))
	immediateOf(t, s.recv(), 404)
	s.cancel()
	if u := log.wait(t, 1)[0]; u.Tenant != "team-b" || u.Model != "other" || u.Requests != 1 || u.Errors != 1 {
		t.Errorf("usage %+v, want team-b/other with 1 request and 1 error", u)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestTenantRateLimitAndHeaders(t *testing.T) {
	log := &usageLog{}
	h := newHarness(t, tenantState(registry.Limits{RequestsPerMinute: 2, TokensPerMinute: 100000}), Options{Usage: log})
	for i := range 2 {
		s := h.duplex()
		s.send(postHeaders("/v1/completions", "x-api-key", "key-a"))
		s.send(reqBody([]byte(`{"model":"llama","prompt":"hello","max_tokens":10}`), true))
		decisionOf(t, s.recv())
		s.readStreamedRequestBody()
		s.send(respHeaders(false, ":status", "200", "content-type", "application/json"))
		hdrs := setOf(s.recv().GetResponseHeaders().GetResponse().GetHeaderMutation())
		if hdrs["x-ratelimit-limit-requests"] != "2" || hdrs["x-ratelimit-remaining-requests"] != []string{"1", "0"}[i] ||
			hdrs["x-ratelimit-limit-tokens"] != "100000" || hdrs["x-ratelimit-reset-requests"] == "" {
			t.Errorf("response %d rate-limit headers %v", i, hdrs)
		}
		s.send(respBody([]byte(`{"model":"llama","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}`), true))
		s.recv()
	}
	s := h.duplex()
	s.send(postHeaders("/v1/completions", "authorization", "Bearer key-a"))
	s.send(reqBody([]byte(`{"model":"llama","prompt":"hello"}`), true))
	r := s.recv()
	body := immediateOf(t, r, 429)
	if !strings.Contains(body, `tenant \"team-a\" is over its requests_per_minute limit (2;`) || !strings.Contains(body, `"type":"rate_limit_exceeded"`) {
		t.Errorf("429 body %s", body)
	}
	hdrs := setOf(r.GetImmediateResponse().GetHeaders())
	if ra := hdrs["retry-after"]; ra != "60" && ra != "61" {
		t.Errorf("retry-after %q, want 60 or 61", ra)
	}
	if hdrs["x-ratelimit-remaining-requests"] != "0" || hdrs["x-ratelimit-limit-requests"] != "2" {
		t.Errorf("429 rate-limit headers %v", hdrs)
	}
	recs := log.wait(t, 3)
	for i, u := range recs[:2] {
		if u.Tenant != "team-a" || u.Model != "llama" || u.Requests != 1 || u.Errors != 0 || u.PromptTokens != 7 || u.CachedTokens != 4 || u.CompletionTokens != 10 {
			t.Errorf("usage %d: %+v", i, u)
		}
	}
	if u := recs[2]; u.Errors != 1 || u.PromptTokens != 0 {
		t.Errorf("429's usage %+v", u)
	}
	// Tokens were settled to the reported usage (count_cached false: 17-4).
	if used := h.srv.snap.Load().tenants.Tenant("team-a").Used(time.Now())["tokens_per_minute"]; used != 2*13 {
		t.Errorf("tokens used %d, want %d", used, 2*13)
	}
}

func TestTenantStreamUsageChunkRequestedAndStripped(t *testing.T) {
	log := &usageLog{}
	h := newHarness(t, tenantState(registry.Limits{TokensPerMinute: 1000000, CountCached: true}), Options{Usage: log})
	s := h.duplex()
	s.send(postHeaders("/v1/chat/completions", "authorization", "Bearer key-a"))
	s.send(reqBody([]byte(`{"model":"chat","messages":[{"role":"user","content":"hi"}],"stream":true}`), true))
	decisionOf(t, s.recv())
	up, _ := s.readStreamedRequestBody()
	if want := `{"stream_options":{"include_usage":true},"model":"llama-3-8b-instruct","messages":[{"role":"user","content":"hi"}],"stream":true}`; string(up) != want {
		t.Fatalf("upstream body %s\nwant %s", up, want)
	}
	s.send(respHeaders(false, ":status", "200", "content-type", "text/event-stream", "content-length", "999"))
	hm := s.recv().GetResponseHeaders().GetResponse().GetHeaderMutation()
	if !containsStr(hm.GetRemoveHeaders(), "content-length") {
		t.Errorf("content-length kept although the stream is shortened: %v", hm.GetRemoveHeaders())
	}
	stream := "data: {\"model\":\"llama-3-8b-instruct\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
		"data: {\"model\":\"llama-3-8b-instruct\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n" +
		"data: [DONE]\n\n"
	s.send(respBody([]byte(stream[:30]), false))
	s.send(respBody([]byte(stream[30:]), false))
	s.send(respBody(nil, true))
	got, _ := s.streamedResponseBody()
	if want := "data: {\"model\":\"chat\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n"; got != want {
		t.Fatalf("client stream %q\nwant %q", got, want)
	}
	u := log.wait(t, 1)[0]
	if u.Model != "chat" || u.PromptTokens != 12 || u.CachedTokens != 8 || u.CompletionTokens != 1 || u.Errors != 0 {
		t.Errorf("usage %+v", u)
	}
	if used := h.srv.snap.Load().tenants.Tenant("team-a").Used(time.Now())["tokens_per_minute"]; used != 13 {
		t.Errorf("tokens used %d, want 13 (count_cached)", used)
	}
}

func TestUpstreamKeyReplacesClientKey(t *testing.T) {
	for _, tenants := range []bool{false, true} {
		st := testState()
		if tenants {
			st = tenantState(registry.Limits{})
		}
		st.Pools["alpha"].UpstreamAPIKey = "pool-secret"
		h := newHarness(t, st, Options{})
		s := h.duplex()
		s.send(postHeaders("/v1/completions", "authorization", "Bearer key-a"))
		s.send(reqBody([]byte(`{"model":"llama","prompt":"x"}`), true))
		d := decisionOf(t, s.recv())
		if d.set["authorization"] != "Bearer pool-secret" || containsStr(d.remove, "authorization") {
			t.Errorf("tenants %v: set %v remove %v", tenants, d.set, d.remove)
		}
	}
	// Without tenants or an upstream key the client's header goes on, as
	// before tenants existed.
	h := newHarness(t, testState(), Options{})
	s := h.duplex()
	s.send(postHeaders("/v1/completions", "authorization", "Bearer anything"))
	s.send(reqBody([]byte(`{"model":"llama","prompt":"x"}`), true))
	d := decisionOf(t, s.recv())
	if containsStr(d.remove, "authorization") || d.set["authorization"] != "" {
		t.Errorf("without tenants: set %v remove %v", d.set, d.remove)
	}
}

// TestRevokedKeyRefusedOnNextState: a state without the key makes the
// very next request fail (the latency from a file edit is measured end to
// end in cmd/switchyard).
func TestRevokedKeyRefusedOnNextState(t *testing.T) {
	h := newHarness(t, tenantState(registry.Limits{}), Options{})
	st := tenantState(registry.Limits{})
	st.Version = 2
	st.Tenants["team-a"].KeyHashes = nil
	start := time.Now()
	h.pub.Publish(st)
	waitFor(t, "key revoked", func() bool { return h.srv.snap.Load().tenants.Authenticate([]byte("key-a")) == nil })
	t.Logf("state applied %v after publish", time.Since(start))
	s := h.duplex()
	s.send(postHeaders("/v1/completions", "x-api-key", "key-a"))
	immediateOf(t, s.recv(), 401)
}

// streamedResponseBody receives duplex response body answers until
// end_of_stream, returning the bytes sent to the client.
func (s *extStream) streamedResponseBody() (string, int) {
	s.t.Helper()
	var b strings.Builder
	n := 0
	for {
		r := s.recv()
		sr := r.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			s.t.Fatalf("want a streamed response body answer, got %v", r)
		}
		b.Write(sr.GetBody())
		n++
		if sr.GetEndOfStream() {
			return b.String(), n
		}
	}
}

// TestTenantAdmitOncePerRequest: a request picked twice (the admission
// queue picks again once it lets a request go) is reserved once, and its
// body asks for usage both times.
func TestTenantAdmitOncePerRequest(t *testing.T) {
	h := newHarness(t, tenantState(registry.Limits{RequestsPerMinute: 10, TokensPerMinute: 100000}), Options{})
	snap := h.srv.snap.Load()
	tn := snap.tenants.Tenant("team-a")
	st := h.srv.newStream(context.Background())
	st.ten = tenantReq{tab: snap.tenants, t: tn}
	st.clientModel, st.path = "llama", []byte("/v1/completions")
	orig := []byte(`{"model":"llama","prompt":"hi","stream":true,"max_tokens":100}`)
	for i := range 2 {
		body := orig
		if code, msg := st.tenantAdmit(snap, &body); code != 0 {
			t.Fatalf("pick %d: %d %s", i, code, msg)
		}
		if !strings.HasPrefix(string(body), `{"stream_options":{"include_usage":true},`) {
			t.Fatalf("pick %d: body %s", i, body)
		}
	}
	used := tn.Used(time.Now())
	if used["requests_per_minute"] != 1 || used["tokens_per_minute"] != openai.EstimateTokens(orig)+100 {
		t.Fatalf("after two picks of one request: %v", used)
	}
}

// A tenant's request is read as the engine reads it: "stream": "true"
// streams (so the picker asks for its usage chunk) and "max_tokens": "50"
// caps its output (so the picker reserves it).
func TestTenantReadsLaxJSONAsTheEngine(t *testing.T) {
	h := newHarness(t, tenantState(registry.Limits{TokensPerMinute: 100000}), Options{})
	snap := h.srv.snap.Load()
	tn := snap.tenants.Tenant("team-a")
	for i, tc := range []struct {
		path, body string
		reserve    int64 // beyond the prompt estimate
	}{
		{"/v1/completions", `{"model":"llama","prompt":"hi","stream":"true","max_tokens":"50"}`, 50},
		{"/v1/chat/completions", `{"model":"llama","messages":[],"stream":1,"max_tokens":5.0,"max_completion_tokens":"7","n":2}`, 14},
	} {
		st := h.srv.newStream(context.Background())
		st.ten = tenantReq{tab: snap.tenants, t: tn}
		st.clientModel, st.path = "llama", []byte(tc.path)
		before := tn.Used(time.Now())["tokens_per_minute"]
		body := []byte(tc.body)
		if code, msg := st.tenantAdmit(snap, &body); code != 0 {
			t.Fatalf("%d: %d %s", i, code, msg)
		}
		if !strings.HasPrefix(string(body), `{"stream_options":{"include_usage":true},`) || !st.ten.strip {
			t.Errorf("%d: a lax stream is not asked for its usage: %s", i, body)
		}
		if got, want := tn.Used(time.Now())["tokens_per_minute"]-before, openai.EstimateTokens([]byte(tc.body))+tc.reserve; got != want {
			t.Errorf("%d: reserved %d, want %d (the prompt estimate and %d output tokens)", i, got, want, tc.reserve)
		}
	}
}

// A generation that sets no output cap reserves the tenant's
// assumed_max_tokens (default 1024) besides its prompt, so a burst of
// such requests cannot all pass on their prompts alone; an endpoint that
// generates nothing reserves the prompt only.
func TestTenantReservesAssumedMaxTokens(t *testing.T) {
	for _, tc := range []struct {
		assumed int64
		path    string
		want    int64
	}{
		{0, "/v1/chat/completions", registry.DefaultAssumedMaxTokens},
		{300, "/v1/completions", 300},
		{300, "/v1/responses", 300},
		{300, "/v1/embeddings", 0},
	} {
		h := newHarness(t, tenantState(registry.Limits{TokensPerMinute: 100000, AssumedMaxTokens: tc.assumed}), Options{})
		snap := h.srv.snap.Load()
		tn := snap.tenants.Tenant("team-a")
		st := h.srv.newStream(context.Background())
		st.ten = tenantReq{tab: snap.tenants, t: tn}
		st.clientModel, st.path = "llama", []byte(tc.path)
		body := []byte(`{"model":"llama","messages":[{"role":"user","content":"hi"}]}`)
		if code, msg := st.tenantAdmit(snap, &body); code != 0 {
			t.Fatalf("%s: %d %s", tc.path, code, msg)
		}
		if got, want := tn.Used(time.Now())["tokens_per_minute"], openai.EstimateTokens(body)+tc.want; got != want {
			t.Errorf("%s, assumed_max_tokens %d: reserved %d, want %d", tc.path, tc.assumed, got, want)
		}
	}
}
