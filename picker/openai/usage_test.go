package openai

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestParseGenerationAndIncludeUsage(t *testing.T) {
	t.Parallel()
	const chat, comp, resp = "/v1/chat/completions", "/v1/completions", "/v1/responses"
	for _, tc := range []struct {
		desc, path, body string
		stream, usage    bool
		cap              int64  // -1: no cap the endpoint reads
		rewritten        string // "" when WithIncludeUsage is not applied
	}{
		{"not streaming", comp, `{"model":"m","max_tokens":16}`, false, false, 16, ""},
		{"stream without options", chat, `{"model":"m","stream":true,"max_completion_tokens":8}`, true, false, 8,
			`{"stream_options":{"include_usage":true},"model":"m","stream":true,"max_completion_tokens":8}`},
		{"asked already", chat, `{"stream":true,"stream_options":{"include_usage":true}}`, true, true, -1, ""},
		{"options without usage", chat, ` { "stream" : true , "stream_options" : {"continuous_usage_stats":false,"include_usage":false} , "x":1}`,
			true, false, -1, ` { "stream" : true , "stream_options" : {"continuous_usage_stats":false,"include_usage":true} , "x":1}`},
		{"null options", chat, `{"stream":true,"stream_options":null}`, true, false, -1, `{"stream":true,"stream_options":{"include_usage":true}}`},
		{"empty options (vLLM 0.32: no usage)", chat, `{"stream":true,"stream_options":{}}`, true, false, -1, `{"stream":true,"stream_options":{"include_usage":true}}`},
		{"stream false", resp, `{"stream":false,"max_output_tokens":"9"}`, false, false, 9, ""},
		{"not an object", chat, `[1]`, false, false, -1, ""},
		// What vLLM's lax validation accepts, read as it reads it.
		{"stream 1", chat, `{"stream":1}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":1}`},
		{"stream 1.0", chat, `{"stream":1.0}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":1.0}`},
		{"stream \"true\"", comp, `{"stream":"true"}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":"true"}`},
		{"stream \"YES\"", comp, `{"stream":"YES"}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":"YES"}`},
		{"stream escaped \"true\"", comp, `{"stream":"\u0074rue"}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":"\u0074rue"}`},
		{"stream \"off\"", comp, `{"stream":"off"}`, false, false, -1, ""},
		{"stream 0", comp, `{"stream":0}`, false, false, -1, ""},
		{"stream null", comp, `{"stream":null}`, false, false, -1, ""},
		{"stream \" true\" (rejected by vLLM)", comp, `{"stream":" true"}`, false, false, -1, ""},
		{"stream 2 (rejected by vLLM)", comp, `{"stream":2}`, false, false, -1, ""},
		{"the last key counts", comp, `{"stream":false,"stream":"on"}`, true, false, -1, `{"stream_options":{"include_usage":true},"stream":false,"stream":"on"}`},
		{"usage asked laxly", chat, `{"stream":"1","stream_options":{"include_usage":"yes"}}`, true, true, -1, ""},
		{"max_tokens \"5\"", chat, `{"max_tokens":"5"}`, false, false, 5, ""},
		{"max_tokens 5.0", chat, `{"max_tokens":5.0}`, false, false, 5, ""},
		{"max_tokens 1e2", chat, `{"max_tokens":1e2}`, false, false, 100, ""},
		{"max_tokens \" +0_050.00 \"", comp, `{"max_tokens":" +0_050.00 "}`, false, false, 50, ""},
		{"max_tokens true", comp, `{"max_tokens":true}`, false, false, 1, ""},
		{"max_tokens 5.5 (rejected by vLLM)", comp, `{"max_tokens":5.5}`, false, false, -1, ""},
		{"max_tokens \"1e2\" (rejected by vLLM)", comp, `{"max_tokens":"1e2"}`, false, false, -1, ""},
		{"max_tokens null", chat, `{"max_tokens":null}`, false, false, -1, ""},
		{"chat: max_completion_tokens wins", chat, `{"max_completion_tokens":"9","max_tokens":5}`, false, false, 9, ""},
		{"chat: a null max_completion_tokens leaves max_tokens", chat, `{"max_completion_tokens":null,"max_tokens":5}`, false, false, 5, ""},
		{"completions ignore max_completion_tokens", comp, `{"max_completion_tokens":9}`, false, false, -1, ""},
		{"chat ignores max_output_tokens", chat, `{"max_output_tokens":9}`, false, false, -1, ""},
		{"n choices", chat, `{"max_tokens":10,"n":"3"}`, false, false, 30, ""},
		{"a batch of prompts", comp, `{"max_tokens":10,"n":2,"prompt":["a","b","c"]}`, false, false, 60, ""},
		{"one tokenised prompt", comp, `{"max_tokens":10,"prompt":[1,2,3]}`, false, false, 10, ""},
		{"a batch of tokenised prompts", comp, `{"max_tokens":10,"prompt":[[1],[2]]}`, false, false, 20, ""},
		{"embeddings generate nothing", "/v1/embeddings", `{"max_tokens":10}`, false, false, -1, ""},
		{"huge", comp, `{"max_tokens":99999999999999999999999,"n":99999999999}`, false, false, maxOutputCap, ""},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			g := ParseGeneration([]byte(tc.body))
			capV, capped := g.OutputCap(tc.path)
			if !capped {
				capV = -1
			}
			if g.Stream != tc.stream || g.IncludeUsage != tc.usage || capV != tc.cap {
				t.Fatalf("ParseGeneration: stream %v usage %v cap %d, want %v %v %d", g.Stream, g.IncludeUsage, capV, tc.stream, tc.usage, tc.cap)
			}
			if tc.rewritten == "" {
				return
			}
			got := WithIncludeUsage([]byte(tc.body), g)
			if string(got) != tc.rewritten {
				t.Fatalf("WithIncludeUsage:\n got %s\nwant %s", got, tc.rewritten)
			}
			if g2 := ParseGeneration(got); !g2.IncludeUsage || !json.Valid(got) {
				t.Fatalf("rewritten body %s does not ask for usage", got)
			}
		})
	}
}

const chunkUsage = `{"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":19,"total_tokens":22,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":16}}}`

func usageStream() string {
	return "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n" +
		"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":\"length\"}]}\n\n" +
		"data: " + chunkUsage + "\n\n" +
		"data: [DONE]\n\n"
}

// feed writes s to the tap in pieces of n bytes.
func feed(tap *UsageTap, s string, n int) string {
	var out strings.Builder
	for i := 0; i < len(s); i += n {
		end := min(i+n, len(s))
		out.Write(tap.Write([]byte(s[i:end]), end == len(s)))
	}
	return out.String()
}

func TestUsageTapStream(t *testing.T) {
	t.Parallel()
	want := Usage{Prompt: 19, Cached: 16, Completion: 3}
	for _, n := range []int{1, 7, 64, 1 << 20} {
		// Kept: the client asked for usage.
		tap := NewUsageTap(EventStream, false, 1<<20)
		if got := feed(tap, usageStream(), n); got != usageStream() {
			t.Fatalf("pieces of %d: forwarded\n%q\nwant\n%q", n, got, usageStream())
		}
		if u, ok := tap.Usage(); !ok || u != want {
			t.Fatalf("pieces of %d: usage %+v %v", n, u, ok)
		}
		// Stripped: the picker asked for it.
		tap = NewUsageTap(EventStream, true, 1<<20)
		got := feed(tap, usageStream(), n)
		if strings.Contains(got, `"usage"`) || !strings.HasSuffix(got, "data: [DONE]\n\n") || strings.Count(got, "data:") != 3 {
			t.Fatalf("pieces of %d: stripped stream\n%q", n, got)
		}
		if u, ok := tap.Usage(); !ok || u != want {
			t.Fatalf("pieces of %d: usage %+v %v", n, u, ok)
		}
	}
	// CRLF framing and a final event without its blank line.
	s := "data: {\"choices\":[{}]}\r\n\r\ndata: " + chunkUsage
	tap := NewUsageTap(EventStream, true, 1<<20)
	if got := feed(tap, s, 5); got != "data: {\"choices\":[{}]}\r\n\r\n" {
		t.Fatalf("CRLF: %q", got)
	}
	if _, ok := tap.Usage(); !ok {
		t.Fatal("CRLF: usage not read")
	}
}

func TestUsageTapJSON(t *testing.T) {
	t.Parallel()
	doc := `{"id":"x","object":"text_completion","choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2,"prompt_tokens_details":null}}`
	tap := NewUsageTap(JSONBody, true, 1<<20)
	if got := feed(tap, doc, 10); got != doc {
		t.Fatalf("JSON body changed: %q", got)
	}
	if u, ok := tap.Usage(); !ok || u != (Usage{Prompt: 5, Completion: 2}) {
		t.Fatalf("usage %+v %v", u, ok)
	}
	// The Responses API shape.
	resp := `{"id":"r","object":"response","usage":{"input_tokens":11,"output_tokens":4,"input_tokens_details":{"cached_tokens":8}}}`
	tap = NewUsageTap(JSONBody, false, 1<<20)
	feed(tap, resp, 3)
	if u, ok := tap.Usage(); !ok || u != (Usage{Prompt: 11, Cached: 8, Completion: 4}) {
		t.Fatalf("responses usage %+v %v", u, ok)
	}
	// Too large to keep: forwarded, usage read from the tail.
	big := `{"object":"list","data":[{"embedding":[` + strings.Repeat("0.125,", 20000) + `0.5]}],"usage":{"prompt_tokens":9,"total_tokens":9}}`
	tap = NewUsageTap(JSONBody, false, 8<<10)
	if got := feed(tap, big, 1000); got != big {
		t.Fatal("oversized body changed")
	}
	if u, ok := tap.Usage(); !ok || u != (Usage{Prompt: 9}) {
		t.Fatalf("usage of an oversized body %+v %v", u, ok)
	}
	// The Responses API's final stream event.
	ev := "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n"
	tap = NewUsageTap(EventStream, true, 1<<20)
	if got := feed(tap, ev, 4); got != ev {
		t.Fatalf("responses event changed: %q", got)
	}
	if u, _ := tap.Usage(); u != (Usage{Prompt: 3, Completion: 1}) {
		t.Fatalf("responses stream usage %+v", u)
	}
}

// FuzzUsageTap: a tap that strips nothing forwards every stream exactly,
// however it is cut into pieces.
func FuzzUsageTap(f *testing.F) {
	f.Add(usageStream(), 3)
	f.Add("data: x\r\n\r\ndata: {\"usage\":{}}\r\r", 1)
	f.Fuzz(func(t *testing.T, s string, n int) {
		n = max(1, n%64)
		for _, kind := range []ResponseKind{EventStream, JSONBody} {
			tap := NewUsageTap(kind, false, 1<<10)
			if got := feed(tap, s, n); got != s {
				t.Fatalf("kind %d, pieces of %d: forwarded %q, want %q", kind, n, got, s)
			}
		}
	})
}
