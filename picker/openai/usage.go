package openai

import (
	"bytes"
	"encoding/json"
	"strings"
)

// Generation is what a request body says about its response, for token
// accounting, read as the engine reads it (pydantic's lax mode, see
// laxBool and laxInt): whether it streams, whether it asked for the usage
// chunk (stream_options.include_usage), its output caps and how many
// outputs it asks for.
type Generation struct {
	Stream       bool
	IncludeUsage bool
	// maxTokens, maxCompletionTokens and maxOutputTokens are the caps
	// the body gives (capSet says which are present and not null).
	maxTokens, maxCompletionTokens, maxOutputTokens int64
	capSet                                          uint8
	// n is the choices asked for per prompt (at least 1), prompts the
	// prompts of a completions batch (at least 1).
	n, prompts int64
	// optsStart and optsEnd delimit the raw value of stream_options (both
	// zero when absent).
	optsStart, optsEnd int
}

// Generation.capSet bits.
const (
	setMaxTokens uint8 = 1 << iota
	setMaxCompletionTokens
	setMaxOutputTokens
)

// maxOutputCap bounds OutputCap (a product of clamped values).
const maxOutputCap = 1 << 50

// ParseGeneration reads the generation settings of a request body; a body
// that is not a JSON object gives the zero Generation (nothing streams,
// no cap). When a key appears more than once the last one counts, as in
// Python's json module.
func ParseGeneration(body []byte) Generation {
	g := Generation{n: 1, prompts: 1}
	_ = members(body, func(key []byte, vs, ve int) {
		v := body[vs:ve]
		switch {
		case keyIs(key, "stream"):
			g.Stream, _ = laxBool(v)
		case keyIs(key, "stream_options"):
			g.optsStart, g.optsEnd = vs, ve
			g.IncludeUsage = false
			if v[0] == '{' {
				_ = members(v, func(k []byte, s, e int) {
					if keyIs(k, "include_usage") {
						g.IncludeUsage, _ = laxBool(v[s:e])
					}
				})
			}
		case keyIs(key, "max_tokens"):
			g.maxTokens = g.setCap(setMaxTokens, v)
		case keyIs(key, "max_completion_tokens"):
			g.maxCompletionTokens = g.setCap(setMaxCompletionTokens, v)
		case keyIs(key, "max_output_tokens"):
			g.maxOutputTokens = g.setCap(setMaxOutputTokens, v)
		case keyIs(key, "n"):
			g.n = 1
			if n, present, _ := laxInt(v); present && n > 1 {
				g.n = n
			}
		case keyIs(key, "prompt"):
			g.prompts = max(promptCount(v), 1)
		}
	})
	return g
}

// setCap reads a cap's value and notes whether it is present (not null).
func (g *Generation) setCap(bit uint8, v []byte) int64 {
	n, present, _ := laxInt(v)
	if present {
		g.capSet |= bit
	} else {
		g.capSet &^= bit
	}
	return n
}

// promptCount is the number of prompts a completions "prompt" holds: a
// list of strings or of token lists is a batch (one generation each);
// a string or one token list is one prompt.
func promptCount(v []byte) int64 {
	if len(v) == 0 || v[0] != '[' {
		return 1
	}
	sc := scanner{b: v, i: 1}
	sc.ws()
	if c := sc.peek(); c != '"' && c != '[' {
		return 1
	}
	var n int64
	for {
		sc.ws()
		if !sc.value(1) {
			return max(n, 1)
		}
		n++
		sc.ws()
		if sc.peek() != ',' {
			return n
		}
		sc.i++
	}
}

// OutputCap is the most output tokens the engine may generate for the
// request on path, when the body caps it: chat completions read
// max_completion_tokens, else max_tokens; completions max_tokens; the
// Responses API max_output_tokens; times the choices (n) and the
// prompts of a completions batch. capped is false when the body sets no
// cap the endpoint reads (the engine then generates up to the model's
// context, or its own default), and for endpoints that generate nothing.
func (g Generation) OutputCap(path string) (tokens int64, capped bool) {
	var v int64
	switch api := apiPath(path); {
	case api == "/v1/chat/completions" && g.capSet&setMaxCompletionTokens != 0:
		v = mulCap(g.maxCompletionTokens, g.n)
	case api == "/v1/chat/completions" && g.capSet&setMaxTokens != 0:
		v = mulCap(g.maxTokens, g.n)
	case api == "/v1/completions" && g.capSet&setMaxTokens != 0:
		v = mulCap(mulCap(g.maxTokens, g.n), g.prompts)
	case api == "/v1/responses" && g.capSet&setMaxOutputTokens != 0:
		v = mulCap(g.maxOutputTokens, 1)
	default:
		return 0, false
	}
	return v, true
}

// mulCap is a*b for a cap a (negative: 0) and a count b >= 1, at most
// maxOutputCap.
func mulCap(a, b int64) int64 {
	if a <= 0 {
		return 0
	}
	b = max(b, 1)
	if a > maxOutputCap/b {
		return maxOutputCap
	}
	return min(a*b, maxOutputCap)
}

// Generates reports whether path is an endpoint that generates output
// tokens (chat and text completions, the Responses API).
func Generates(path string) bool {
	switch apiPath(path) {
	case "/v1/chat/completions", "/v1/completions", "/v1/responses":
		return true
	}
	return false
}

// apiPath is path without its query string and trailing slash.
func apiPath(path string) string {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	return strings.TrimSuffix(path, "/")
}

// members calls fn with every top-level member of the JSON object body:
// its raw key token and the bounds of its raw value.
func members(body []byte, fn func(key []byte, vs, ve int)) error {
	sc := scanner{b: body}
	sc.ws()
	if sc.peek() != '{' {
		return ErrInvalidJSON
	}
	sc.i++
	sc.ws()
	if sc.peek() == '}' {
		return nil
	}
	for {
		sc.ws()
		ks := sc.i
		if !sc.str() {
			return ErrInvalidJSON
		}
		key := body[ks:sc.i]
		sc.ws()
		if sc.peek() != ':' {
			return ErrInvalidJSON
		}
		sc.i++
		sc.ws()
		vs := sc.i
		if !sc.value(1) {
			return ErrInvalidJSON
		}
		fn(key, vs, sc.i)
		sc.ws()
		c := sc.peek()
		sc.i++
		switch c {
		case '}':
			return nil
		case ',':
		default:
			return ErrInvalidJSON
		}
	}
}

// includeUsage is the stream_options the picker asks for.
var includeUsage = []byte(`{"include_usage":true}`)

// WithIncludeUsage returns body asking the server for the usage chunk of a
// stream (stream_options.include_usage = true), every other byte kept: a
// stream_options object gets the field set (its other fields kept), a
// null one is replaced, and a body without it gets one as its first
// member. g must come from ParseGeneration(body). A stream_options that
// is neither an object nor null is left alone (the server rejects it).
func WithIncludeUsage(body []byte, g Generation) []byte {
	if g.optsEnd == 0 {
		i := bytes.IndexByte(body, '{') + 1
		out := make([]byte, 0, len(body)+len(`"stream_options":,`)+len(includeUsage))
		out = append(out, body[:i]...)
		out = append(out, `"stream_options":`...)
		out = append(out, includeUsage...)
		out = append(out, ',')
		return append(out, body[i:]...)
	}
	old := body[g.optsStart:g.optsEnd]
	repl := includeUsage
	switch old[0] {
	case 'n':
	case '{':
		var o map[string]json.RawMessage
		if json.Unmarshal(old, &o) != nil {
			return body
		}
		o["include_usage"] = json.RawMessage("true")
		b, err := json.Marshal(o)
		if err != nil {
			return body
		}
		repl = b
	default:
		return body
	}
	out := make([]byte, 0, len(body)-len(old)+len(repl))
	out = append(out, body[:g.optsStart]...)
	out = append(out, repl...)
	return append(out, body[g.optsEnd:]...)
}

// Usage is what a response reports it used, in OpenAI's usage object
// (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens)
// or the Responses API's (input_tokens, output_tokens,
// input_tokens_details.cached_tokens).
type Usage struct {
	Prompt, Cached, Completion int64
}

// usageJSON decodes both shapes.
type usageJSON struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	InputTokens         int64 `json:"input_tokens"`
	OutputTokens        int64 `json:"output_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	InputTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

func (u *usageJSON) usage() Usage {
	out := Usage{Prompt: u.PromptTokens + u.InputTokens, Completion: u.CompletionTokens + u.OutputTokens}
	if d := u.PromptTokensDetails; d != nil {
		out.Cached += d.CachedTokens
	}
	if d := u.InputTokensDetails; d != nil {
		out.Cached += d.CachedTokens
	}
	return out
}

// parseUsage reads the usage of one document: its top-level "usage"
// (completions, chat, embeddings) or its "response"'s (the Responses
// API's final event). usageOnly reports a streaming chunk that carries
// nothing but usage (an empty choices list): the chunk include_usage
// adds. Only the usage object is decoded; the rest (the generated text)
// is merely scanned.
func parseUsage(doc []byte) (u Usage, found, usageOnly bool) {
	if !bytes.Contains(doc, []byte(`"usage"`)) {
		return Usage{}, false, false
	}
	var usage, response []byte
	emptyChoices := false
	if members(doc, func(key []byte, vs, ve int) {
		switch v := doc[vs:ve]; {
		case keyIs(key, "usage"):
			usage = v
		case keyIs(key, "choices"):
			emptyChoices = len(bytes.TrimSpace(v[1:len(v)-1])) == 0 && v[0] == '['
		case keyIs(key, "response"):
			response = v
		}
	}) != nil {
		return Usage{}, false, false
	}
	if usage == nil && len(response) > 0 && response[0] == '{' {
		_ = members(response, func(key []byte, vs, ve int) {
			if keyIs(key, "usage") {
				usage = response[vs:ve]
			}
		})
		emptyChoices = false
	}
	if len(usage) == 0 || usage[0] != '{' {
		return Usage{}, false, false
	}
	var uj usageJSON
	if json.Unmarshal(usage, &uj) != nil {
		return Usage{}, false, false
	}
	return uj.usage(), true, emptyChoices
}

// UsageTap reads a response body's usage as it streams through, and can
// remove the usage-only chunk of a stream the client did not ask for (the
// picker asked the server for it). A JSON document is forwarded as it
// arrives and read once complete (up to a size limit); a stream is
// forwarded event by event (an event is held until its blank line).
type UsageTap struct {
	kind  ResponseKind
	strip bool
	max   int
	buf   []byte // JSON: the document so far; SSE: the incomplete event
	over  bool   // JSON: the document exceeded max
	usage Usage
	found bool
}

// tailBytes is how much of a JSON document too large to keep whole the
// tap keeps to find its usage in.
const tailBytes = 4 << 10

// tailUsage finds the last top-level-looking "usage" object in the tail of
// a document and decodes it.
func tailUsage(tail []byte) (Usage, bool) {
	i := bytes.LastIndex(tail, []byte(`"usage"`))
	if i < 0 {
		return Usage{}, false
	}
	sc := scanner{b: tail, i: i + len(`"usage"`)}
	sc.ws()
	if sc.peek() != ':' {
		return Usage{}, false
	}
	sc.i++
	sc.ws()
	start := sc.i
	if sc.peek() != '{' || !sc.value(1) {
		return Usage{}, false
	}
	var uj usageJSON
	if json.Unmarshal(tail[start:sc.i], &uj) != nil {
		return Usage{}, false
	}
	return uj.usage(), true
}

// NewUsageTap returns a tap for a response of kind; strip removes the
// usage-only event of an event stream. A JSON document larger than
// maxBuffered bytes is read from its last 4 KiB only; a single event
// larger than that is forwarded without being read.
func NewUsageTap(kind ResponseKind, strip bool, maxBuffered int) *UsageTap {
	return &UsageTap{kind: kind, strip: strip && kind == EventStream, max: maxBuffered}
}

// Usage returns the last usage the body reported, and whether it reported
// any.
func (t *UsageTap) Usage() (Usage, bool) { return t.usage, t.found }

// Strips reports whether the tap may change the body's length.
func (t *UsageTap) Strips() bool { return t.strip }

// Write consumes chunk and returns the bytes to forward now; at eos
// everything held is returned.
func (t *UsageTap) Write(chunk []byte, eos bool) []byte {
	switch t.kind {
	case JSONBody:
		t.buf = append(t.buf, chunk...)
		if len(t.buf) > t.max {
			// Too large to keep (a big embeddings answer, say): keep its
			// tail, where servers put the usage.
			t.over = true
			t.buf = append(t.buf[:0], t.buf[len(t.buf)-tailBytes:]...)
		}
		if eos {
			var u Usage
			ok := false
			if t.over {
				u, ok = tailUsage(t.buf)
			} else {
				u, ok, _ = parseUsage(t.buf)
			}
			if ok {
				t.usage, t.found = u, true
			}
			t.buf = nil
		}
		return chunk
	case EventStream:
		return t.writeSSE(chunk, eos)
	}
	return chunk
}

func (t *UsageTap) writeSSE(chunk []byte, eos bool) []byte {
	data := chunk
	if len(t.buf) > 0 {
		t.buf = append(t.buf, chunk...)
		data = t.buf
	}
	var out []byte
	rest := data
	for {
		end := eventEnd(rest)
		if end < 0 {
			break
		}
		ev := rest[:end]
		rest = rest[end:]
		if t.keep(ev) {
			out = append(out, ev...)
		}
	}
	if eos || len(rest) > t.max {
		if len(rest) > 0 && (!eos || t.keep(rest)) {
			out = append(out, rest...)
		}
		rest = nil
	}
	t.buf = append(t.buf[:0], rest...)
	return out
}

// eventEnd returns the length of the first complete event of b (through
// its blank line: "\n\n", "\r\n\r\n" or "\r\r"), or -1.
func eventEnd(b []byte) int {
	for i := 0; i < len(b); i++ {
		if b[i] != '\n' && b[i] != '\r' {
			continue
		}
		j := i + 1
		if b[i] == '\r' && j < len(b) && b[j] == '\n' {
			j++
		}
		if j < len(b) && (b[j] == '\n' || b[j] == '\r') {
			k := j + 1
			if b[j] == '\r' {
				if k == len(b) {
					return -1 // a "\n" may follow in the next piece
				}
				if b[k] == '\n' {
					k++
				}
			}
			return k
		}
	}
	return -1
}

// keep reads an event's usage and says whether to forward it.
func (t *UsageTap) keep(ev []byte) bool {
	usageOnly := false
	for line := range bytes.Lines(ev) {
		payload, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		payload = bytes.TrimSpace(payload)
		if len(payload) == 0 || payload[0] != '{' {
			continue
		}
		if u, found, only := parseUsage(payload); found {
			t.usage, t.found = u, true
			usageOnly = usageOnly || only
		}
	}
	return !(t.strip && usageOnly)
}
