// Package openai owns the picker's view of OpenAI-style HTTP bodies: finding
// the top-level "model" and the prompt of a request in one validating pass
// without decoding the document, rewriting the model in place (every
// other byte preserved), and rewriting the "model" of JSON and
// server-sent-event responses back to the name the client asked for.
package openai

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"strings"
	"unicode/utf8"
	"unsafe"
)

// Errors returned by ParseRequest.
var (
	ErrInvalidJSON = errors.New("request body is not a valid JSON object")
	ErrNoModel     = errors.New(`request body has no string "model" field`)
)

// Request is what the picker needs from a request body.
type Request struct {
	// Model is the decoded top-level "model" value.
	Model string
	// ValueStart and ValueEnd delimit the raw JSON string token of the
	// model value in the body, quotes included: body[ValueStart:ValueEnd].
	ValueStart, ValueEnd int
	// PromptStart and PromptEnd delimit the raw JSON value of the first
	// top-level "messages" (chat) or "prompt" (completions) key; both are
	// zero when there is none.
	PromptStart, PromptEnd int
	// Stream is set when the top-level "stream" is true, as the engine
	// reads it (1 and "yes" are true too; see laxBool): the answer comes
	// as server-sent events, its first bytes with the first token.
	Stream bool
}

// Prompt returns the part of body that carries the prompt, for prefix
// hashing: the raw value of its first top-level "messages" or "prompt"
// key, so requests that share a system prompt share a prefix of these
// bytes whatever order the client wrote the other fields in. Without
// either key (or for a body that did not parse) it is the whole body.
// The result aliases body (no copy): body must not change while it is
// used.
func (r Request) Prompt(body []byte) string {
	lo, hi := r.PromptStart, r.PromptEnd
	if hi <= lo || hi > len(body) {
		lo, hi = 0, len(body)
	}
	if hi == lo {
		return ""
	}
	return unsafe.String(&body[lo], hi-lo)
}

// inferencePaths are the OpenAI endpoints that must carry a model.
var inferencePaths = [...]string{"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"}

// IsInferencePath reports whether path (query string allowed) is an OpenAI
// inference endpoint whose POST body must name a model.
func IsInferencePath(path string) bool {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	path = strings.TrimSuffix(path, "/")
	for _, p := range inferencePaths {
		if path == p {
			return true
		}
	}
	return false
}

// maxDepth bounds nesting so hostile bodies cannot exhaust the stack.
const maxDepth = 512

// ParseRequest validates body as one JSON object and finds its top-level
// "model" string and its prompt (see Request.Prompt) in a single pass,
// without decoding anything else. When the model key appears more than
// once the last one wins, as with encoding/json and Python's json module.
// With ErrNoModel the Request still locates the prompt of the valid
// object.
func ParseRequest(body []byte) (Request, error) {
	r, raw, err := scanRequest(body)
	if err != nil {
		return r, err
	}
	if r.Model = DecodeString(raw); r.Model == "" {
		return noModel(r)
	}
	return r, nil
}

// ModelSpan is ParseRequest without materialising the model name: it
// returns the Request (Model unset) and the raw JSON string token of the
// model (quotes included), which callers can look up with
// string(tok[1:len(tok)-1]) when !NeedsDecode(tok), else with
// DecodeString(tok).
func ModelSpan(body []byte) (Request, []byte, error) {
	r, raw, err := scanRequest(body)
	if err != nil {
		return r, nil, err
	}
	if len(raw) <= 2 {
		r, err = noModel(r)
		return r, nil, err
	}
	return r, raw, nil
}

// noModel is the result for a valid object without a usable model: only
// the prompt span is kept.
func noModel(r Request) (Request, error) {
	return Request{PromptStart: r.PromptStart, PromptEnd: r.PromptEnd}, ErrNoModel
}

// NeedsDecode reports whether a raw string token must go through the JSON
// decoder (escapes or invalid UTF-8) rather than be used verbatim.
func NeedsDecode(tok []byte) bool {
	inner := tok[1 : len(tok)-1]
	return bytes.IndexByte(inner, '\\') >= 0 || !utf8.Valid(inner)
}

// DecodeString turns a raw JSON string token (quotes included) into its
// Go value; "" if it is not a valid string token.
func DecodeString(tok []byte) string {
	if len(tok) < 2 {
		return ""
	}
	if !NeedsDecode(tok) {
		return string(tok[1 : len(tok)-1])
	}
	var s string
	if json.Unmarshal(tok, &s) != nil {
		return ""
	}
	return s
}

func scanRequest(body []byte) (Request, []byte, error) {
	sc := scanner{b: body}
	sc.ws()
	if sc.i >= len(body) || body[sc.i] != '{' {
		return Request{}, nil, ErrInvalidJSON
	}
	var r Request
	var raw []byte
	modelIsString := false
	sc.i++
	sc.ws()
	if sc.peek() == '}' {
		sc.i++
	} else {
		for {
			sc.ws()
			ks := sc.i
			if !sc.str() {
				return Request{}, nil, ErrInvalidJSON
			}
			key := body[ks:sc.i]
			sc.ws()
			if sc.peek() != ':' {
				return Request{}, nil, ErrInvalidJSON
			}
			sc.i++
			sc.ws()
			vs := sc.i
			if !sc.value(1) {
				return Request{}, nil, ErrInvalidJSON
			}
			switch {
			case keyIs(key, "model"):
				modelIsString = body[vs] == '"'
				r.ValueStart, r.ValueEnd = vs, sc.i
				raw = body[vs:sc.i]
			case r.PromptEnd == 0 && (keyIs(key, "messages") || keyIs(key, "prompt")):
				r.PromptStart, r.PromptEnd = vs, sc.i
			case keyIs(key, "stream"):
				r.Stream, _ = laxBool(body[vs:sc.i])
			}
			sc.ws()
			c := sc.peek()
			sc.i++
			if c == '}' {
				break
			}
			if c != ',' {
				return Request{}, nil, ErrInvalidJSON
			}
		}
	}
	sc.ws()
	if sc.i != len(body) {
		return Request{}, nil, ErrInvalidJSON
	}
	if !modelIsString {
		r, err := noModel(r)
		return r, nil, err
	}
	return r, raw, nil
}

func keyIs(tok []byte, want string) bool {
	if len(tok) == len(want)+2 && string(tok[1:len(tok)-1]) == want {
		return true
	}
	if bytes.IndexByte(tok, '\\') < 0 {
		return false
	}
	return DecodeString(tok) == want
}

// scanner is a strict, allocation-free JSON validator.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) peek() byte {
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// value validates one JSON value starting at s.i.
func (s *scanner) value(depth int) bool {
	switch s.peek() {
	case '"':
		return s.str()
	case '{':
		return s.object(depth + 1)
	case '[':
		return s.array(depth + 1)
	case 't':
		return s.lit("true")
	case 'f':
		return s.lit("false")
	case 'n':
		return s.lit("null")
	default:
		return s.number()
	}
}

func (s *scanner) lit(l string) bool {
	if len(s.b)-s.i < len(l) || string(s.b[s.i:s.i+len(l)]) != l {
		return false
	}
	s.i += len(l)
	return true
}

func (s *scanner) object(depth int) bool {
	if depth > maxDepth {
		return false
	}
	s.i++ // '{'
	s.ws()
	if s.peek() == '}' {
		s.i++
		return true
	}
	for {
		s.ws()
		if !s.str() {
			return false
		}
		s.ws()
		if s.peek() != ':' {
			return false
		}
		s.i++
		s.ws()
		if !s.value(depth) {
			return false
		}
		s.ws()
		c := s.peek()
		s.i++
		switch c {
		case '}':
			return true
		case ',':
		default:
			return false
		}
	}
}

func (s *scanner) array(depth int) bool {
	if depth > maxDepth {
		return false
	}
	s.i++ // '['
	s.ws()
	if s.peek() == ']' {
		s.i++
		return true
	}
	for {
		s.ws()
		if !s.value(depth) {
			return false
		}
		s.ws()
		c := s.peek()
		s.i++
		switch c {
		case ']':
			return true
		case ',':
		default:
			return false
		}
	}
}

// str validates a string token starting at s.i (which must be '"').
func (s *scanner) str() bool {
	b := s.b
	if s.i >= len(b) || b[s.i] != '"' {
		return false
	}
	i := s.i + 1
	quote := -1 // position of the next '"' at or after i, once searched
	for i < len(b) {
		i = skipPlain(b, i, &quote)
		if i >= len(b) {
			break
		}
		c := b[i]
		switch {
		case c == '"':
			s.i = i + 1
			return true
		case c == '\\':
			if i+1 >= len(b) {
				return false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) {
					return false
				}
				for _, h := range b[i+2 : i+6] {
					if !isHex(h) {
						return false
					}
				}
				i += 6
			default:
				return false
			}
		case c < 0x20:
			return false
		default:
			i++
		}
	}
	return false
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// skipPlain returns the position of the first '"', '\\' or control
// character at or after i (len(b) if none); the long prompt strings
// dominate request bodies. The quote and backslash are found with
// bytes.IndexByte (vectorised); *quote caches the next quote's position
// across calls for one string, so every byte is searched once however
// many escapes the string has. Control characters are found 32 bytes at a
// time (four SWAR "byte below 0x20" tests per step).
func skipPlain(b []byte, i int, quote *int) int {
	if *quote < i {
		if k := bytes.IndexByte(b[i:], '"'); k >= 0 {
			*quote = i + k
		} else {
			*quote = len(b)
		}
	}
	end := *quote
	if k := bytes.IndexByte(b[i:end], '\\'); k >= 0 {
		end = i + k
	}
	for ; i+32 <= end; i += 32 {
		w := b[i : i+32 : i+32]
		x0, x1 := binary.LittleEndian.Uint64(w[0:8]), binary.LittleEndian.Uint64(w[8:16])
		x2, x3 := binary.LittleEndian.Uint64(w[16:24]), binary.LittleEndian.Uint64(w[24:32])
		if (below20(x0)|below20(x1)|below20(x2)|below20(x3))&msb != 0 {
			break
		}
	}
	for ; i+8 <= end; i += 8 {
		if below20(binary.LittleEndian.Uint64(b[i:i+8]))&msb != 0 {
			break
		}
	}
	for i < end && b[i] >= 0x20 {
		i++
	}
	return i
}

// below20 has the high bit of some byte set if and only if x has a byte
// below 0x20 (exact for the whole word, not per byte).
func below20(x uint64) uint64 { return (x - 0x20*lsb) &^ x }

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

// number validates -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() bool {
	b, i := s.b, s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return false
		}
	}
	s.i = i
	return true
}

// AppendString appends s as a JSON string literal.
func AppendString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			dst = append(dst, `\ufffd`...)
		} else {
			dst = append(dst, s[i:i+n]...)
		}
		i += n
	}
	return append(dst, '"')
}

// RewriteModel returns a new body equal to body with the model value token
// of r replaced by model; every other byte is preserved.
func RewriteModel(body []byte, r Request, model string) []byte {
	out := make([]byte, 0, len(body)+len(model)+8-(r.ValueEnd-r.ValueStart))
	out = append(out, body[:r.ValueStart]...)
	out = AppendString(out, model)
	return append(out, body[r.ValueEnd:]...)
}

// EstimateTokens is the picker's cheap prompt-size estimate (~4 bytes per
// token).
func EstimateTokens(body []byte) int64 { return int64(len(body)+3) / 4 }
