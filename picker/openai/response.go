package openai

import (
	"bytes"
	"mime"
	"strings"
)

// ResponseKind says how a response body is rewritten.
type ResponseKind int

// Response kinds.
const (
	// Passthrough bodies are forwarded unchanged.
	Passthrough ResponseKind = iota
	// JSONBody is one JSON document, buffered until end of stream.
	JSONBody
	// EventStream is text/event-stream; every "data:" line holding a JSON
	// object is rewritten as soon as the line is complete.
	EventStream
)

// KindOf maps a response Content-Type onto a ResponseKind.
func KindOf(contentType string) ResponseKind {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		mt = strings.ToLower(strings.TrimSpace(contentType))
	}
	switch {
	case mt == "text/event-stream":
		return EventStream
	case mt == "application/json" || strings.HasSuffix(mt, "+json"):
		return JSONBody
	}
	return Passthrough
}

// ResponseRewriter rewrites the top-level "model" of a response body, fed in
// arbitrary chunks, to the model name the client sent.
type ResponseRewriter struct {
	kind  ResponseKind
	model string
	max   int
	buf   []byte
}

// NewResponseRewriter returns a rewriter for kind that sets "model" to
// model. A JSON body larger than maxBuffered bytes is passed through
// unchanged rather than buffered further.
func NewResponseRewriter(kind ResponseKind, model string, maxBuffered int) *ResponseRewriter {
	return &ResponseRewriter{kind: kind, model: model, max: maxBuffered}
}

// Write consumes chunk and returns the bytes to forward now (possibly
// empty: data is held back until a line or the document is complete). When
// eos is true everything still held is returned.
func (w *ResponseRewriter) Write(chunk []byte, eos bool) []byte {
	switch w.kind {
	case JSONBody:
		return w.writeJSON(chunk, eos)
	case EventStream:
		return w.writeSSE(chunk, eos)
	}
	return chunk
}

func (w *ResponseRewriter) writeJSON(chunk []byte, eos bool) []byte {
	w.buf = append(w.buf, chunk...)
	if len(w.buf) > w.max {
		// Too big to hold: give up on rewriting and stream the rest.
		w.kind = Passthrough
		out := w.buf
		w.buf = nil
		return out
	}
	if !eos {
		return nil
	}
	out := w.buf
	w.buf = nil
	return rewriteDoc(out, w.model)
}

func rewriteDoc(doc []byte, model string) []byte {
	r, err := ParseRequest(doc)
	if err != nil {
		return doc
	}
	if r.Model == model {
		return doc
	}
	return RewriteModel(doc, r, model)
}

func (w *ResponseRewriter) writeSSE(chunk []byte, eos bool) []byte {
	var data []byte
	if len(w.buf) > 0 {
		w.buf = append(w.buf, chunk...)
		data = w.buf
	} else {
		data = chunk
	}
	cut := bytes.LastIndexByte(data, '\n') + 1
	if eos {
		cut = len(data)
	}
	var out []byte
	if cut > 0 {
		out = make([]byte, 0, cut+64)
		rest := data[:cut]
		for len(rest) > 0 {
			line := rest
			if j := bytes.IndexByte(rest, '\n'); j >= 0 {
				line, rest = rest[:j+1], rest[j+1:]
			} else {
				rest = nil
			}
			out = w.appendLine(out, line)
		}
	}
	tail := data[cut:]
	if len(tail) > w.max {
		// A single line beyond the limit is forwarded unchanged.
		out = append(out, tail...)
		tail = nil
	}
	w.buf = append(w.buf[:0], tail...)
	return out
}

// appendLine appends one SSE line (with its terminator, if any), rewriting
// a "data:" field that holds a JSON object.
func (w *ResponseRewriter) appendLine(out, line []byte) []byte {
	if !bytes.HasPrefix(line, []byte("data:")) {
		return append(out, line...)
	}
	body := line[len("data:"):]
	end := len(body)
	for end > 0 && (body[end-1] == '\n' || body[end-1] == '\r') {
		end--
	}
	start := 0
	for start < end && body[start] == ' ' {
		start++
	}
	payload := body[start:end]
	if len(payload) == 0 || payload[0] != '{' {
		return append(out, line...)
	}
	out = append(out, line[:len("data:")+start]...)
	out = append(out, rewriteDoc(payload, w.model)...)
	return append(out, body[end:]...)
}
