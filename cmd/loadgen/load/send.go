package load

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// ServedByHeader is the response header naming the model server that
// answered; the report counts requests per value.
const ServedByHeader = "x-served-by"

// Error kinds in Report errors (besides "http <status>").
const (
	ErrTransport  = "transport"    // connection refused/reset, malformed HTTP
	ErrTimeout    = "timeout"      // the per-request timeout fired
	ErrStream     = "stream"       // the SSE stream broke off or carried an error event
	ErrBadBody    = "bad-response" // 200 with a body that is not the expected JSON
	ErrCancelled  = "cancelled"    // cut off by Ctrl-C or the drain timeout (not a server fault)
	maxLineBytes  = 4 << 20
	maxErrorBytes = 64 << 10
)

// result is what one request measured.
type result struct {
	stage      int
	start, end time.Time
	status     int    // HTTP status, 0 if none was received
	errKind    string // "" on success
	detail     string // first error text, for logs

	firstToken time.Time // zero if no token event arrived
	itl        []time.Duration
	events     int // token-carrying stream events (or 1 for a non-streamed answer)
	outTokens  int
	prompt     int
	cached     int
	usageSeen  bool

	server string
	model  string
	answer string // only collected for multi-turn
}

// streamChunk covers both completions and chat streaming chunks and their
// non-streamed bodies.
type streamChunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

func (c *streamChunk) text() string {
	if len(c.Choices) == 1 { // the common case: no concatenation
		ch := &c.Choices[0]
		switch {
		case ch.Text != "":
			return ch.Text
		case ch.Delta.Content != "":
			return ch.Delta.Content
		default:
			return ch.Message.Content
		}
	}
	var s string
	for _, ch := range c.Choices {
		s += ch.Text + ch.Delta.Content + ch.Message.Content
	}
	return s
}

func (r *result) takeUsage(c *streamChunk) {
	if c.Usage == nil {
		return
	}
	r.usageSeen = true
	r.prompt = c.Usage.PromptTokens
	r.outTokens = c.Usage.CompletionTokens
	if d := c.Usage.PromptTokensDetails; d != nil {
		r.cached = d.CachedTokens
	}
}

// newHTTPClient returns a client tuned for load: keep-alive with enough idle
// connections per host for every in-flight request, no proxy, no
// transparent gzip (it would buffer SSE), no client-level timeout (each
// request carries its own deadline).
func newHTTPClient(maxConns int) *http.Client {
	tr := &http.Transport{
		Proxy: nil,
		DialContext: (&net.Dialer{
			Timeout:   5 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:          maxConns,
		MaxIdleConnsPerHost:   maxConns,
		IdleConnTimeout:       90 * time.Second,
		DisableCompression:    true,
		ResponseHeaderTimeout: 0,
		ExpectContinueTimeout: 0,
		ForceAttemptHTTP2:     false,
	}
	return &http.Client{Transport: tr}
}

// sender sends requests and measures them.
type sender struct {
	client    *http.Client
	endpoints []string      // used in turn (round-robin) when several
	next      atomic.Uint64 // the next endpoint's index
	headers   http.Header
	stream    bool
	timeout   time.Duration
	session   string // session header name
}

// do sends req and measures it. parent is cancelled on Ctrl-C or when the
// drain timeout expires; those requests are reported as cancelled.
func (s *sender) do(parent context.Context, req *request, stage int) *result {
	res := &result{stage: stage, model: req.model}
	ctx, cancel := context.WithTimeout(parent, s.timeout)
	defer cancel()

	endpoint := s.endpoints[0]
	if len(s.endpoints) > 1 {
		endpoint = s.endpoints[(s.next.Add(1)-1)%uint64(len(s.endpoints))]
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(req.body))
	if err != nil {
		res.start = time.Now()
		res.end = res.start
		res.errKind, res.detail = ErrTransport, err.Error()
		return res
	}
	for k, vs := range s.headers {
		hr.Header[k] = vs
	}
	hr.Header.Set("Content-Type", "application/json")
	if s.stream {
		hr.Header.Set("Accept", "text/event-stream")
	}
	if req.sessionID != "" {
		hr.Header.Set(s.session, req.sessionID)
	}

	res.start = time.Now()
	resp, err := s.client.Do(hr)
	if err != nil {
		res.end = time.Now()
		res.errKind, res.detail = classify(parent, ctx, err, ErrTransport), err.Error()
		return res
	}
	defer resp.Body.Close()
	res.status = resp.StatusCode
	res.server = resp.Header.Get(ServedByHeader)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBytes))
		res.end = time.Now()
		res.errKind = fmt.Sprintf("http %d", resp.StatusCode)
		res.detail = strings.TrimSpace(string(msg))
		return res
	}
	var answer *strings.Builder
	if req.session != nil {
		answer = &strings.Builder{}
	}
	if s.stream {
		s.readStream(parent, ctx, resp.Body, res, answer)
	} else {
		s.readWhole(parent, ctx, resp.Body, res, answer)
	}
	if answer != nil {
		res.answer = answer.String()
	}
	return res
}

func (s *sender) readStream(parent, ctx context.Context, body io.Reader, res *result, answer *strings.Builder) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 4<<10), maxLineBytes) // grows for long events
	var last time.Time
	sawDone := false
	for sc.Scan() {
		line := bytes.TrimRight(sc.Bytes(), "\r")
		payload, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue // blank separators, comments, event: lines
		}
		now := time.Now()
		payload = bytes.TrimSpace(payload)
		if bytes.Equal(payload, []byte("[DONE]")) {
			sawDone = true
			res.end = now
			// Read to EOF (the chunked terminator follows at once) so the
			// keep-alive connection goes back to the pool instead of
			// being closed.
			_, _ = io.Copy(io.Discard, io.LimitReader(body, maxLineBytes))
			break
		}
		var c streamChunk
		if err := json.Unmarshal(payload, &c); err != nil {
			res.end = now
			res.errKind, res.detail = ErrStream, fmt.Sprintf("bad SSE event %.200q: %v", payload, err)
			return
		}
		if len(c.Error) > 0 && string(c.Error) != "null" {
			res.end = now
			res.errKind, res.detail = ErrStream, fmt.Sprintf("error event: %.500s", c.Error)
			return
		}
		res.takeUsage(&c)
		txt := c.text()
		if txt == "" {
			continue // role-only delta, usage-only chunk, finish chunk
		}
		if answer != nil {
			answer.WriteString(txt)
		}
		res.events++
		if res.firstToken.IsZero() {
			res.firstToken = now
		} else {
			res.itl = append(res.itl, now.Sub(last))
		}
		last = now
	}
	if !sawDone {
		res.end = time.Now()
		err := sc.Err()
		detail := "stream ended without data: [DONE]"
		if err != nil {
			detail = err.Error()
		}
		res.errKind, res.detail = classify(parent, ctx, err, ErrStream), detail
		return
	}
	if !res.usageSeen {
		res.outTokens = res.events
	}
}

func (s *sender) readWhole(parent, ctx context.Context, body io.Reader, res *result, answer *strings.Builder) {
	raw, err := io.ReadAll(io.LimitReader(body, 64<<20))
	res.end = time.Now()
	if err != nil {
		res.errKind, res.detail = classify(parent, ctx, err, ErrTransport), err.Error()
		return
	}
	var c streamChunk
	if err := json.Unmarshal(raw, &c); err != nil {
		res.errKind, res.detail = ErrBadBody, fmt.Sprintf("%v: %.200q", err, raw)
		return
	}
	res.takeUsage(&c)
	if answer != nil {
		answer.WriteString(c.text())
	}
	if c.text() != "" {
		res.events = 1
	}
}

// classify turns a failure into an error kind: cancelled by the run,
// timed out by the per-request deadline, or fallback.
func classify(parent, ctx context.Context, err error, fallback string) string {
	switch {
	case parent.Err() != nil:
		return ErrCancelled
	case ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded):
		return ErrTimeout
	default:
		return fallback
	}
}
