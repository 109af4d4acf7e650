package picker

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

func benchState(endpoints int) *registry.State {
	st := registry.Empty()
	st.Version = 1
	p := &registry.Pool{Name: "big", Engine: registry.EngineVLLM}
	for i := 0; i < endpoints; i++ {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: fmt.Sprintf("10.1.%d.%d:8000", i/250, i%250+1)})
	}
	st.Pools["big"] = p
	st.Models["llama"] = &registry.Model{Name: "llama", Pool: "big"}
	st.Models["alias"] = &registry.Model{Name: "alias", Pool: "big", Targets: []registry.Target{{Name: "llama", Weight: 1}}}
	return st
}

// BenchmarkHandleRequest measures one whole ext_proc exchange as Envoy drives
// it in FULL_DUPLEX_STREAMED mode (request headers, body in 64 KiB chunks,
// response headers, response body), including the scheduling decision over
// 100 endpoints, without the network. Run:
//
//	go test -run '^$' -bench BenchmarkHandleRequest -benchmem ./picker/
func BenchmarkHandleRequest(b *testing.B) {
	for _, tc := range []struct {
		name   string
		model  string
		prompt int
	}{
		{"4KiB", "llama", 4 << 10},
		{"200KiB", "llama", 200 << 10},
		{"4KiB-rewrite", "alias", 4 << 10},
	} {
		b.Run(tc.name, func(b *testing.B) {
			srv := New(registry.NewPublisher(benchState(100)), Options{}, nil)
			body := []byte(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"stream":false}`, tc.model, strings.Repeat("a", tc.prompt)))
			hdr := postHeaders("/v1/chat/completions", "content-length", fmt.Sprint(len(body)), "x-request-id", "abc")
			hdr.ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
				ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			}
			msgs := []*extprocv3.ProcessingRequest{hdr}
			for off := 0; off < len(body); off += 64 << 10 {
				end := min(off+64<<10, len(body))
				msgs = append(msgs, reqBody(body[off:end], end == len(body)))
			}
			msgs = append(msgs,
				respHeaders(false, ":status", "200", "content-type", "application/json"),
				respBody([]byte(`{"id":"x","model":"llama","choices":[]}`), true))
			sent := 0
			send := func(*extprocv3.ProcessingResponse) error { sent++; return nil }
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				st := srv.newStream()
				for _, m := range msgs {
					if _, err := st.handle(m, send); err != nil {
						b.Fatal(err)
					}
				}
				st.release()
			}
			b.StopTimer()
			if n, _ := srv.InFlight(); n != 0 || sent == 0 {
				b.Fatalf("in-flight %d sent %d", n, sent)
			}
		})
	}
}

// BenchmarkGRPCRoundTrip is the same exchange over a real loopback gRPC
// stream (client and server in this process), for context: it is dominated
// by gRPC framing and proto (un)marshalling, not by the picker.
func BenchmarkGRPCRoundTrip4KiB(b *testing.B) {
	h := newBenchHarness(b)
	body := []byte(fmt.Sprintf(`{"model":"llama","messages":[{"role":"user","content":%q}]}`, strings.Repeat("a", 4<<10)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := h.Process(b.Context())
		if err != nil {
			b.Fatal(err)
		}
		first := postHeaders("/v1/chat/completions")
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		}
		for _, m := range []*extprocv3.ProcessingRequest{first, reqBody(body, true)} {
			if err := c.Send(m); err != nil {
				b.Fatal(err)
			}
		}
		for k := 0; k < 2; k++ { // headers response + one body chunk
			if _, err := c.Recv(); err != nil {
				b.Fatal(err)
			}
		}
		if err := c.Send(respHeaders(true, ":status", "204")); err != nil {
			b.Fatal(err)
		}
		if _, err := c.Recv(); err != nil {
			b.Fatal(err)
		}
		_ = c.CloseSend()
	}
}

// freshSource is a metrics source that always reports a fresh snapshot.
type freshSource struct{ s *metrics.Snapshot }

func (f freshSource) Load() *metrics.Snapshot { return f.s }

// BenchmarkScheduleDecision measures one whole scheduling decision with the
// default profile over 100 endpoints with fresh scraped metrics and an
// 8k-token chat prompt (32 KiB): model lookup, prompt hashing (512 blocks),
// prefix-index match, filters, every scorer, max-score pick with two
// fallbacks, and recording the pick. 32 system prompts are spread over the
// pool beforehand. It reports p99 latency per decision. Run:
//
//	go test -run '^$' -bench BenchmarkScheduleDecision -benchmem ./picker/
func BenchmarkScheduleDecision(b *testing.B) {
	srv := New(registry.NewPublisher(benchState(100)), Options{DisableMetrics: true}, nil)
	far := time.Now().Add(time.Hour)
	i := 0
	snap := buildSnapshot(benchState(100), &srv.loads, buildDeps{handle: func(metrics.Key) sched.MetricsSource {
		i++
		return freshSource{&metrics.Snapshot{Values: metrics.Values{Waiting: i % 4, Running: 10 + i%7, KVUsage: float64(i%10) / 10,
			BlockSize: 16, NumBlocks: 26000}, LastSuccess: far, MaxAge: 2 * time.Hour}}
	}})
	srv.snap.Store(snap)
	// Distinct 8k-token prompts: 32 system prompts of ~7.9k tokens plus a
	// short question.
	var bodies [][]byte
	for g := range 32 {
		system := strings.Repeat(fmt.Sprintf("group %02d shares this system prompt; ", g), 32<<10/36)
		for u := range 4 {
			bodies = append(bodies, []byte(fmt.Sprintf(`{"model":"llama","messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, system, u)))
		}
	}
	decide := func(body []byte) {
		st := srv.newStream()
		st.path, st.method, st.body = []byte("/v1/chat/completions"), []byte("POST"), body
		if code, msg, _, _ := st.pick(); code != 0 {
			b.Fatalf("%d %s", code, msg)
		}
		st.release()
	}
	for _, body := range bodies { // warm the prefix index
		decide(body)
	}
	durs := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		t0 := time.Now()
		decide(bodies[n%len(bodies)])
		durs = append(durs, time.Since(t0))
	}
	b.StopTimer()
	slices.Sort(durs)
	b.ReportMetric(float64(durs[len(durs)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(durs[len(durs)*99/100].Nanoseconds()), "p99-ns")
}
