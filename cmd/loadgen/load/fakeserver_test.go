package load

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeServer is an OpenAI-compatible test server whose timings, usage,
// served-by names and failures are known, so the test can compare what
// loadgen measured with what the server produced.
type fakeServer struct {
	t   *testing.T
	url string

	// Behaviour, set before the run.
	ttft      time.Duration // sleep before the first token event
	itl       time.Duration // sleep between token events
	servers   []string      // x-served-by values, round-robin by arrival
	failEvery int           // every Nth request (1-based) gets 503
	cachedPct int           // cached_tokens = prompt_tokens * cachedPct / 100
	block     bool          // hold every request until the client goes away
	noDone    bool          // end the stream without data: [DONE]
	errEvent  bool          // send an error event instead of tokens
	onRequest func(n int64) // called with the arrival number (1-based)

	n        atomic.Int64
	conns    atomic.Int64 // TCP connections accepted
	inflight atomic.Int64
	maxInfl  atomic.Int64

	mu       sync.Mutex
	bodies   [][]byte
	headers  []http.Header
	served   map[string]int
	failed   int
	tokens   int
	prompts  int
	cachedTk int
}

func newFakeServer(t *testing.T) *fakeServer {
	f := &fakeServer{t: t, served: map[string]int{}}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(f.handle))
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			f.conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	f.url = srv.URL
	return f
}

type fakeReq struct {
	Model     string    `json:"model"`
	Prompt    string    `json:"prompt"`
	Messages  []message `json:"messages"`
	MaxTokens int       `json:"max_tokens"`
	MinTokens int       `json:"min_tokens"`
	IgnoreEOS bool      `json:"ignore_eos"`
	Stream    bool      `json:"stream"`
}

func (r *fakeReq) promptTokens() int {
	n := len(strings.Fields(r.Prompt))
	for _, m := range r.Messages {
		n += len(strings.Fields(m.Content))
	}
	return n
}

// answerWord is the token the fake server streams; the i-th of a request
// is deterministic so multi-turn bodies are reproducible.
func answerWord(i int) string { return string(rune('a'+i%26)) + "xyz " }

func (f *fakeServer) handle(w http.ResponseWriter, r *http.Request) {
	n := f.n.Add(1)
	cur := f.inflight.Add(1)
	defer f.inflight.Add(-1)
	for {
		m := f.maxInfl.Load()
		if cur <= m || f.maxInfl.CompareAndSwap(m, cur) {
			break
		}
	}
	var req fakeReq
	raw := make([]byte, 0, 1024)
	buf := make([]byte, 32<<10)
	for {
		k, err := r.Body.Read(buf)
		raw = append(raw, buf[:k]...)
		if err != nil {
			break
		}
	}
	if err := json.Unmarshal(raw, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if f.onRequest != nil {
		f.onRequest(n)
	}
	server := ""
	if len(f.servers) > 0 {
		server = f.servers[int(n-1)%len(f.servers)]
		w.Header().Set(ServedByHeader, server)
	}
	fail := f.failEvery > 0 && n%int64(f.failEvery) == 0
	prompt := req.promptTokens()
	cached := prompt * f.cachedPct / 100
	f.mu.Lock()
	f.bodies = append(f.bodies, raw)
	f.headers = append(f.headers, r.Header.Clone())
	if server != "" {
		f.served[server]++
	}
	if fail {
		f.failed++
	} else if !f.block && !f.errEvent && !f.noDone {
		f.tokens += req.MaxTokens
		f.prompts += prompt
		f.cachedTk += cached
	}
	f.mu.Unlock()

	if fail {
		http.Error(w, `{"error":"overloaded"}`, http.StatusServiceUnavailable)
		return
	}
	if f.block {
		<-r.Context().Done()
		return
	}
	usage := map[string]any{
		"prompt_tokens":         prompt,
		"completion_tokens":     req.MaxTokens,
		"total_tokens":          prompt + req.MaxTokens,
		"prompt_tokens_details": map[string]any{"cached_tokens": cached},
	}
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	if !req.Stream {
		var answer strings.Builder
		for i := range req.MaxTokens {
			answer.WriteString(answerWord(i))
		}
		time.Sleep(f.ttft + time.Duration(max(req.MaxTokens-1, 0))*f.itl)
		choice := map[string]any{"index": 0, "text": answer.String()}
		if chat {
			choice = map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": answer.String()}}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"choices": []any{choice}, "usage": usage})
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		fl.Flush()
	}
	if chat { // role-only first chunk, as vLLM sends: not a token event
		send(map[string]any{"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant"}}}})
	}
	time.Sleep(f.ttft)
	if f.errEvent {
		send(map[string]any{"error": map[string]any{"message": "boom", "code": 500}})
		return
	}
	for i := range req.MaxTokens {
		if i > 0 {
			time.Sleep(f.itl)
		}
		if chat {
			send(map[string]any{"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": answerWord(i)}}}})
		} else {
			send(map[string]any{"choices": []any{map[string]any{"index": 0, "text": answerWord(i)}}})
		}
	}
	send(map[string]any{"choices": []any{}, "usage": usage})
	if !f.noDone {
		fmt.Fprint(w, "data: [DONE]\n\n")
	}
}

func (f *fakeServer) snapshot() (served map[string]int, failed, tokens, prompts, cached int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	served = map[string]int{}
	for k, v := range f.served {
		served[k] = v
	}
	return served, f.failed, f.tokens, f.prompts, f.cachedTk
}

func (f *fakeServer) recorded() [][]byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]byte(nil), f.bodies...)
}
