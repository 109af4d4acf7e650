package picker

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/registry"
)

// BenchmarkGRPCRoundTripMTLS measures what mutual TLS adds to one ext_proc
// exchange over loopback gRPC (request headers, the body in 64 KiB
// chunks, response headers), on one long-lived connection as Envoy keeps
// to the picker: encryption of every message, no handshake per request.
// The "plaintext" and "mtls" results differ only in the transport:
//
//	go test -run '^$' -bench GRPCRoundTripMTLS -benchmem -count 5 ./picker/
func BenchmarkGRPCRoundTripMTLS(b *testing.B) {
	for _, size := range []int{4 << 10, 200 << 10} {
		for _, secure := range []bool{false, true} {
			name := fmt.Sprintf("%dKiB/plaintext", size>>10)
			if secure {
				name = fmt.Sprintf("%dKiB/mtls", size>>10)
			}
			b.Run(name, func(b *testing.B) {
				client := tlsBenchHarness(b, secure)
				body := []byte(fmt.Sprintf(`{"model":"llama","messages":[{"role":"user","content":%q}]}`, strings.Repeat("a", size)))
				first := postHeaders("/v1/chat/completions")
				first.ProtocolConfig = &extprocv3.ProtocolConfiguration{
					RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
					ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
				}
				msgs := []*extprocv3.ProcessingRequest{first}
				for off := 0; off < len(body); off += 64 << 10 {
					end := min(off+64<<10, len(body))
					msgs = append(msgs, reqBody(body[off:end], end == len(body)))
				}
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					c, err := client.Process(b.Context())
					if err != nil {
						b.Fatal(err)
					}
					for _, m := range msgs {
						if err := c.Send(m); err != nil {
							b.Fatal(err)
						}
					}
					// The headers response, then one body response per chunk.
					for range msgs {
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
			})
		}
	}
}

// tlsBenchHarness serves a 100-endpoint picker over loopback gRPC, with
// switchyard's server-side mutual TLS when secure, and returns a client
// (presenting a client certificate when secure).
func tlsBenchHarness(b *testing.B, secure bool) extprocv3.ExternalProcessorClient {
	b.Helper()
	srv := New(registry.NewPublisher(benchState(100)), Options{}, nil)
	serverOpts := srv.GRPCServerOptions()
	clientCreds := insecure.NewCredentials()
	if secure {
		ca, err := certgen.NewCA("bench CA", certgen.Validity{})
		if err != nil {
			b.Fatal(err)
		}
		sl, err := ca.Issue(certgen.LeafOptions{CommonName: "switchyard", SANs: []string{"switchyard"}, Server: true})
		if err != nil {
			b.Fatal(err)
		}
		cl, err := ca.Issue(certgen.LeafOptions{CommonName: "envoy", SANs: []string{"envoy"}, Client: true})
		if err != nil {
			b.Fatal(err)
		}
		m, err := mtls.Parse(sl.CertPEM, sl.KeyPEM, ca.CertPEM, "bench")
		if err != nil {
			b.Fatal(err)
		}
		ts := mtls.NewServer(mtls.Options{AllowedSANs: []string{"envoy"}, Logger: slog.New(slog.DiscardHandler)})
		ts.Set(m)
		serverOpts = append(serverOpts, grpc.Creds(ts.GRPCCredentials("extproc")))
		kp, err := tls.X509KeyPair(cl.CertPEM, cl.KeyPEM)
		if err != nil {
			b.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AddCert(ca.Cert)
		clientCreds = credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "switchyard", Certificates: []tls.Certificate{kp}})
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer(serverOpts...)
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(clientCreds),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20), grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close(); g.Stop() })
	return extprocv3.NewExternalProcessorClient(conn)
}
