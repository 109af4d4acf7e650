package metrics

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// rawServer answers each request read on a connection with the next of
// its scripted answers (bytes written as they are), and counts the
// connections it accepted and the request lines it read.
type rawServer struct {
	ln      net.Listener
	answers func(n int) (answer string, closeAfter bool)
	conns   atomic.Int64
	mu      sync.Mutex
	lines   []string
	wg      sync.WaitGroup
}

func newRawServer(t *testing.T, answers func(n int) (string, bool)) *rawServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &rawServer{ln: ln, answers: answers}
	var n atomic.Int64
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.conns.Add(1)
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						return
					}
					s.mu.Lock()
					s.lines = append(s.lines, strings.TrimSpace(line))
					s.mu.Unlock()
					for { // the rest of the header block
						h, err := br.ReadString('\n')
						if err != nil {
							return
						}
						if h == "\r\n" {
							break
						}
					}
					ans, closeAfter := s.answers(int(n.Add(1)))
					if _, err := io.WriteString(c, ans); err != nil || closeAfter {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); s.wg.Wait() })
	return s
}

func (s *rawServer) requestLines() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.lines...)
}

func getOnce(t *testing.T, g *getter, limit int64) (response, error) {
	t.Helper()
	return g.get("/metrics", []byte(acceptHeader), time.Now().Add(2*time.Second), limit)
}

func TestGetterAnswers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, answer string
		want         string
		status       int
		reuse        bool // the connection is kept
	}{
		{"content-length", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", "hello", 200, true},
		{"chunked with extension and trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: 1\r\n\r\n", "hello", 200, true},
		{"interim answer first", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", "ok", 200, true},
		{"connection close", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", "ok", 200, false},
		{"HTTP/1.0 without keep-alive", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "ok", 200, false},
		{"error status", "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", "busy", 503, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newRawServer(t, func(int) (string, bool) { return tc.answer, false })
			g := newGetter(srv.ln.Addr().String(), time.Second)
			defer g.close()
			for i := range 2 {
				resp, err := getOnce(t, g, 1<<20)
				if err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
				if resp.status != tc.status || string(resp.body) != tc.want {
					t.Fatalf("request %d: %d %q, want %d %q", i, resp.status, resp.body, tc.status, tc.want)
				}
			}
			want := int64(1)
			if !tc.reuse {
				want = 2
			}
			if n := srv.conns.Load(); n != want {
				t.Errorf("%d connections for 2 requests, want %d", n, want)
			}
		})
	}
}

func TestGetterBodyToEOF(t *testing.T) {
	t.Parallel()
	srv := newRawServer(t, func(int) (string, bool) { return "HTTP/1.1 200 OK\r\n\r\nuntil the end", true })
	g := newGetter(srv.ln.Addr().String(), time.Second)
	defer g.close()
	resp, err := getOnce(t, g, 1<<20)
	if err != nil || string(resp.body) != "until the end" {
		t.Fatalf("%q %v", resp.body, err)
	}
}

func TestGetterRefusesBadAnswers(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("x", 100)
	for _, tc := range []struct {
		name, answer, want string
	}{
		{"over the limit by length", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + big, "too large"},
		{"over the limit chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n" + big + "\r\n0\r\n\r\n", "too large"},
		{"over the limit to EOF", "HTTP/1.1 200 OK\r\n\r\n" + big, "too large"},
		{"short body", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "unexpected EOF"},
		{"bad status line", "HTTP/2 200\r\n\r\n", "malformed status line"},
		{"bad chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"},
		{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "content-length"},
		{"gzip", "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported transfer-encoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newRawServer(t, func(int) (string, bool) { return tc.answer, true })
			g := newGetter(srv.ln.Addr().String(), time.Second)
			defer g.close()
			_, err := getOnce(t, g, 50)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

// A server that closes a kept-alive connection while it is idle costs a
// retry on a new connection, not a failed scrape.
func TestGetterRetriesAClosedIdleConnection(t *testing.T) {
	t.Parallel()
	srv := newRawServer(t, func(n int) (string, bool) {
		return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d", n), true // closes after answering, without saying so
	})
	g := newGetter(srv.ln.Addr().String(), time.Second)
	defer g.close()
	for i := 1; i <= 3; i++ {
		resp, err := getOnce(t, g, 10)
		if err != nil || string(resp.body) != fmt.Sprint(i) {
			t.Fatalf("request %d: %q %v", i, resp.body, err)
		}
	}
	if n := srv.conns.Load(); n != 3 {
		t.Errorf("%d connections, want 3", n)
	}
}

// close aborts a request in progress at once.
func TestGetterCloseAborts(t *testing.T) {
	t.Parallel()
	block := make(chan struct{})
	srv := newRawServer(t, func(int) (string, bool) { <-block; return "", true })
	defer close(block)
	g := newGetter(srv.ln.Addr().String(), time.Second)
	done := make(chan error, 1)
	go func() {
		_, err := g.get("/metrics", nil, time.Now().Add(time.Minute), 10)
		done <- err
	}()
	testutil.Eventually(t, 10*time.Second, "request sent", func() error {
		if len(srv.requestLines()) == 0 {
			return errors.New("no request yet")
		}
		return nil
	})
	g.close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("aborted request succeeded")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("close did not abort the request")
	}
}

// The getter reads what Go's own server sends: chunked pages larger than
// its buffer, and the same on a kept-alive connection.
func TestGetterAgainstNetHTTP(t *testing.T) {
	t.Parallel()
	page := strings.Repeat("vllm:num_requests_waiting{model_name=\"m\"} 1\n", 3000)
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, page) // no Content-Length: chunked
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	g := newGetter(strings.TrimPrefix(srv.URL, "http://"), time.Second)
	defer g.close()
	for i := range 3 {
		resp, err := g.get("/metrics", nil, time.Now().Add(5*time.Second), 1<<20)
		if err != nil || resp.status != 200 || string(resp.body) != page {
			t.Fatalf("request %d: %d, %d bytes, %v", i, resp.status, len(resp.body), err)
		}
		g.release()
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections for 3 requests, want 1", n)
	}
}
