package picker

import (
	"fmt"
	"strings"
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

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
