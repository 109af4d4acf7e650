package sidecar

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
)

const model = "meta-llama/Meta-Llama-3-8B-Instruct"

// sim is a vllm-sim process.
type sim struct {
	addr string
}

func startSim(t testing.TB, args ...string) *sim {
	t.Helper()
	bin := testutil.Binary(t, "vllm-sim")
	addr := testutil.FreeAddr(t)
	_, port, _ := strings.Cut(addr, ":")
	testutil.Start(t, "vllm-sim "+addr, bin, append([]string{"-port", port, "-time-scale", "20"}, args...)...)
	testutil.WaitHTTP(t, "http://"+addr+"/health", 10*time.Second)
	return &sim{addr: addr}
}

// metric returns the sum of a family's samples (histograms: their sums)
// on the server's /metrics page.
func (s *sim) metric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + s.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	total := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		n, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(n, '{'); i >= 0 {
			n = n[:i]
			rest = line[strings.LastIndexByte(line, '}')+2:]
		}
		if n != name && n != name+"_sum" {
			continue
		}
		v, err := strconv.ParseFloat(strings.Fields(rest)[0], 64)
		if err == nil {
			total += v
		}
	}
	return total
}

// pair is a prefill sim, a decode sim and a sidecar in front of the decode.
type pair struct {
	p, d    *sim
	h       *Handler
	sidecar *httptest.Server
}

func newPair(t *testing.T, cfg Config, pArgs, dArgs []string) *pair {
	t.Helper()
	p := startSim(t, append([]string{"-kv-connector", "NixlConnector"}, pArgs...)...)
	d := startSim(t, append([]string{"-kv-connector", "NixlConnector"}, dArgs...)...)
	cfg.Decoder = &url.URL{Scheme: "http", Host: d.addr}
	if cfg.Allowed == nil && cfg.Signer == nil {
		cfg.Allowed = func(hp string) bool { return hp == p.addr }
	}
	h, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &pair{p: p, d: d, h: h, sidecar: srv}
}

type answer struct {
	code   int
	header http.Header
	body   []byte
}

func (pr *pair) post(t *testing.T, path string, hdr map[string]string, body any) answer {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, pr.sidecar.URL+path, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, out}
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// usageOf returns the usage of a JSON answer, or of the last event of a
// stream that has one; it fails on more than one usage in a stream.
func usageOf(t *testing.T, a answer) usage {
	t.Helper()
	var u *usage
	if !bytes.HasPrefix(a.body, []byte("data: ")) {
		var c struct{ Usage *usage }
		if err := json.Unmarshal(a.body, &c); err != nil || c.Usage == nil {
			t.Fatalf("answer without usage: %s", a.body)
		}
		return *c.Usage
	}
	for _, line := range strings.Split(string(a.body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Usage *usage
			Error any
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
			t.Fatalf("bad event %q in %s", data, a.body)
		}
		if c.Usage != nil {
			if u != nil {
				t.Fatalf("two usage events in %s", a.body)
			}
			u = c.Usage
		}
	}
	if u == nil {
		t.Fatalf("stream without usage: %s", a.body)
	}
	if !strings.HasSuffix(string(a.body), "data: [DONE]\n\n") {
		t.Errorf("stream does not end with [DONE]: %q", a.body)
	}
	return *u
}

func words(prefix string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", prefix, i)
	}
	return b.String()
}

func TestSplitCompletionsAndChat(t *testing.T) {
	pr := newPair(t, Config{}, nil, nil)
	hdr := map[string]string{pd.PrefillerHeader: pr.p.addr}

	prompt := words("a", 600)
	a := pr.post(t, "/v1/completions", hdr, map[string]any{"model": model, "prompt": prompt, "max_tokens": 8})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "split" {
		t.Fatalf("completions: %d %s %s", a.code, a.header.Get(pd.ResultHeader), a.body)
	}
	if got := a.header.Get("x-served-by"); got != pr.d.addr {
		t.Errorf("answered by %s, want the decode server %s", got, pr.d.addr)
	}
	u := usageOf(t, a)
	if u.PromptTokens != 600 || u.CompletionTokens != 8 {
		t.Errorf("usage %+v, want the client's 600 prompt and 8 completion tokens", u)
	}
	// The prefill ran the prompt; the decode server received its KV.
	if got := pr.p.metric(t, "vllm:prompt_tokens_total"); got != 600 {
		t.Errorf("prefill server saw %v prompt tokens, want 600", got)
	}
	if got := pr.d.metric(t, "vllm:external_prefix_cache_hits_total"); got != 600 {
		t.Errorf("decode server received %v tokens of KV, want 600", got)
	}

	// Chat, streamed with usage: the answer streams through, usage once.
	msgs := []map[string]any{{"role": "user", "content": words("b", 500)}}
	a = pr.post(t, "/v1/chat/completions", hdr, map[string]any{"model": model, "messages": msgs, "max_completion_tokens": 6,
		"min_tokens": 2, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "split" || !strings.HasPrefix(a.header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("chat stream: %d %v %s", a.code, a.header, a.body)
	}
	if u := usageOf(t, a); u.CompletionTokens != 6 || u.PromptTokens < 500 {
		t.Errorf("chat usage %+v, want 6 completion tokens and the whole prompt once", u)
	}
	if n := strings.Count(string(a.body), `"content":"`); n < 6 {
		t.Errorf("stream has %d content deltas, want the 6 tokens: %s", n, a.body)
	}
	if got := pr.d.metric(t, "vllm:external_prefix_cache_hits_total"); got < 1100 {
		t.Errorf("decode server received %v tokens of KV over two requests, want both prompts (over 1100)", got)
	}
	if c := pr.h.Counters(); c.Split != 2 || c.Fallback != 0 {
		t.Errorf("counters %+v, want 2 splits", c)
	}
	resp, err := http.Get(pr.sidecar.URL + MetricsPath)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`pd_sidecar_requests_total{result="split"} 2`, `pd_sidecar_requests_total{result="fallback"} 0`, "pd_sidecar_refused_total 0"} {
		if !strings.Contains(string(page), want) {
			t.Errorf("%s lacks %q:\n%s", MetricsPath, want, page)
		}
	}
}

func TestPrefillFailureFallsBackToLocalDecode(t *testing.T) {
	// The prefill server answers every request with an error.
	pr := newPair(t, Config{}, []string{"-error-rate", "1", "-error-codes", "503"}, nil)
	prompt := words("c", 300)
	for _, stream := range []bool{false, true} {
		a := pr.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: pr.p.addr},
			map[string]any{"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream, "stream_options": map[string]any{"include_usage": true}})
		if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "fallback" {
			t.Fatalf("stream=%v: %d %s %s", stream, a.code, a.header.Get(pd.ResultHeader), a.body)
		}
		if u := usageOf(t, a); u.PromptTokens != 300 || u.CompletionTokens != 4 {
			t.Errorf("stream=%v: usage %+v", stream, u)
		}
	}
	if got := pr.d.metric(t, "vllm:external_prefix_cache_hits_total"); got != 0 {
		t.Errorf("decode server received %v tokens of KV, want none (it prefilled itself)", got)
	}

	// An unreachable prefill server: the same.
	dead := testutil.FreeAddr(t)
	pr2 := newPair(t, Config{AllowAny: true, PrefillTimeout: 2 * time.Second}, nil, nil)
	a := pr2.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: dead}, map[string]any{"model": model, "prompt": prompt, "max_tokens": 3})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "fallback" {
		t.Fatalf("dead prefill server: %d %s %s", a.code, a.header.Get(pd.ResultHeader), a.body)
	}
	// A client error stays the client's: the decode server's own 400.
	a = pr2.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: pr2.p.addr}, map[string]any{"model": model, "prompt": prompt, "max_tokens": 9000})
	if a.code != http.StatusBadRequest || !strings.Contains(string(a.body), `"type":"BadRequestError"`) {
		t.Errorf("too long a request: %d %s; want the decode server's 400", a.code, a.body)
	}
}

func TestKVGoneBeforeDecodeFallsBack(t *testing.T) {
	// The prefill drops its blocks at once: the decode's pull fails and
	// vLLM's default policy fails the request; the sidecar reruns it.
	pr := newPair(t, Config{}, []string{"-kv-lease-duration", "1ns"}, nil)
	prompt := words("d", 400)
	for _, stream := range []bool{false, true} {
		a := pr.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: pr.p.addr},
			map[string]any{"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream, "stream_options": map[string]any{"include_usage": true}})
		if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "fallback" {
			t.Fatalf("stream=%v: %d %s %s", stream, a.code, a.header.Get(pd.ResultHeader), a.body)
		}
		if u := usageOf(t, a); u.PromptTokens != 400 || u.CompletionTokens != 4 {
			t.Errorf("stream=%v: usage %+v", stream, u)
		}
	}
	if c := pr.h.Counters(); c.Fallback != 2 || c.Split != 0 {
		t.Errorf("counters %+v, want 2 fallbacks", c)
	}
}

func TestClientCannotChoosePrefillServer(t *testing.T) {
	var evilHits atomic.Int32
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { evilHits.Add(1) }))
	defer evil.Close()
	evilAddr := strings.TrimPrefix(evil.URL, "http://")

	// An allow-list: a server not on it is never contacted.
	pr := newPair(t, Config{}, nil, nil)
	prompt := words("e", 200)
	a := pr.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: evilAddr}, map[string]any{"model": model, "prompt": prompt, "max_tokens": 2})
	if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != "local" || evilHits.Load() != 0 {
		t.Errorf("unlisted prefill server: %d %s, %d contacts", a.code, a.header.Get(pd.ResultHeader), evilHits.Load())
	}
	// llm-d's comma list: the first allowed entry is used.
	a = pr.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: evilAddr + ", " + pr.p.addr}, map[string]any{"model": model, "prompt": prompt, "max_tokens": 2})
	if a.header.Get(pd.ResultHeader) != "split" || evilHits.Load() != 0 {
		t.Errorf("comma list: %s, %d contacts of the unlisted server", a.header.Get(pd.ResultHeader), evilHits.Load())
	}

	// A signing key: only a signed choice is followed.
	signer, err := pd.NewSigner([]byte("0123456789abcdef-test"))
	if err != nil {
		t.Fatal(err)
	}
	ps := newPair(t, Config{Signer: signer, AllowAny: true}, nil, nil)
	for _, c := range []struct {
		desc, named, sig, want string
	}{
		{"unsigned", ps.p.addr, "", "local"},
		{"signed", ps.p.addr, signer.Sign(ps.p.addr), "split"},
		{"signature of another server", evilAddr, signer.Sign(ps.p.addr), "local"},
		{"forged", evilAddr, "v1.1.AAAA", "local"},
	} {
		a := ps.post(t, "/v1/completions", map[string]string{pd.PrefillerHeader: c.named, pd.SignatureHeader: c.sig},
			map[string]any{"model": model, "prompt": prompt, "max_tokens": 2})
		if a.code != http.StatusOK || a.header.Get(pd.ResultHeader) != c.want {
			t.Errorf("%s: %d %s, want 200 %s", c.desc, a.code, a.header.Get(pd.ResultHeader), c.want)
		}
	}
	if evilHits.Load() != 0 {
		t.Errorf("the unlisted server was contacted %d times", evilHits.Load())
	}
}

func TestHeadersStrippedAndOtherPathsProxied(t *testing.T) {
	var seen atomic.Value
	decoder := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Store(r.Header.Clone())
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path":%q}`, r.URL.Path)
	}))
	defer decoder.Close()
	u, _ := url.Parse(decoder.URL)
	h, err := New(Config{Decoder: u, AllowAny: true})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, path := range []string{"/metrics", "/v1/models", "/v1/completions"} {
		method := http.MethodGet
		if path == "/v1/completions" {
			method = http.MethodPost
		}
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(`{}`))
		req.Header.Set(pd.PrefillerHeader, "")
		req.Header.Set(pd.SignatureHeader, "v1.1.x")
		req.Header.Set("x-kv-cache-source-host-port", "10.0.0.9:8000")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), path) {
			t.Errorf("%s %s: %d %s", method, path, resp.StatusCode, b)
		}
		got := seen.Load().(http.Header)
		for _, k := range pd.ClientHeaders {
			if _, ok := got[http.CanonicalHeaderKey(k)]; ok {
				t.Errorf("%s: the decode server saw %s", path, k)
			}
		}
	}

	// Decode server down: a 502 in OpenAI's shape.
	decoder.Close()
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var e struct {
		Error struct {
			Message string
			Type    string
			Code    int
		}
	}
	if resp.StatusCode != http.StatusBadGateway || json.Unmarshal(b, &e) != nil || e.Error.Code != http.StatusBadGateway || e.Error.Message == "" {
		t.Errorf("decode server down: %d %s", resp.StatusCode, b)
	}
}

func TestNewRequiresATrustPolicy(t *testing.T) {
	u, _ := url.Parse("http://127.0.0.1:1")
	if _, err := New(Config{Decoder: u}); err == nil {
		t.Error("New accepted a sidecar that trusts no and every prefill server alike")
	}
	if _, err := New(Config{AllowAny: true}); err == nil {
		t.Error("New accepted a sidecar without a decode server")
	}
}
