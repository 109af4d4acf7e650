package status

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

// memPages answers every scrape with the recorded vLLM 0.32 page, from
// memory.
type memPages []byte

func (p memPages) RoundTrip(r *http.Request) (*http.Response, error) {
	body := []byte(p)
	if r.URL.Path == "/v1/models" {
		body = []byte(`{"object":"list","data":[{"id":"llama","object":"model"}]}`)
	}
	return &http.Response{StatusCode: http.StatusOK, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"text/plain; version=0.0.4"}}, ContentLength: int64(len(body)),
		Body: io.NopCloser(bytes.NewReader(body)), Request: r}, nil
}

// inUse returns the live heap and the goroutine stacks in use.
func inUse() (heap, stacks uint64) {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc, m.StackInuse
}

// BenchmarkMemoryPerEndpoint measures the memory switchyard spends per
// endpoint of a large pool (issue 25): the picker with its scraper
// (snapshots, parsers, per-endpoint counters) once every endpoint has been
// read, the goroutine stacks (a scrape goroutine per endpoint), and the
// status page's history full (15 minutes of samples every 5 s). The prefix index and the session table are bounded on their own
// (prefix.DefaultMaxEntries, sched.DefaultSessionCapacity), whatever the
// endpoint count. Pages come from memory, so connections are not counted
// (the getter's are a few hundred bytes each). Run:
//
//	go test -run '^$' -bench MemoryPerEndpoint -benchtime 1x ./internal/status/
func BenchmarkMemoryPerEndpoint(b *testing.B) {
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		b.Fatal(err)
	}
	const n = 1000
	st := registry.Empty()
	st.Version = 1
	pool := &registry.Pool{Name: "big", Engine: registry.EngineVLLM}
	for i := range n {
		pool.Endpoints = append(pool.Endpoints, registry.Endpoint{Address: fmt.Sprintf("10.1.%d.%d:8000", i/250, i%250+1)})
	}
	st.Pools["big"] = pool
	st.Models["llama"] = &registry.Model{Name: "llama", Pool: "big"}
	for range b.N {
		base, baseStacks := inUse()
		p := picker.New(registry.NewPublisher(st), picker.Options{Metrics: metrics.Options{
			Client: &http.Client{Transport: memPages(page)}, Interval: time.Hour, IdleInterval: time.Hour}}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = p.Run(ctx) }()
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
			scraped := 0
			for _, e := range p.Stats().Endpoints {
				if e.Metrics != nil && !e.Metrics.LastSuccess.IsZero() {
					scraped++
				}
			}
			if scraped == n {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d endpoints scraped", scraped, n)
			}
		}
		withPicker, stacks := inUse()
		h := NewHistory(p, DefaultHistoryInterval, DefaultHistoryWindow)
		t0 := time.Now()
		for i := range int(DefaultHistoryWindow / DefaultHistoryInterval) {
			h.Sample(t0.Add(time.Duration(i) * DefaultHistoryInterval))
		}
		withHistory, _ := inUse()
		b.ReportMetric(float64(withPicker-base)/n, "picker-B/endpoint")
		b.ReportMetric(float64(stacks-baseStacks)/n, "stack-B/endpoint")
		b.ReportMetric(float64(withHistory-withPicker)/n, "history-B/endpoint")
		runtime.KeepAlive(h)
		cancel()
		<-done
	}
}
