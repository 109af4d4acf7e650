package metrics

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
)

// getter makes plain HTTP/1.1 GETs to one endpoint over one kept-alive
// connection, reading each answer straight into the caller's buffer: a
// scrape costs a write and the reads that bring the page in, without the
// two goroutines, buffered copies and per-request allocations of
// net/http's client. It is what a Manager uses unless Options.Client is
// set. Only what a metrics page needs is supported: GET, no body, no
// compression, no redirects; Content-Length, chunked or read-to-close
// answers. One goroutine uses it at a time; close may be called from
// another to abort a request in progress.
type getter struct {
	addr    string
	dialTO  time.Duration
	mu      sync.Mutex // guards conn against close
	conn    net.Conn
	closed  bool
	scratch []byte // the request being written
	// An answer is read into small until it outgrows it, then into held,
	// a buffer from bufPool kept until release: a large buffer is taken
	// only once a page is coming in, not while waiting for it.
	small []byte
	held  *[]byte
}

// smallBuffer is each getter's own buffer: an answer's headers and the
// start of its body.
const smallBuffer = 2 << 10

// errTooLarge marks an answer over the body limit.
var errTooLarge = errors.New("body too large")

// response is one answer: its status and body (a slice of the caller's
// buffer, valid until the buffer is reused).
type response struct {
	status int
	body   []byte
}

func newGetter(addr string, dialTimeout time.Duration) *getter {
	return &getter{addr: addr, dialTO: dialTimeout}
}

// close drops the connection; a request in progress fails.
func (g *getter) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	if g.conn != nil {
		_ = g.conn.Close()
		g.conn = nil
	}
}

// closeIdle drops the connection; the next request dials a new one.
func (g *getter) closeIdle() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.conn != nil {
		_ = g.conn.Close()
		g.conn = nil
	}
}

// dial returns the kept-alive connection, or a new one.
func (g *getter) dial(deadline time.Time) (net.Conn, bool, error) {
	g.mu.Lock()
	c, closed := g.conn, g.closed
	g.mu.Unlock()
	if closed {
		return nil, false, errors.New("scraper stopped")
	}
	if c != nil {
		return c, true, nil
	}
	d := net.Dialer{Timeout: g.dialTO, Deadline: deadline, KeepAlive: 30 * time.Second}
	c, err := d.Dial("tcp", g.addr)
	if err != nil {
		return nil, false, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		_ = c.Close()
		return nil, false, errors.New("scraper stopped")
	}
	g.conn = c
	return c, false, nil
}

// drop closes c if it is still the kept-alive connection.
func (g *getter) drop(c net.Conn) {
	g.mu.Lock()
	if g.conn == c {
		g.conn = nil
	}
	g.mu.Unlock()
	_ = c.Close()
}

// get sends GET target (a path with its query) with the extra header
// lines hdr (each ending in \r\n) and reads the answer, whose body may
// be up to limit bytes. The body is valid until release. A failure on a
// kept-alive connection before any answer byte (the server closed it
// while idle) is retried once on a new one.
func (g *getter) get(target string, hdr []byte, deadline time.Time, limit int64) (response, error) {
	for attempt := 0; ; attempt++ {
		c, reused, err := g.dial(deadline)
		if err != nil {
			return response{}, err
		}
		resp, got, err := g.exchange(c, target, hdr, deadline, limit)
		if err == nil {
			return resp, nil
		}
		g.drop(c)
		if reused && got == 0 && attempt == 0 && !errors.Is(err, errTooLarge) && time.Now().Before(deadline) {
			continue
		}
		return response{}, err
	}
}

// grow returns a buffer of capacity at least n holding cur's bytes: the
// held pool buffer, or a larger one that replaces it.
func (g *getter) grow(cur []byte, n int) []byte {
	if g.held == nil {
		g.held = bufPool.Get().(*[]byte)
	}
	nb := (*g.held)[:0]
	if cap(nb) < n {
		nb = make([]byte, 0, max(n, 2*cap(cur)))
	}
	nb = append(nb, cur...)
	*g.held = nb
	return nb
}

// release gives the buffer of the last answer back; its body is gone.
func (g *getter) release() {
	if g.held != nil {
		*g.held = (*g.held)[:0]
		bufPool.Put(g.held)
		g.held = nil
	}
}

// exchange writes one request on c and reads its answer; got counts the
// answer bytes read (0: nothing came back).
func (g *getter) exchange(c net.Conn, target string, hdr []byte, deadline time.Time, limit int64) (response, int, error) {
	g.release()
	if err := c.SetDeadline(deadline); err != nil {
		return response{}, 0, err
	}
	req := append(g.scratch[:0], "GET "...)
	req = append(req, target...)
	req = append(req, " HTTP/1.1\r\nHost: "...)
	req = append(req, g.addr...)
	req = append(req, "\r\nUser-Agent: switchyard\r\n"...)
	req = append(req, hdr...)
	req = append(req, "\r\n"...)
	g.scratch = req
	if _, err := c.Write(req); err != nil {
		return response{}, 0, err
	}
	if g.small == nil {
		g.small = make([]byte, 0, smallBuffer)
	}
	r := reader{c: c, buf: g.small[:0], limit: limit, grow: g.grow}
	resp, keep, err := r.response()
	if err != nil {
		return response{}, r.got, err
	}
	if !keep {
		g.drop(c)
	}
	return resp, r.got, nil
}

// reader reads one HTTP/1.1 answer from c into buf.
type reader struct {
	c     net.Conn
	buf   []byte
	got   int // bytes read from c
	pos   int // parse position in buf
	limit int64
	// grow returns a buffer of at least the capacity asked holding the
	// bytes given (nil: make one).
	grow func(cur []byte, n int) []byte
}

// fill reads more bytes into r.buf, growing it as needed but never past
// limit bytes in all.
func (r *reader) fill(limit int) error {
	if len(r.buf) >= limit {
		return errTooLarge
	}
	if len(r.buf) == cap(r.buf) {
		n := min(limit, max(2*cap(r.buf), 64<<10))
		if r.grow != nil {
			r.buf = r.grow(r.buf, n)
		} else {
			nb := make([]byte, len(r.buf), n)
			copy(nb, r.buf)
			r.buf = nb
		}
	}
	end := min(cap(r.buf), limit)
	n, err := r.c.Read(r.buf[len(r.buf):end])
	r.buf = r.buf[:len(r.buf)+n]
	r.got += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// maxHeader bounds the status line and headers of an answer.
const maxHeader = 64 << 10

// response reads the status line, headers and body; keep reports whether
// the connection may carry the next request.
func (r *reader) response() (response, bool, error) {
	for {
		status, clen, chunked, keep, err := r.header()
		if err != nil {
			return response{}, false, err
		}
		if status >= 100 && status < 200 {
			continue // an interim answer: the real one follows
		}
		bound := r.pos + int(min(r.limit+1, int64(1<<30))) + maxHeader
		var body []byte
		switch {
		case status == 204 || status == 304:
		case chunked:
			var extra bool
			body, extra, err = r.chunked(bound)
			keep = keep && !extra
		case clen >= 0:
			if int64(clen) > r.limit {
				return response{}, false, errTooLarge
			}
			for len(r.buf)-r.pos < clen {
				if err := r.fill(r.pos + clen); err != nil {
					return response{}, false, unexpected(err)
				}
			}
			body = r.buf[r.pos : r.pos+clen]
			if len(r.buf) > r.pos+clen {
				keep = false // bytes past the answer: do not trust the stream
			}
		default:
			// No length: the body runs to the end of the connection.
			keep = false
			for {
				err := r.fill(bound)
				if err == io.EOF {
					break
				}
				if err != nil {
					return response{}, false, err
				}
			}
			body = r.buf[r.pos:]
		}
		if err != nil {
			return response{}, false, err
		}
		if int64(len(body)) > r.limit {
			return response{}, false, errTooLarge
		}
		return response{status: status, body: body}, keep, nil
	}
}

// header reads a status line and header block starting at r.pos and
// leaves r.pos at the body.
func (r *reader) header() (status, clen int, chunked, keep bool, err error) {
	var end int
	for {
		if i := bytes.Index(r.buf[r.pos:], []byte("\r\n\r\n")); i >= 0 {
			end = r.pos + i + 4
			break
		}
		if err := r.fill(r.pos + maxHeader); err != nil {
			if errors.Is(err, errTooLarge) {
				return 0, 0, false, false, errors.New("answer headers too large")
			}
			return 0, 0, false, false, unexpected(err)
		}
	}
	block := r.buf[r.pos : end-2]
	r.pos = end
	line, rest, _ := bytes.Cut(block, []byte("\r\n"))
	// HTTP/1.x SP 3DIGIT SP reason
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return 0, 0, false, false, fmt.Errorf("malformed status line %q", truncate(line))
	}
	status, err = strconv.Atoi(string(line[9:12]))
	if err != nil || status < 100 || (len(line) > 12 && line[12] != ' ') {
		return 0, 0, false, false, fmt.Errorf("malformed status line %q", truncate(line))
	}
	keep = line[7] == '1' // HTTP/1.1 keeps the connection by default
	clen = -1
	for len(rest) > 0 {
		var h []byte
		h, rest, _ = bytes.Cut(rest, []byte("\r\n"))
		name, val, ok := bytes.Cut(h, []byte(":"))
		if !ok {
			return 0, 0, false, false, fmt.Errorf("malformed header %q", truncate(h))
		}
		val = bytes.TrimSpace(val)
		switch {
		case asciiEqualFold(name, "content-length"):
			n, err := strconv.ParseInt(string(val), 10, 64)
			if err != nil || n < 0 || (clen >= 0 && int64(clen) != n) {
				return 0, 0, false, false, fmt.Errorf("bad content-length %q", truncate(val))
			}
			clen = int(min(n, 1<<31-1))
		case asciiEqualFold(name, "transfer-encoding"):
			if !asciiEqualFold(val, "chunked") {
				return 0, 0, false, false, fmt.Errorf("unsupported transfer-encoding %q", truncate(val))
			}
			chunked = true
		case asciiEqualFold(name, "connection"):
			for _, tok := range bytes.Split(val, []byte(",")) {
				tok = bytes.TrimSpace(tok)
				switch {
				case asciiEqualFold(tok, "close"):
					keep = false
				case asciiEqualFold(tok, "keep-alive"):
					keep = keep || line[7] == '0'
				}
			}
		}
	}
	if chunked {
		clen = -1
	}
	return status, clen, chunked, keep, nil
}

// chunked decodes a chunked body in place (each chunk's data moved down
// to follow the previous one's) and returns it; extra reports bytes
// after it. r.buf never grows past bound.
func (r *reader) chunked(bound int) (body []byte, extra bool, err error) {
	start, out := r.pos, r.pos  // the decoded body is r.buf[start:out]
	need := func(n int) error { // n bytes at r.pos
		for len(r.buf)-r.pos < n {
			if r.pos > out { // drop the framing already read
				k := copy(r.buf[out:], r.buf[r.pos:])
				r.buf, r.pos = r.buf[:out+k], out
			}
			if err := r.fill(bound); err != nil {
				return unexpected(err)
			}
		}
		return nil
	}
	line := func() ([]byte, error) {
		for {
			if i := bytes.Index(r.buf[r.pos:], []byte("\r\n")); i >= 0 {
				l := r.buf[r.pos : r.pos+i]
				r.pos += i + 2
				return l, nil
			}
			if len(r.buf)-r.pos > 1024 {
				return nil, errors.New("chunk framing line too long")
			}
			if err := need(len(r.buf) - r.pos + 1); err != nil {
				return nil, err
			}
		}
	}
	for {
		l, err := line()
		if err != nil {
			return nil, false, err
		}
		if j := bytes.IndexByte(l, ';'); j >= 0 {
			l = l[:j] // chunk extensions
		}
		size, err := strconv.ParseUint(string(bytes.TrimSpace(l)), 16, 31)
		if err != nil {
			return nil, false, fmt.Errorf("bad chunk size %q", truncate(l))
		}
		if size == 0 {
			for { // trailers, up to an empty line
				t, err := line()
				if err != nil {
					return nil, false, err
				}
				if len(t) == 0 {
					return r.buf[start:out], len(r.buf) > r.pos, nil
				}
			}
		}
		n := int(size)
		if int64(out-start+n) > r.limit {
			return nil, false, errTooLarge
		}
		if err := need(n + 2); err != nil {
			return nil, false, err
		}
		if r.buf[r.pos+n] != '\r' || r.buf[r.pos+n+1] != '\n' {
			return nil, false, errors.New("chunk not followed by CRLF")
		}
		copy(r.buf[out:], r.buf[r.pos:r.pos+n])
		out += n
		r.pos += n + 2
	}
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if c >= 'A' && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}
