package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// fleetMain is the fleet child process: n loopback HTTP servers in one
// process, each answering GET /metrics with the same vLLM-shaped page and
// GET /v1/models with one model. It prints the addresses as one JSON line
// on stdout and serves until stdin closes. A line "stall <duration>" on
// stdin makes every /metrics answer wait that long (a scrape hiccup); a
// line "stall <duration> <share>" stalls that share of the answers; a
// line "count" prints "scrapes <n>" (the /metrics requests answered); a
// line "burn <duration>" spins one goroutine per CPU (CPU pressure).
func fleetMain(n int, pagePath string) error {
	page, err := loadPage(pagePath)
	if err != nil {
		return err
	}
	var stallUntil atomic.Int64
	var scrapes atomic.Int64
	var stallShare atomic.Uint64 // math.Float64bits of the share of answers stalled
	models := []byte(`{"object":"list","data":[{"id":"m","object":"model"}]}`)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		scrapes.Add(1)
		if d := time.Until(time.Unix(0, stallUntil.Load())); d > 0 && rand.Float64() < math.Float64frombits(stallShare.Load()) {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("content-type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write(page)
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("content-type", "application/json")
		_, _ = w.Write(models)
	})
	addrs := make([]string, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("fleet listen: %w", err)
		}
		addrs = append(addrs, l.Addr().String())
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(l) }()
	}
	if err := json.NewEncoder(os.Stdout).Encode(addrs); err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 1 && f[0] == "count" {
			fmt.Printf("scrapes %d\n", scrapes.Load())
			continue
		}
		if len(f) < 2 {
			continue
		}
		cmd := f[0]
		d, err := time.ParseDuration(f[1])
		if err != nil {
			fmt.Fprintf(os.Stderr, "fleet: bad command %q\n", in.Text())
			continue
		}
		switch cmd {
		case "stall":
			share := 1.0
			if len(f) > 2 {
				share, _ = strconv.ParseFloat(f[2], 64)
			}
			stallShare.Store(math.Float64bits(share))
			stallUntil.Store(time.Now().Add(d).UnixNano())
		case "burn":
			end := time.Now().Add(d)
			for range runtime.NumCPU() {
				go func() {
					x := uint64(1)
					for time.Now().Before(end) {
						for range 100000 {
							x = x*6364136223846793005 + 1442695040888963407
						}
					}
					_ = x
				}()
			}
		}
	}
	return nil
}

// loadPage reads a metrics page; a vLLM 0.32 page without its HTTP
// instrumentator families and _created series (~37 KB) by default.
func loadPage(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("metrics page: %w", err)
	}
	var out strings.Builder
	for line := range strings.Lines(string(b)) {
		if strings.Contains(line, "http_re") || strings.Contains(line, "_created") {
			continue
		}
		out.WriteString(line)
	}
	return []byte(out.String()), nil
}

// fleet is the parent's handle on the fleet child.
type fleet struct {
	addrs  []string
	ctl    io.WriteCloser
	proc   *child
	counts chan int64
}

func (f *fleet) send(cmd string) {
	_, _ = fmt.Fprintln(f.ctl, cmd)
}

// scrapes returns how many /metrics requests the fleet has answered.
func (f *fleet) scrapes() (int64, error) {
	f.send("count")
	select {
	case n := <-f.counts:
		return n, nil
	case <-time.After(10 * time.Second):
		return 0, fmt.Errorf("fleet did not answer count")
	}
}
