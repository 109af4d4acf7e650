package picker

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	pdwire "github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/registry"
)

// BenchmarkPDStage measures what the P/D stage adds to a request: one
// whole ext_proc exchange (as BenchmarkHandleRequest: headers, a 16 KiB
// prompt of ~4,000 tokens, a streamed answer) for a pool of n decode
// servers, without the stage ("no-policy": the pool has no prefill
// servers and no disaggregation block), and with n prefill servers beside
// them and the block: every request split ("split", and "split-signed"
// with a signing key), or kept whole by its short prompt
// ("whole-short"). Each request's prompt starts differently, so none is
// cached anywhere. Run:
//
//	go test -run '^$' -bench PDStage -benchmem ./picker/
func BenchmarkPDStage(b *testing.B) {
	for _, n := range []int{8, 50} {
		for _, tc := range []struct {
			name   string
			policy bool
			prompt int // characters (about 4 a token)
			sign   bool
		}{
			{"no-policy", false, 16 << 10, false},
			{"split", true, 16 << 10, false},
			{"split-signed", true, 16 << 10, true},
			{"whole-short", true, 1 << 10, false},
		} {
			b.Run(fmt.Sprintf("%d+%d/%s", n, n, tc.name), func(b *testing.B) {
				st := registry.Empty()
				st.Version = 1
				p := &registry.Pool{Name: "big", Engine: registry.EngineVLLM}
				for i := range n {
					p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: fmt.Sprintf("10.1.1.%d:8000", i+1), Role: registry.RoleDecode})
				}
				if tc.policy {
					p.Disaggregation = &registry.Disaggregation{MinPromptTokens: 1024}
					for i := range n {
						p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: fmt.Sprintf("10.1.2.%d:8000", i+1), Role: registry.RolePrefill})
					}
				} else {
					for i := range p.Endpoints {
						p.Endpoints[i].Role = registry.RoleBoth
					}
				}
				st.Pools["big"] = p
				st.Models["llama"] = &registry.Model{Name: "llama", Pool: "big"}
				opts := Options{}
				if tc.sign {
					s, err := pdwire.NewSigner([]byte("a-signing-key-of-enough-bytes"))
					if err != nil {
						b.Fatal(err)
					}
					opts.PDSigner = s
				}
				srv := New(registry.NewPublisher(st), opts, nil)
				body := fmt.Appendf(nil, `{"model":"llama","prompt":"00000000 %s","stream":true}`, strings.Repeat("a", tc.prompt))
				start := strings.Index(string(body), "00000000")
				hdr := postHeaders("/v1/completions", "content-length", strconv.Itoa(len(body)), "x-request-id", "abc")
				hdr.ProtocolConfig = &extprocv3.ProtocolConfiguration{
					RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
					ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
				}
				msgs := []*extprocv3.ProcessingRequest{hdr, reqBody(body, true),
					respHeaders(false, ":status", "200", "content-type", "text/event-stream", pdwire.ResultHeader, pdwire.ResultSplit),
					respBody([]byte("data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]\n\n"), true)}
				send := func(*extprocv3.ProcessingResponse) error { return nil }
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					// A new prompt each time: its first block differs.
					for k, v := 0, uint32(i); k < 8; k, v = k+1, v>>4 {
						body[start+7-k] = "0123456789abcdef"[v&15]
					}
					st := srv.newStream(context.Background())
					for _, m := range msgs {
						if _, err := st.handle(m, send); err != nil {
							b.Fatal(err)
						}
					}
					st.release()
					srv.freeStream(st)
				}
				b.StopTimer()
				if n, _ := srv.InFlight(); n != 0 {
					b.Fatalf("in-flight %d", n)
				}
				c := &srv.snap.Load().pools["big"].state.pdDecisions
				want := map[string]int{"split": 0, "split-signed": 0, "whole-short": 1}[tc.name]
				if tc.policy && c[want].Load() == 0 {
					b.Fatalf("no %s decision counted", tc.name)
				}
			})
		}
	}
}
