package openai

import (
	"bytes"
	"encoding/json"
	"strconv"
)

// Generation is what a request body says about its response, for token
// accounting: whether it streams, whether it asked for the usage chunk
// (stream_options.include_usage), and its output cap.
type Generation struct {
	Stream       bool
	IncludeUsage bool
	// MaxTokens is max_tokens, max_completion_tokens or max_output_tokens
	// (the last one given); 0 when none is.
	MaxTokens int64
	// optsStart and optsEnd delimit the raw value of stream_options (both
	// zero when absent).
	optsStart, optsEnd int
}

// ParseGeneration reads the generation settings of a request body; a body
// that is not a JSON object gives the zero Generation.
func ParseGeneration(body []byte) Generation {
	var g Generation
	_ = members(body, func(key []byte, vs, ve int) {
		v := body[vs:ve]
		switch {
		case keyIs(key, "stream"):
			g.Stream = string(v) == "true"
		case keyIs(key, "stream_options"):
			g.optsStart, g.optsEnd = vs, ve
			g.IncludeUsage = false
			if v[0] == '{' {
				var o struct {
					IncludeUsage bool `json:"include_usage"`
				}
				if json.Unmarshal(v, &o) == nil {
					g.IncludeUsage = o.IncludeUsage
				}
			}
		case keyIs(key, "max_tokens"), keyIs(key, "max_completion_tokens"), keyIs(key, "max_output_tokens"):
			if n, err := strconv.ParseInt(string(v), 10, 64); err == nil && n > 0 {
				g.MaxTokens = n
			}
		}
	})
	return g
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
