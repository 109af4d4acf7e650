package load

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func BenchmarkGenerateSharedPrefix(b *testing.B) {
	cfg := genConfig(APICompletions, Workload{Kind: WorkloadSharedPrefix, Groups: 16, UsersPerGroup: 16, SystemLen: 512, QuestionLen: 64, Output: Fixed(64)})
	g := newGenerator(cfg)
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := g.next(); !ok {
			b.Fatal("no request")
		}
	}
}

func BenchmarkGenerateRandom512(b *testing.B) {
	g := newGenerator(genConfig(APIChat, Workload{Kind: WorkloadRandom, Input: Fixed(512), Output: Fixed(64)}))
	b.ReportAllocs()
	for b.Loop() {
		g.next()
	}
}

func BenchmarkHistogramRecord(b *testing.B) {
	var h histogram
	d := time.Duration(1)
	for b.Loop() {
		h.record(d)
		d = d*7 + 12345&(1<<34-1)
	}
}

// BenchmarkReadStream parses one 64-token completions stream with usage.
func BenchmarkReadStream(b *testing.B) {
	var sb strings.Builder
	for i := range 64 {
		fmt.Fprintf(&sb, "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" %s\",\"finish_reason\":null}]}\n\n", answerWord(i))
	}
	sb.WriteString("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":576,\"completion_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":512}}}\n\ndata: [DONE]\n\n")
	stream := sb.String()
	s := &sender{}
	ctx := context.Background()
	b.SetBytes(int64(len(stream)))
	b.ReportAllocs()
	for b.Loop() {
		res := &result{}
		s.readStream(ctx, ctx, strings.NewReader(stream), res, nil)
		if res.errKind != "" || res.outTokens != 64 {
			b.Fatalf("%+v", res)
		}
	}
}

// BenchmarkClientCeiling measures how many streamed requests per second
// Run itself can drive (closed loop, 16 in flight) against an in-process
// server that answers instantly: the ceiling above which loadgen, not the
// system under test, is the bottleneck.
func BenchmarkClientCeiling(b *testing.B) {
	body := strings.Repeat("data: {\"choices\":[{\"text\":\"abcd \"}]}\n\n", 16) +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":128,\"completion_tokens\":16}}\n\ndata: [DONE]\n\n"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, body)
	}))
	defer srv.Close()
	cfg := Config{URL: srv.URL, Model: "m", Arrival: ArrivalConcurrency,
		Workload: Workload{Kind: WorkloadRandom, Input: Fixed(128), Output: Fixed(16)},
		Stages:   []Stage{{Concurrency: 16, Duration: time.Second}}}
	var done int64
	var secs float64
	for b.Loop() {
		rep, err := Run(context.Background(), cfg)
		if err != nil {
			b.Fatal(err)
		}
		done += rep.Total.Completed
		secs += rep.ElapsedS
	}
	b.ReportMetric(float64(done)/secs, "req/s")
}
