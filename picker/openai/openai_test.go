package openai

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseRequest(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc, body, want string
		err              error
	}{
		{desc: "plain", body: `{"model":"llama","prompt":"x"}`, want: "llama"},
		{desc: "whitespace", body: " \n{ \"prompt\" : [1,2] ,\t\"model\"\r\n:  \"m-1\" } ", want: "m-1"},
		{desc: "escaped value", body: `{"model":"a\"b\\c\u00e9"}`, want: "a\"b\\cé"},
		{desc: "escaped key", body: `{"mod\u0065l":"x"}`, want: "x"},
		{desc: "nested model ignored", body: `{"tools":[{"model":"inner"}],"meta":{"model":"inner2"},"model":"outer"}`, want: "outer"},
		{desc: "model inside a string", body: `{"prompt":"\"model\":\"fake\"","model":"real"}`, want: "real"},
		{desc: "duplicate: last wins", body: `{"model":"first","model":"second"}`, want: "second"},
		{desc: "braces in strings", body: `{"messages":[{"content":"}]{[\"}"}],"model":"m"}`, want: "m"},
		{desc: "unicode", body: `{"model":"模型/ü"}`, want: "模型/ü"},
		{desc: "no model", body: `{"prompt":"x"}`, err: ErrNoModel},
		{desc: "null model", body: `{"model":null}`, err: ErrNoModel},
		{desc: "number model", body: `{"model":3}`, err: ErrNoModel},
		{desc: "empty model", body: `{"model":""}`, err: ErrNoModel},
		{desc: "later non-string overrides", body: `{"model":"a","model":1}`, err: ErrNoModel},
		{desc: "array", body: `[{"model":"x"}]`, err: ErrInvalidJSON},
		{desc: "truncated", body: `{"model":"x"`, err: ErrInvalidJSON},
		{desc: "trailing garbage", body: `{"model":"x"} y`, err: ErrInvalidJSON},
		{desc: "empty", body: ``, err: ErrInvalidJSON},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			r, err := ParseRequest([]byte(tc.body))
			if !errors.Is(err, tc.err) {
				t.Fatalf("err %v, want %v", err, tc.err)
			}
			if err != nil {
				return
			}
			if r.Model != tc.want {
				t.Errorf("model %q, want %q", r.Model, tc.want)
			}
			var s string
			if err := json.Unmarshal([]byte(tc.body[r.ValueStart:r.ValueEnd]), &s); err != nil || s != tc.want {
				t.Errorf("value span %q decodes to %q (%v)", tc.body[r.ValueStart:r.ValueEnd], s, err)
			}
		})
	}
}

func TestPrompt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ desc, body, want string }{
		{"chat, model first", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, `[{"role":"user","content":"hi"}]`},
		{"chat, messages first", `{"messages":[{"role":"system","content":"s"}] , "model":"m"}`, `[{"role":"system","content":"s"}]`},
		{"completions prompt string", `{"max_tokens":3,"model":"m","prompt":"once upon"}`, `"once upon"`},
		{"escapes and brackets inside strings", `{"x":"a\"}]{[","y":{"z":[1,{"w":"}"}]},"prompt":["p\\",1],"model":"m"}`, `["p\\",1]`},
		{"numbers and literals skipped", `{"n":-1.5e3,"b":true,"nul":null,"messages":[],"model":"m"}`, `[]`},
		{"first prompt key wins", `{"prompt":"a","messages":"b","prompt":"c","model":"m"}`, `"a"`},
		{"nested keys ignored", `{"tools":[{"prompt":"inner"}],"model":"m","messages":"outer"}`, `"outer"`},
		{"escaped key", `{"m\u0065ssages":"x","model":"m"}`, `"x"`},
		{"no model: prompt still found", `{"prompt":"p"}`, `"p"`},
		{"no prompt key: whole body", `{"model":"m","input":"x"}`, `{"model":"m","input":"x"}`},
		{"invalid JSON: whole body", `{"model":"m","prompt":"x"`, `{"model":"m","prompt":"x"`},
		{"not an object: whole body", `[1,2]`, `[1,2]`},
		{"empty", ``, ``},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			body := []byte(tc.body)
			r, _ := ParseRequest(body)
			if got := r.Prompt(body); got != tc.want {
				t.Errorf("ParseRequest: got %q, want %q", got, tc.want)
			}
			r, _, _ = ModelSpan(body)
			if got := r.Prompt(body); got != tc.want {
				t.Errorf("ModelSpan: got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestRewriteModelPreservesEverythingElse(t *testing.T) {
	t.Parallel()
	body := []byte("{\n  \"messages\": [{\"role\":\"user\",\"content\":\"hi \\\"there\\\"\"}],\n  \"model\" : \"alias\",\n  \"temperature\": 0.70\n}")
	r, err := ParseRequest(body)
	if err != nil {
		t.Fatal(err)
	}
	out := RewriteModel(body, r, `new"model`)
	want := strings.Replace(string(body), `"alias"`, `"new\"model"`, 1)
	if string(out) != want {
		t.Fatalf("got %s\nwant %s", out, want)
	}
	r2, err := ParseRequest(out)
	if err != nil || r2.Model != `new"model` {
		t.Errorf("re-parse: %q %v", r2.Model, err)
	}
}

func TestAppendStringMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", "plain", "q\"b\\", "ctl\x01\n\t", "ü模型", "bad\xffutf8"} {
		var back string
		if err := json.Unmarshal(AppendString(nil, s), &back); err != nil {
			t.Errorf("%q: %v", s, err)
		}
		if want := strings.ToValidUTF8(s, "\uFFFD"); back != want {
			t.Errorf("%q round-trips to %q", s, back)
		}
	}
}

func TestIsInferencePath(t *testing.T) {
	t.Parallel()
	for path, want := range map[string]bool{
		"/v1/chat/completions": true, "/v1/completions?x=1": true, "/v1/embeddings/": true, "/v1/responses": true,
		"/v1/models": false, "/health": false, "/v1/chat/completionsx": false,
	} {
		if IsInferencePath(path) != want {
			t.Errorf("%s: want %v", path, want)
		}
	}
}

func TestKindOf(t *testing.T) {
	t.Parallel()
	for ct, want := range map[string]ResponseKind{
		"application/json": JSONBody, "application/json; charset=utf-8": JSONBody, "application/problem+json": JSONBody,
		"text/event-stream": EventStream, "Text/Event-Stream; charset=utf-8": EventStream,
		"text/plain": Passthrough, "": Passthrough,
	} {
		if got := KindOf(ct); got != want {
			t.Errorf("%q: %v, want %v", ct, got, want)
		}
	}
}

const sseStream = "event: message\n" +
	"data: {\"id\":\"1\",\"model\":\"upstream-8b\",\"choices\":[{\"delta\":{\"content\":\"model\"}}]}\n\n" +
	": keep-alive comment\n\n" +
	"data:{\"id\":\"2\",\"model\":\"upstream-8b\",\"usage\":{\"model\":\"keep\"}}\r\n\r\n" +
	"data: not json\n\n" +
	"data: [DONE]\n\n"

func sseWant() string {
	w := strings.ReplaceAll(sseStream, `"model":"upstream-8b"`, `"model":"alias"`)
	return w
}

func TestSSERewriteEverySplit(t *testing.T) {
	t.Parallel()
	want := sseWant()
	for cut := 0; cut <= len(sseStream); cut++ {
		for cut2 := cut; cut2 <= len(sseStream); cut2 += 7 {
			w := NewResponseRewriter(EventStream, "alias", 1<<20)
			var got []byte
			got = append(got, w.Write([]byte(sseStream[:cut]), false)...)
			got = append(got, w.Write([]byte(sseStream[cut:cut2]), false)...)
			got = append(got, w.Write([]byte(sseStream[cut2:]), true)...)
			if string(got) != want {
				t.Fatalf("split %d/%d:\n got %q\nwant %q", cut, cut2, got, want)
			}
		}
	}
}

func TestSSEHoldsPartialLines(t *testing.T) {
	t.Parallel()
	w := NewResponseRewriter(EventStream, "alias", 1<<20)
	if out := w.Write([]byte(`data: {"model":"up`), false); len(out) != 0 {
		t.Errorf("partial line forwarded early: %q", out)
	}
	if out := string(w.Write([]byte("\"}\n"), false)); out != "data: {\"model\":\"alias\"}\n" {
		t.Errorf("completed line %q", out)
	}
	if out := string(w.Write([]byte(`data: {"model":"x"}`), true)); out != `data: {"model":"alias"}` {
		t.Errorf("flush at end of stream %q", out)
	}
}

func TestJSONRewrite(t *testing.T) {
	t.Parallel()
	w := NewResponseRewriter(JSONBody, "alias", 1<<20)
	if out := w.Write([]byte(`{"object":"list","model":"upstr`), false); len(out) != 0 {
		t.Errorf("JSON forwarded before end of stream: %q", out)
	}
	if out := string(w.Write([]byte(`eam","data":[{"model":"inner"}]}`), true)); out != `{"object":"list","model":"alias","data":[{"model":"inner"}]}` {
		t.Errorf("got %s", out)
	}
	// Invalid JSON and oversized bodies pass through untouched.
	w = NewResponseRewriter(JSONBody, "alias", 1<<20)
	if out := string(w.Write([]byte(`{"model":"x"`), true)); out != `{"model":"x"` {
		t.Errorf("invalid JSON changed: %s", out)
	}
	w = NewResponseRewriter(JSONBody, "alias", 8)
	a := string(w.Write([]byte(`{"model":"upstream"`), false))
	b := string(w.Write([]byte(`}`), true))
	if a+b != `{"model":"upstream"}` {
		t.Errorf("oversized body changed: %s%s", a, b)
	}
}

// Long strings go through the vectorised skip: every position of a quote,
// escape or control character relative to the 8- and 32-byte words must be seen,
// and validity must agree with encoding/json.
func TestLongStringsAgreeWithEncodingJSON(t *testing.T) {
	for _, n := range []int{0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 39, 40, 41, 63, 64, 65, 95, 96, 97, 1000} {
		pad := strings.Repeat("x", n)
		for _, mid := range []string{``, `\"`, `\\`, `\n`, `\u00e9`, `é`, "\x01", "\x1f", `\q`, `\u12`, "\"\"", "\\\\\\\""} {
			body := []byte(`{"prompt":"` + pad + mid + pad + `","model":"m"}`)
			_, err := ParseRequest(body)
			valid := json.Valid(body)
			if (err == nil) != valid {
				t.Errorf("pad %d, middle %q: parser error %v, encoding/json valid %v", n, mid, err, valid)
			}
		}
	}
}

// BenchmarkParseRequest validates and scans a 200 KiB chat body (one long
// system prompt, as agents send). Run:
//
//	go test -run '^$' -bench ParseRequest -benchmem ./picker/openai/
func BenchmarkParseRequest(b *testing.B) {
	body := []byte(`{"model":"llama","messages":[{"role":"system","content":"` +
		strings.Repeat("You are a helpful assistant. Answer in \u00e9l\u00e9gant prose. ", 200<<10/52) +
		`"},{"role":"user","content":"question"}],"stream":false,"max_tokens":128}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseRequest(body); err != nil {
			b.Fatal(err)
		}
	}
}

// Stream is read from the top-level "stream" only, and only true counts.
func TestParseRequestStream(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		body string
		want bool
	}{
		{`{"model":"m","stream":true}`, true},
		{`{"stream" : true , "model":"m"}`, true},
		{`{"model":"m","stream":false}`, false},
		{`{"model":"m"}`, false},
		{`{"model":"m","stream":"true"}`, true}, // as vLLM reads it (see laxBool)
		{`{"model":"m","stream":1}`, true},
		{`{"model":"m","stream":"maybe"}`, false},
		{`{"model":"m","options":{"stream":true}}`, false},
		{`{"model":"m","stream":true,"stream":false}`, false},
	} {
		r, err := ParseRequest([]byte(tc.body))
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if r.Stream != tc.want {
			t.Errorf("%s: stream %v, want %v", tc.body, r.Stream, tc.want)
		}
	}
}
