package kvevents

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
)

// fakeTokenizeServer answers /tokenize with one id per byte of the text
// (chat: each message rendered "<role>content\n", then "<assistant>"
// unless add_generation_prompt is false) and lists "ad" as an adapter.
// With systemLast, the chat template puts system messages after the
// others (as some templates move the system prompt to the last turn):
// a conversation's first messages are then not a prefix of it.
type fakeTokenizeServer struct {
	*httptest.Server
	calls      atomic.Int64
	last       atomic.Pointer[map[string]any]
	systemLast atomic.Bool
	// refuseEnd refuses (400) conversations whose last message is not
	// the user's, as Mistral's own tokenizers do.
	refuseEnd atomic.Bool
	// gate, when set, holds every /tokenize until it is closed.
	gate atomic.Pointer[chan struct{}]
}

// renderFake is the fake's chat template.
func renderFake(req map[string]any, systemLast bool) string {
	msgs, _ := req["messages"].([]any)
	var head, sys strings.Builder
	for _, m := range msgs {
		mm, _ := m.(map[string]any)
		role, _ := mm["role"].(string)
		content, _ := mm["content"].(string)
		if role == "system" && systemLast {
			sys.WriteString("<" + role + ">" + content + "\n")
			continue
		}
		head.WriteString("<" + role + ">" + content + "\n")
	}
	text := head.String() + sys.String()
	if g, ok := req["add_generation_prompt"].(bool); !ok || g {
		text += "<assistant>"
	}
	return text
}

func newFakeTokenizeServer(t testing.TB) *fakeTokenizeServer {
	f := &fakeTokenizeServer{}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		if g := f.gate.Load(); g != nil {
			<-*g
		}
		f.calls.Add(1)
		var req map[string]any
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		f.last.Store(&req)
		if msgs, ok := req["messages"].([]any); ok && f.refuseEnd.Load() {
			if last, _ := msgs[len(msgs)-1].(map[string]any); last["role"] != "user" {
				http.Error(w, `{"error":"Expected last role User"}`, 400)
				return
			}
		}
		text := ""
		if p, ok := req["prompt"].(string); ok {
			text = p
		} else {
			text = renderFake(req, f.systemLast.Load())
		}
		ids := make([]uint32, len(text))
		for i := range text {
			ids[i] = uint32(text[i])
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "tokens": ids, "max_model_len": 4096})
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"tiny","parent":null},{"id":"ad","parent":"tiny"}]}`))
	})
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

func (f *fakeTokenizeServer) addr() string { return strings.TrimPrefix(f.URL, "http://") }

// u32bytes turns the fake's ids back into its text.
func u32bytes(ids []uint32) []byte {
	b := make([]byte, len(ids))
	for i, id := range ids {
		b[i] = byte(id)
	}
	return b
}

func TestTokenizerAsksTheEngineAndCaches(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{})
	ctx := context.Background()
	body := `{"model":"tiny","prompt":"hello","max_tokens":5,"cache_salt":"s1"}`
	got, err := tok.Tokenize(ctx, []string{f.addr()}, Prompt{Model: "tiny", Body: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.IDs, []uint32{'h', 'e', 'l', 'l', 'o'}) || got.Adapter != "" || got.Salt != "s1" {
		t.Fatalf("tokens %+v", got)
	}
	// Only what decides the tokens is sent.
	if req := *f.last.Load(); len(req) != 2 || req["model"] != "tiny" || req["prompt"] != "hello" {
		t.Fatalf("tokenize request %v", req)
	}
	// Same prompt, other sampling parameters: from the cache.
	if _, err := tok.Tokenize(ctx, []string{f.addr()}, Prompt{Model: "tiny", Body: []byte(`{"model":"tiny","prompt":"hello","max_tokens":9}`)}); err != nil {
		t.Fatal(err)
	}
	if n := f.calls.Load(); n != 1 {
		t.Fatalf("%d tokenize calls, want 1 (the second from the cache)", n)
	}
	// A chat request for the adapter: its template inputs are forwarded.
	chat := `{"model":"ad","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false,"temperature":0}`
	got, err = tok.Tokenize(ctx, []string{f.addr()}, Prompt{Model: "ad", Chat: true, Body: []byte(chat)})
	if err != nil {
		t.Fatal(err)
	}
	if got.Adapter != "ad" || string(u32bytes(got.IDs)) != "<user>hi\n" {
		t.Fatalf("chat tokens %+v", got)
	}
	if req := *f.last.Load(); req["add_generation_prompt"] != false || req["temperature"] != nil {
		t.Fatalf("chat tokenize request %v", req)
	}
	// Token ids need no round trip.
	got, err = tok.Tokenize(ctx, []string{f.addr()}, Prompt{Model: "tiny", Body: []byte(`{"model":"tiny","prompt":[1,2,3]}`)})
	if err != nil || !reflect.DeepEqual(got.IDs, []uint32{1, 2, 3}) {
		t.Fatalf("token ids: %+v %v", got, err)
	}
	// "hello" and the chat's ids are cached; ids passed in are not.
	if st := tok.Stats(); st.Calls != 2 || st.Hits != 1 || st.Failures != 0 || st.CachedTokens != 5+len("<user>hi\n") {
		t.Fatalf("stats %+v", st)
	}
}

func TestTokenizerRefusesWhatCannotBeKeyed(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{})
	for name, c := range map[string]Prompt{
		"batch":      {Model: "tiny", Body: []byte(`{"model":"tiny","prompt":["a","b"]}`)},
		"embeds":     {Model: "tiny", Body: []byte(`{"model":"tiny","prompt_embeds":"AAAA"}`)},
		"multimodal": {Model: "tiny", Chat: true, Body: []byte(`{"model":"tiny","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`)},
	} {
		if _, err := tok.Tokenize(context.Background(), []string{f.addr()}, c); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: err %v, want ErrUnsupported", name, err)
		}
	}
	if f.calls.Load() != 0 {
		t.Fatalf("%d calls for unsupported requests", f.calls.Load())
	}
}

// A failing server is skipped for the next candidate.
func TestTokenizerTriesAnotherServer(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{})
	body := []byte(`{"model":"tiny","prompt":"x"}`)
	for range 4 {
		if _, err := tok.Tokenize(context.Background(), []string{"127.0.0.1:1", f.addr()}, Prompt{Model: "tiny", Body: body}); err != nil {
			t.Fatal(err)
		}
	}
}

// The evicting cache keeps to its token budget.
func TestTokenizerCacheBudget(t *testing.T) {
	tok := NewTokenizer(TokenizerOptions{MaxCachedTokens: 10})
	for i := range 20 {
		tok.store(uint64(i), make([]uint32, 3))
	}
	if st := tok.Stats(); st.CachedTokens > 10 || st.CachedTokens < 9 {
		t.Fatalf("cached %d tokens, budget 10", st.CachedTokens)
	}
	if tok.lookup(19) == nil || tok.lookup(0) != nil {
		t.Fatal("eviction is not oldest first")
	}
}
