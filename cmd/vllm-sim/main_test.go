package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/switchyard/switchyard/internal/testutil"
)

const baseModel = "meta-llama/Meta-Llama-3-8B-Instruct"

// sim is one running vllm-sim process.
type simProc struct {
	addr string
	proc *testutil.Process
}

func startSim(t testing.TB, args ...string) *simProc {
	t.Helper()
	bin := testutil.Binary(t, "vllm-sim")
	port := testutil.FreePort(t)
	all := append([]string{"-port", strconv.Itoa(port), "-time-scale", "20"}, args...)
	p := testutil.Start(t, "vllm-sim", bin, all...)
	s := &simProc{addr: fmt.Sprintf("127.0.0.1:%d", port), proc: p}
	testutil.WaitTCP(t, s.addr, 10*time.Second)
	return s
}

func (s *simProc) url(path string) string { return "http://" + s.addr + path }

type reply struct {
	code   int
	header http.Header
	body   []byte
}

func (s *simProc) post(t *testing.T, path string, body any) reply {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case string:
		rd = strings.NewReader(b)
	default:
		js, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(js)
	}
	resp, err := http.Post(s.url(path), "application/json", rd)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: read: %v", path, err)
	}
	return reply{code: resp.StatusCode, header: resp.Header, body: b}
}

func (s *simProc) metrics(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(s.url("/metrics"))
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("metrics do not parse: %v", err)
	}
	return fams
}

// value returns the value of the first sample of a gauge or counter family.
func value(fams map[string]*dto.MetricFamily, name string) float64 {
	f, ok := fams[name]
	if !ok || len(f.GetMetric()) == 0 {
		return -1
	}
	m := f.GetMetric()[0]
	if m.GetCounter() != nil {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}

type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Message      *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta map[string]string `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func decode(t *testing.T, b []byte) completion {
	t.Helper()
	var c completion
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatalf("bad response JSON %s: %v", b, err)
	}
	return c
}

func words(prefix string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", prefix, i)
	}
	return b.String()
}

func TestCompletionsAndChatAPI(t *testing.T) {
	s := startSim(t)

	// hell,o,ther,e,gene,ral,keno,bi: 8 tokens.
	r := s.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": "hello there general kenobi", "max_tokens": 7})
	if r.code != http.StatusOK {
		t.Fatalf("completion: %d %s", r.code, r.body)
	}
	if got := r.header.Get("x-served-by"); got != s.addr {
		t.Fatalf("x-served-by = %q, want %q", got, s.addr)
	}
	c := decode(t, r.body)
	if c.Object != "text_completion" || c.Model != baseModel || c.ID == "" || c.Created == 0 || len(c.Choices) != 1 {
		t.Fatalf("completion envelope: %s", r.body)
	}
	if c.Usage == nil || c.Usage.PromptTokens != 8 || c.Usage.CompletionTokens != 7 || c.Usage.TotalTokens != 15 {
		t.Fatalf("usage: %s", r.body)
	}
	if n := len(strings.Fields(c.Choices[0].Text)); n != 7 || *c.Choices[0].FinishReason != "length" {
		t.Fatalf("text %q (%d words), finish %v", c.Choices[0].Text, n, c.Choices[0].FinishReason)
	}

	r = s.post(t, "/v1/chat/completions", map[string]any{"model": baseModel, "max_completion_tokens": 3,
		"messages": []map[string]any{{"role": "user", "content": []map[string]string{{"type": "text", "text": "hi"}}}}})
	c = decode(t, r.body)
	if r.code != 200 || c.Object != "chat.completion" || c.Choices[0].Message == nil || c.Choices[0].Message.Role != "assistant" || c.Usage.CompletionTokens != 3 {
		t.Fatalf("chat: %d %s", r.code, r.body)
	}

	// min_tokens/ignore_eos are accepted; output length is max_tokens.
	r = s.post(t, "/v1/completions", map[string]any{"model": baseModel, "prompt": "x", "max_tokens": 5, "min_tokens": 5, "ignore_eos": true})
	if c = decode(t, r.body); c.Usage.CompletionTokens != 5 {
		t.Fatalf("min_tokens=max_tokens=5 gave %s", r.body)
	}

	for _, tc := range []struct {
		desc, path string
		body       any
		code       int
	}{
		{"unknown model", "/v1/completions", map[string]any{"model": "nope", "prompt": "x"}, 404},
		{"unknown model chat", "/v1/chat/completions", map[string]any{"model": "nope", "messages": []map[string]string{{"role": "user", "content": "x"}}}, 404},
		{"bad json", "/v1/completions", `{"model":`, 400},
		{"no prompt", "/v1/completions", map[string]any{"model": baseModel}, 400},
		{"no messages", "/v1/chat/completions", map[string]any{"model": baseModel}, 400},
		{"min above max", "/v1/completions", map[string]any{"model": baseModel, "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400},
		{"zero max_tokens", "/v1/completions", map[string]any{"model": baseModel, "prompt": "x", "max_tokens": 0}, 400},
		{"too long", "/v1/completions", map[string]any{"model": baseModel, "prompt": words("w", 8000), "max_tokens": 500}, 400},
	} {
		r := s.post(t, tc.path, tc.body)
		var e struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if r.code != tc.code || json.Unmarshal(r.body, &e) != nil || e.Error.Code != tc.code || e.Error.Message == "" || e.Error.Type == "" {
			t.Errorf("%s: got %d %s, want %d with an OpenAI error body", tc.desc, r.code, r.body, tc.code)
		}
	}
}

func TestStreamingWithUsage(t *testing.T) {
	s := startSim(t)
	for _, chat := range []bool{false, true} {
		body := map[string]any{"model": baseModel, "max_tokens": 4, "stream": true, "stream_options": map[string]bool{"include_usage": true}}
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
			body["messages"] = []map[string]string{{"role": "user", "content": "stream please"}}
		} else {
			body["prompt"] = "stream please"
		}
		r := s.post(t, path, body)
		if r.code != 200 || !strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream") {
			t.Fatalf("chat=%v: %d %q", chat, r.code, r.header.Get("Content-Type"))
		}
		var chunks []completion
		done := false
		sc := bufio.NewScanner(bytes.NewReader(r.body))
		for sc.Scan() {
			line := sc.Text()
			if line == "" {
				continue
			}
			data, ok := strings.CutPrefix(line, "data: ")
			if !ok || done {
				t.Fatalf("chat=%v: unexpected line %q", chat, line)
			}
			if data == "[DONE]" {
				done = true
				continue
			}
			chunks = append(chunks, decode(t, []byte(data)))
		}
		if !done {
			t.Fatalf("chat=%v: no [DONE]", chat)
		}
		want := 4 + 1 // tokens + usage chunk
		if chat {
			want++ // role chunk
		}
		if len(chunks) != want {
			t.Fatalf("chat=%v: %d chunks, want %d:\n%s", chat, len(chunks), want, r.body)
		}
		last := chunks[len(chunks)-1]
		if last.Usage == nil || len(last.Choices) != 0 || last.Usage.CompletionTokens != 4 {
			t.Fatalf("chat=%v: last chunk is not the usage chunk: %+v", chat, last)
		}
		fin := chunks[len(chunks)-2]
		if fin.Choices[0].FinishReason == nil || *fin.Choices[0].FinishReason != "length" {
			t.Fatalf("chat=%v: finish chunk %+v", chat, fin)
		}
		if chat && (chunks[0].Object != "chat.completion.chunk" || chunks[0].Choices[0].Delta["role"] != "assistant") {
			t.Fatalf("first chat chunk %+v", chunks[0])
		}
		for _, c := range chunks {
			if c.Model != baseModel || c.ID != chunks[0].ID {
				t.Fatalf("chunk model/id mismatch: %+v", c)
			}
		}
	}
}

func TestPrefixCachingOverHTTP(t *testing.T) {
	s := startSim(t, "-time-scale", "5")
	system := words("sys", 400)
	ask := func(q string) completion {
		r := s.post(t, "/v1/chat/completions", map[string]any{"model": baseModel, "max_tokens": 2,
			"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": q}}})
		if r.code != 200 {
			t.Fatalf("%d %s", r.code, r.body)
		}
		return decode(t, r.body)
	}
	first := ask("what is one")
	second := ask("what is two")
	if first.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("first request cached %d tokens", first.Usage.PromptTokensDetails.CachedTokens)
	}
	if c := second.Usage.PromptTokensDetails.CachedTokens; c < 400 || c%16 != 0 {
		t.Fatalf("second request cached %d tokens; want the shared system prompt's full blocks", c)
	}
	fams := s.metrics(t)
	if hits := value(fams, "vllm:prefix_cache_hits_total"); hits != float64(second.Usage.PromptTokensDetails.CachedTokens) {
		t.Fatalf("prefix_cache_hits_total = %v", hits)
	}
	// Lower TTFT from the cache shows in the TTFT histogram: the cached
	// request's prefill (~20 tokens) is far cheaper than the first's (~800).
	h := fams["vllm:time_to_first_token_seconds"].GetMetric()[0].GetHistogram()
	if h.GetSampleCount() != 2 {
		t.Fatalf("TTFT samples = %d", h.GetSampleCount())
	}
}

// /tokenize answers the token ids a chat or completion request is
// computed with (a second identical chat request is cached up to them).
func TestTokenizeMatchesGeneration(t *testing.T) {
	s := startSim(t, "-time-scale", "5")
	msgs := []map[string]string{{"role": "system", "content": words("sys", 100)}, {"role": "user", "content": "hello there"}}
	r := s.post(t, "/tokenize", map[string]any{"model": baseModel, "messages": msgs})
	var tok struct {
		Count  int      `json:"count"`
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal([]byte(r.body), &tok); r.code != 200 || err != nil || tok.Count != len(tok.Tokens) || tok.Count == 0 {
		t.Fatalf("tokenize: %d %s (%v)", r.code, r.body, err)
	}
	var c completion
	for range 2 {
		r = s.post(t, "/v1/chat/completions", map[string]any{"model": baseModel, "max_tokens": 1, "messages": msgs})
		c = decode(t, r.body)
	}
	if c.Usage.PromptTokens != tok.Count || c.Usage.PromptTokensDetails.CachedTokens != (tok.Count-1)/16*16 {
		t.Fatalf("usage %+v, tokenize count %d", c.Usage, tok.Count)
	}
	if r := s.post(t, "/tokenize", map[string]any{"model": "nope", "prompt": "x"}); r.code != 404 {
		t.Fatalf("unknown model: %d", r.code)
	}
}

func TestQueueKVAndPreemptionMetrics(t *testing.T) {
	s := startSim(t, "-time-scale", "10", "-max-num-seqs", "4", "-num-gpu-blocks", "40", "-enable-prefix-caching=false")
	var wg sync.WaitGroup
	errs := make(chan error, 12)
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body, _ := json.Marshal(map[string]any{"model": baseModel, "prompt": words(fmt.Sprintf("r%d_", i), 60), "max_tokens": 120})
			resp, err := http.Post(s.url("/v1/completions"), "application/json", bytes.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			var c completion
			if err := json.NewDecoder(resp.Body).Decode(&c); err != nil || resp.StatusCode != 200 || c.Usage.CompletionTokens != 120 {
				errs <- fmt.Errorf("status %d, err %v, usage %+v", resp.StatusCode, err, c.Usage)
			}
		}()
	}
	sawQueue, maxKV := false, 0.0
	testutil.Eventually(t, 30*time.Second, "queue, full KV cache and preemptions", func() error {
		fams := s.metrics(t)
		if value(fams, "vllm:num_requests_waiting") > 0 {
			sawQueue = true
		}
		maxKV = max(maxKV, value(fams, "vllm:kv_cache_usage_perc"))
		if p := value(fams, "vllm:num_preemptions_total"); !sawQueue || maxKV < 0.8 || p < 1 {
			return fmt.Errorf("queue seen %v, max KV %.2f, preemptions %v", sawQueue, maxKV, p)
		}
		return nil
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	fams := s.metrics(t)
	if v := value(fams, "vllm:kv_cache_usage_perc"); v != 0 {
		t.Errorf("KV usage %v after all requests finished", v)
	}
	if v := value(fams, "vllm:num_requests_running"); v != 0 {
		t.Errorf("running %v after all requests finished", v)
	}
}

func TestLoRAAdapters(t *testing.T) {
	s := startSim(t, "-lora-modules", "sql=/adapters/sql,chat", "-max-loras", "2")
	models := func() []string {
		resp, err := http.Get(s.url("/v1/models"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var l struct {
			Data []struct {
				ID string `json:"id"`
			} `json:"data"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, d := range l.Data {
			ids = append(ids, d.ID)
		}
		return ids
	}
	if got := fmt.Sprint(models()); got != "["+baseModel+" sql chat]" {
		t.Fatalf("models = %s", got)
	}
	gen := func(m string) reply {
		return s.post(t, "/v1/completions", map[string]any{"model": m, "prompt": "q", "max_tokens": 2})
	}
	if r := gen("sql"); r.code != 200 || decode(t, r.body).Model != "sql" {
		t.Fatalf("adapter request: %d %s", r.code, r.body)
	}
	if r := gen("news"); r.code != 404 {
		t.Fatalf("unloaded adapter: %d", r.code)
	}
	if r := s.post(t, "/v1/load_lora_adapter", map[string]string{"lora_name": "news", "lora_path": "/a/news"}); r.code != 200 {
		t.Fatalf("load: %d %s", r.code, r.body)
	}
	if r := s.post(t, "/v1/load_lora_adapter", map[string]string{"lora_name": "news", "lora_path": "/a/news"}); r.code != 400 {
		t.Fatalf("second load: %d %s", r.code, r.body)
	}
	if r := gen("news"); r.code != 200 {
		t.Fatalf("loaded adapter: %d %s", r.code, r.body)
	}
	if got := fmt.Sprint(models()); got != "["+baseModel+" sql chat news]" {
		t.Fatalf("models after load = %s", got)
	}
	if r := s.post(t, "/v1/unload_lora_adapter", map[string]string{"lora_name": "sql"}); r.code != 200 {
		t.Fatalf("unload: %d %s", r.code, r.body)
	}
	if r := s.post(t, "/v1/unload_lora_adapter", map[string]string{"lora_name": "sql"}); r.code != 404 {
		t.Fatalf("second unload: %d", r.code)
	}
	if r := gen("sql"); r.code != 404 {
		t.Fatalf("unloaded adapter served: %d", r.code)
	}
	fams := s.metrics(t)
	info := fams["vllm:lora_requests_info"]
	if info == nil || len(info.GetMetric()) == 0 {
		t.Fatal("no vllm:lora_requests_info")
	}
	for _, l := range info.GetMetric()[0].GetLabel() {
		if l.GetName() == "max_lora" && l.GetValue() != "2" {
			t.Fatalf("max_lora = %q", l.GetValue())
		}
	}
}

func TestThirdAdapterWaitsOverHTTP(t *testing.T) {
	s := startSim(t, "-lora-modules", "a,b,c", "-max-loras", "2", "-time-scale", "10")
	var wg sync.WaitGroup
	for _, m := range []string{"a", "b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.post(t, "/v1/completions", map[string]any{"model": m, "prompt": "long one", "max_tokens": 1000})
		}()
	}
	latest := func() (run, wait string) {
		fams := s.metrics(t)
		best := -1.0
		for _, m := range fams["vllm:lora_requests_info"].GetMetric() {
			if v := m.GetGauge().GetValue(); v > best {
				best = v
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "running_lora_adapters":
						run = l.GetValue()
					case "waiting_lora_adapters":
						wait = l.GetValue()
					}
				}
			}
		}
		return run, wait
	}
	testutil.Eventually(t, 10*time.Second, "adapters a and b running", func() error {
		if run, _ := latest(); run != "a,b" && run != "b,a" {
			return fmt.Errorf("running adapters %q", run)
		}
		return nil
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.post(t, "/v1/completions", map[string]any{"model": "c", "prompt": "short", "max_tokens": 2})
	}()
	testutil.Eventually(t, 10*time.Second, "adapter c waiting", func() error {
		if run, wait := latest(); wait != "c" || !strings.Contains(run, "a") {
			return fmt.Errorf("running %q waiting %q", run, wait)
		}
		return nil
	})
	wg.Wait()
	if run, wait := latest(); run != "" || wait != "" {
		t.Fatalf("after all finished: running %q waiting %q", run, wait)
	}
}

func TestFailureInjection(t *testing.T) {
	var genWithin func(*simProc, time.Duration) (int, error)
	gen := func(s *simProc) (int, error) {
		return genWithin(s, 2*time.Second)
	}
	genWithin = func(s *simProc, within time.Duration) (int, error) {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", s.url("/v1/completions"), strings.NewReader(`{"prompt":"x","max_tokens":1}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}

	t.Run("error-rate", func(t *testing.T) {
		s := startSim(t, "-error-rate", "1", "-error-codes", "503")
		for range 3 {
			if code, err := gen(s); err != nil || code != 503 {
				t.Fatalf("got %d %v, want 503", code, err)
			}
		}
		s2 := startSim(t, "-error-rate", "0.5", "-error-codes", "500,429", "-seed", "7")
		codes := map[int]int{}
		for range 40 {
			code, err := gen(s2)
			if err != nil {
				t.Fatal(err)
			}
			codes[code]++
		}
		if codes[200] == 0 || codes[500] == 0 || codes[429] == 0 || len(codes) != 3 {
			t.Fatalf("codes with error-rate 0.5: %v", codes)
		}
	})

	t.Run("startup-delay", func(t *testing.T) {
		s := startSim(t, "-startup-delay", "1500ms")
		resp, err := http.Get(s.url("/health"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 503 {
			t.Fatalf("health during startup = %d, want 503", resp.StatusCode)
		}
		testutil.WaitHTTP(t, s.url("/health"), 10*time.Second)
	})

	t.Run("hang-after", func(t *testing.T) {
		s := startSim(t, "-hang-after", "1")
		if code, err := gen(s); err != nil || code != 200 {
			t.Fatalf("first request: %d %v", code, err)
		}
		if _, err := genWithin(s, 300*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("second request: err %v, want it to hang until the client deadline", err)
		}
	})

	t.Run("crash-after", func(t *testing.T) {
		s := startSim(t, "-crash-after", "2")
		for i := range 2 {
			if code, err := gen(s); err != nil || code != 200 {
				t.Fatalf("request %d: %d %v", i, code, err)
			}
		}
		if _, err := gen(s); err == nil {
			t.Fatal("third request answered; want the process to crash")
		}
		select {
		case <-s.proc.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("process still running after crash-after")
		}
		if code := s.proc.Cmd.ProcessState.ExitCode(); code != 3 {
			t.Fatalf("exit code %d, want 3", code)
		}
	})

	t.Run("graceful-sigterm", func(t *testing.T) {
		s := startSim(t, "-hang-rate", "1", "-log-level", "debug")
		errc := make(chan error, 1)
		go func() { _, err := gen(s); errc <- err }()
		testutil.Eventually(t, 5*time.Second, "request hanging", func() error {
			if !strings.Contains(s.proc.Output(), "injected hang") {
				return errors.New("no hang logged yet")
			}
			return nil
		})
		s.proc.Stop()
		if code := s.proc.Cmd.ProcessState.ExitCode(); code != 0 {
			t.Fatalf("exit code after SIGTERM = %d, want 0\n%s", code, s.proc.Output())
		}
		if err := <-errc; err == nil {
			t.Fatal("hanging request got an answer")
		}
	})
}

func TestFlagErrors(t *testing.T) {
	bin := testutil.Binary(t, "vllm-sim")
	for _, args := range [][]string{
		{"-time-scale", "0"},
		{"-batch-slowdown", "0.5"},
		{"-prefill-time-per-token", "-1us"},
		{"-error-codes", "200"},
		{"-max-num-seqs", "0"},
		{"-lora-modules", "=path"},
		{"-bogus"},
		{"-kv-events-replay-port", "5558"},
		{"-kv-events-port", "5557", "-kv-events-format", "json"},
		{"-kv-events-port", "70000"},
		{"-fleet", "3", "-kv-events-port", "65534"},
	} {
		p := testutil.StartNoCleanup(t, "vllm-sim", bin, append([]string{"-port", "0"}, args...)...)
		select {
		case <-p.Done():
		case <-time.After(5 * time.Second):
			p.Kill()
			t.Fatalf("%v: still running", args)
		}
		if code := p.Cmd.ProcessState.ExitCode(); code != 2 || !strings.Contains(p.Output(), "vllm-sim") {
			t.Errorf("%v: exit %d output %q; want exit 2 with a message", args, code, p.Output())
		}
	}
}

func TestEOSModelAndMinTokens(t *testing.T) {
	s := startSim(t, "-eos-mean-tokens", "3")
	gen := func(extra map[string]any) completion {
		body := map[string]any{"model": baseModel, "prompt": "tell me a story about a dog", "max_tokens": 40}
		for k, v := range extra {
			body[k] = v
		}
		r := s.post(t, "/v1/completions", body)
		if r.code != 200 {
			t.Fatalf("%d %s", r.code, r.body)
		}
		return decode(t, r.body)
	}
	natural := gen(nil)
	if n := natural.Usage.CompletionTokens; n < 1 || n > 5 || *natural.Choices[0].FinishReason != "stop" {
		t.Fatalf("natural stop: %d tokens, finish %s; want 1-5 and stop", n, *natural.Choices[0].FinishReason)
	}
	if again := gen(nil); again.Usage.CompletionTokens != natural.Usage.CompletionTokens {
		t.Fatalf("natural length not deterministic: %d then %d", natural.Usage.CompletionTokens, again.Usage.CompletionTokens)
	}
	if c := gen(map[string]any{"ignore_eos": true}); c.Usage.CompletionTokens != 40 || *c.Choices[0].FinishReason != "length" {
		t.Fatalf("ignore_eos: %d tokens, finish %s", c.Usage.CompletionTokens, *c.Choices[0].FinishReason)
	}
	if c := gen(map[string]any{"min_tokens": 40}); c.Usage.CompletionTokens != 40 {
		t.Fatalf("min_tokens=max_tokens: %d tokens", c.Usage.CompletionTokens)
	}
	if c := gen(map[string]any{"min_tokens": 20}); c.Usage.CompletionTokens != 20 || *c.Choices[0].FinishReason != "stop" {
		t.Fatalf("min_tokens=20: %d tokens, finish %s", c.Usage.CompletionTokens, *c.Choices[0].FinishReason)
	}
}

// A stream's first bytes come with the first token, as vLLM's do (for
// chat, the role chunk goes out with it): the client sees them no earlier
// than the engine's own time to first token for that request (its
// vllm:time_to_first_token_seconds sample, timed from its arrival, after
// the client sent it), nor before the frontend latency and the prompt's
// prefill step could have passed (a lower bound, so a busy machine cannot
// break it). Each request then shows in vLLM's queue, prefill, running
// and computed-token histograms.
func TestStreamStartsWithFirstToken(t *testing.T) {
	s := startSim(t, "-time-scale", "1", "-frontend-latency", "50ms")
	const promptTokens = 2000
	// One step of 7 ms + 0.04 ms x 2,000 prompt tokens, after the 50 ms
	// frontend latency.
	const prefill = 7*time.Millisecond + promptTokens*40*time.Microsecond
	const minFirst = 50*time.Millisecond + prefill
	hist := func(name string) *dto.Histogram {
		t.Helper()
		f := s.metrics(t)[name]
		if f == nil || len(f.GetMetric()) == 0 {
			t.Fatalf("/metrics has no %s", name)
		}
		return f.GetMetric()[0].GetHistogram()
	}
	reqs := []struct {
		path string
		body map[string]any
	}{
		{"/v1/chat/completions", map[string]any{"model": baseModel, "max_tokens": 2, "stream": true,
			"messages": []map[string]string{{"role": "user", "content": words("w", promptTokens)}}}},
		{"/v1/completions", map[string]any{"model": baseModel, "max_tokens": 2, "stream": true,
			"prompt": words("p", promptTokens)}},
	}
	for i, rq := range reqs {
		before := hist("vllm:time_to_first_token_seconds")
		body, _ := json.Marshal(rq.body)
		start := time.Now()
		resp, err := http.Post(s.url(rq.path), "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 1)
		if _, err := io.ReadFull(resp.Body, buf); err != nil {
			t.Fatal(err)
		}
		first := time.Since(start)
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if first < minFirst {
			t.Errorf("%s: first body byte after %v, before the first token could exist (%v)", rq.path, first, minFirst)
		}
		after := hist("vllm:time_to_first_token_seconds")
		if after.GetSampleCount() != before.GetSampleCount()+1 {
			t.Fatalf("%s: TTFT histogram count %d -> %d, want one more", rq.path, before.GetSampleCount(), after.GetSampleCount())
		}
		engine := time.Duration((after.GetSampleSum() - before.GetSampleSum()) * float64(time.Second))
		if engine < minFirst {
			t.Errorf("%s: engine TTFT %v, want at least %v", rq.path, engine, minFirst)
		}
		if first < engine {
			t.Errorf("%s: first body byte after %v, before the engine's first token (%v after arrival)", rq.path, first, engine)
		}
		t.Logf("%s: first body byte after %v, engine TTFT %v", rq.path, first, engine)
		n := uint64(i + 1)
		for _, name := range []string{"vllm:request_prefill_time_seconds", "vllm:request_inference_time_seconds"} {
			h := hist(name)
			if h.GetSampleCount() != n || h.GetSampleSum() < float64(n)*prefill.Seconds() {
				t.Errorf("%s: count %d sum %g; want %d requests that prefilled for at least one step each", name, h.GetSampleCount(), h.GetSampleSum(), n)
			}
		}
		if h := hist("vllm:request_queue_time_seconds"); h.GetSampleCount() != n {
			t.Errorf("queue time: count %d, want %d", h.GetSampleCount(), n)
		}
		if h := hist("vllm:request_prefill_kv_computed_tokens"); h.GetSampleCount() != n || h.GetSampleSum() < float64(n*promptTokens) {
			t.Errorf("computed tokens: count %d sum %g; want %d requests of at least %d", h.GetSampleCount(), h.GetSampleSum(), n, promptTokens)
		}
	}
}

// TestAPIKey: with -api-key, /v1 needs the key (vLLM's --api-key: 401
// {"error":"Unauthorized"}), while /health and /metrics stay open.
func TestAPIKey(t *testing.T) {
	s := startSim(t, "-api-key", "sim-secret")
	get := func(path, auth string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, s.url(path), nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/v1/models", ""); code != http.StatusUnauthorized || body != `{"error":"Unauthorized"}` {
		t.Fatalf("without key: %d %s", code, body)
	}
	if code, _ := get("/v1/models", "Bearer wrong"); code != http.StatusUnauthorized {
		t.Fatalf("wrong key: %d", code)
	}
	if code, _ := get("/v1/models", "Bearer sim-secret"); code != http.StatusOK {
		t.Fatalf("right key: %d", code)
	}
	for _, p := range []string{"/health", "/metrics"} {
		if code, _ := get(p, ""); code != http.StatusOK {
			t.Fatalf("%s without key: %d", p, code)
		}
	}
}

// TestProbeFlag: the image's health check is `vllm-sim -probe URL`: exit 0
// while the server's /health answers 200, 1 while it answers 503 (a
// -startup-delay) or nothing listens.
func TestProbeFlag(t *testing.T) {
	bin := testutil.Binary(t, "vllm-sim")
	runProbe := func(url string) int {
		t.Helper()
		p := testutil.StartNoCleanup(t, "vllm-sim -probe", bin, "-probe", url)
		select {
		case <-p.Done():
		case <-time.After(10 * time.Second):
			p.Kill()
			t.Fatalf("-probe %s still running", url)
		}
		return p.Cmd.ProcessState.ExitCode()
	}
	starting := startSim(t, "-startup-delay", "60s")
	if code := runProbe(starting.url("/health")); code != 1 {
		t.Errorf("-probe of a starting server (503): exit %d, want 1", code)
	}
	up := startSim(t)
	testutil.Eventually(t, 10*time.Second, "probe passes", func() error {
		if code := runProbe(up.url("/health")); code != 0 {
			return fmt.Errorf("exit %d", code)
		}
		return nil
	})
	up.proc.Stop()
	if code := runProbe(up.url("/health")); code != 1 {
		t.Errorf("-probe of a stopped server: exit %d, want 1", code)
	}
}
