package picker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/switchyard/switchyard/registry"
)

// BenchmarkExtProcExchange measures whole ext_proc exchanges per second
// through the picker's Process over a loopback gRPC connection, the way
// Envoy drives it in FULL_DUPLEX_STREAMED mode: request headers, the body,
// an empty end-of-stream body message, then response headers and a small
// JSON response body; the client reads every answer, the body streamed
// back included, and waits for the stream to end. The picker has 100
// endpoints and the default profile; metrics scraping is off.
//
// Chunking: "envoy" is what Envoy 1.40 sent for a 200 KiB POST over
// loopback (one message with the whole body, then an empty one carrying
// end_of_stream: Envoy's HTTP/1 codec hands the filter all bytes read so
// far); "64KiB" splits the body as a slower client would arrive. "x8" runs
// eight exchanges at once on the one connection, as Envoy multiplexes
// concurrent requests. Besides exchanges per second it reports the CPU
// time per exchange of this process (cpu-ns/op), which includes the
// client's. "x8/client-process" runs the client in a child process (this
// test binary, TestExchangeClientProcess), so the picker's own CPU per
// exchange (server-cpu-ns/op) is measured apart from the client's
// (client-cpu-ns/op); exchanges/s is then the child's, both processes
// sharing the machine. Run:
//
//	go test -run '^$' -bench ExtProcExchange -benchmem -count 5 ./picker/
func BenchmarkExtProcExchange(b *testing.B) {
	body := exchangeBody()
	for _, tc := range []struct {
		name     string
		chunk    int // 0: Envoy's loopback pattern
		parallel int
	}{
		{"200KiB/envoy", 0, 1},
		{"200KiB/64KiB", 64 << 10, 1},
		{"200KiB/envoy/x8", 0, 8},
	} {
		b.Run(tc.name, func(b *testing.B) {
			client, _ := exchangeHarness(b)
			msgs := exchangeMessages(body, tc.chunk)
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			b.ResetTimer()
			t0, cpu0 := time.Now(), cpuTime(b)
			if tc.parallel <= 1 {
				for i := 0; i < b.N; i++ {
					if err := exchange(b.Context(), client, msgs, len(body)); err != nil {
						b.Fatal(err)
					}
				}
			} else {
				b.SetParallelism(max(tc.parallel/runtime.GOMAXPROCS(0), 1)) // goroutines = parallelism * GOMAXPROCS
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if err := exchange(b.Context(), client, msgs, len(body)); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			b.ReportMetric(float64(b.N)/time.Since(t0).Seconds(), "exchanges/s")
			b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
		})
	}
	b.Run("200KiB/envoy/x8/client-process", func(b *testing.B) {
		exe, err := os.Executable()
		if err != nil {
			b.Fatal(err)
		}
		_, addr := exchangeHarness(b)
		b.SetBytes(int64(len(body)))
		b.ResetTimer()
		cpu0 := cpuTime(b)
		cmd := exec.CommandContext(b.Context(), exe, "-test.run=^TestExchangeClientProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), exchangeClientEnv+"="+addr, exchangeCountEnv+"="+strconv.Itoa(b.N))
		out, err := cmd.CombinedOutput()
		server := cpuTime(b) - cpu0
		if err != nil {
			b.Fatalf("client process: %v\n%s", err, out)
		}
		var elapsed, client int64
		if i := bytes.Index(out, []byte("exchanges done:")); i < 0 {
			b.Fatalf("client process printed no result:\n%s", out)
		} else if _, err := fmt.Sscanf(string(out[i:]), "exchanges done: %d ns, %d cpu-ns", &elapsed, &client); err != nil {
			b.Fatalf("client process result: %v\n%s", err, out)
		}
		b.ReportMetric(float64(b.N)/time.Duration(elapsed).Seconds(), "exchanges/s")
		b.ReportMetric(float64(server.Nanoseconds())/float64(b.N), "server-cpu-ns/op")
		b.ReportMetric(float64(client)/float64(b.N), "client-cpu-ns/op")
	})
}

// The client process's instructions.
const (
	exchangeClientEnv = "SWITCHYARD_EXCHANGE_CLIENT" // picker address
	exchangeCountEnv  = "SWITCHYARD_EXCHANGE_N"      // exchanges to run
)

// TestExchangeClientProcess is the client half of
// BenchmarkExtProcExchange's client-process case; it runs only as that
// benchmark's child process. It runs the exchanges on 8 streams of one
// connection and prints its wall and CPU time.
func TestExchangeClientProcess(t *testing.T) {
	addr := os.Getenv(exchangeClientEnv)
	if addr == "" {
		t.Skip("the client process of BenchmarkExtProcExchange")
	}
	n, err := strconv.Atoi(os.Getenv(exchangeCountEnv))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := exchangeDial(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	body := exchangeBody()
	msgs := exchangeMessages(body, 0)
	if err := exchange(t.Context(), client, msgs, len(body)); err != nil { // connect and warm up
		t.Fatal(err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	t0, cpu0 := time.Now(), cpuTime(t)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if err := exchange(t.Context(), client, msgs, len(body)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed, cpu := time.Since(t0), cpuTime(t)-cpu0
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	fmt.Printf("exchanges done: %d ns, %d cpu-ns\n", elapsed.Nanoseconds(), cpu.Nanoseconds())
}

// exchangeBody is a 200 KiB chat completion request.
func exchangeBody() []byte {
	const size = 200 << 10
	return []byte(fmt.Sprintf(`{"model":"llama","messages":[{"role":"system","content":%q},{"role":"user","content":"question"}],"stream":false}`,
		strings.Repeat("You are a helpful assistant. ", size/29)))
}

// cpuTime is the CPU time (user and system) this process has used so
// far: on a shared machine, CPU per exchange varies far less between runs
// than exchanges per second do.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// exchangeMessages is one request's messages as Envoy sends them.
func exchangeMessages(body []byte, chunk int) []*extprocv3.ProcessingRequest {
	first := postHeaders("/v1/chat/completions", "content-length", fmt.Sprint(len(body)), "x-request-id", "bench")
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	msgs := []*extprocv3.ProcessingRequest{first}
	if chunk <= 0 {
		chunk = len(body)
	}
	for off := 0; off < len(body); off += chunk {
		msgs = append(msgs, reqBody(body[off:min(off+chunk, len(body))], false))
	}
	return append(msgs, reqBody(nil, true))
}

// exchange runs one ext_proc stream to its end and checks the body came
// back whole.
func exchange(ctx context.Context, client extprocv3.ExternalProcessorClient, msgs []*extprocv3.ProcessingRequest, bodyLen int) error {
	c, err := client.Process(ctx)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if err := c.Send(m); err != nil {
			return err
		}
	}
	r, err := c.Recv()
	if err != nil {
		return err
	}
	if r.GetRequestHeaders() == nil {
		return fmt.Errorf("want the decision, got %v", r)
	}
	got := 0
	for {
		r, err := c.Recv()
		if err != nil {
			return err
		}
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return fmt.Errorf("want a streamed body chunk, got %v", r)
		}
		got += len(sr.GetBody())
		if sr.GetEndOfStream() {
			break
		}
	}
	if got != bodyLen {
		return fmt.Errorf("body came back with %d bytes, want %d", got, bodyLen)
	}
	if err := c.Send(respHeaders(false, ":status", "200", "content-type", "application/json")); err != nil {
		return err
	}
	if _, err := c.Recv(); err != nil {
		return err
	}
	if err := c.Send(respBody([]byte(`{"id":"x","model":"llama","choices":[]}`), true)); err != nil {
		return err
	}
	if _, err := c.Recv(); err != nil {
		return err
	}
	if err := c.CloseSend(); err != nil {
		return err
	}
	if _, err := c.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("stream end: %v", err)
	}
	return nil
}

// exchangeHarness serves a 100-endpoint picker (no scraping) over
// loopback gRPC with the server options serve uses, and returns a client
// on one connection and the picker's address.
func exchangeHarness(b *testing.B) (extprocv3.ExternalProcessorClient, string) {
	b.Helper()
	srv := New(registry.NewPublisher(benchState(100)), Options{DisableMetrics: true}, nil)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer(srv.GRPCServerOptions()...)
	srv.Register(g)
	served := make(chan struct{})
	go func() { defer close(served); _ = g.Serve(lis) }()
	conn, err := exchangeDial(lis.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		conn.Close()
		g.Stop()
		<-served
	})
	return extprocv3.NewExternalProcessorClient(conn), lis.Addr().String()
}

// exchangeDial connects the benchmark's client. Its flow-control windows
// are Envoy's HTTP/2 defaults (256 MiB), so the body streamed back never
// waits on window updates. The client stands in for Envoy, whose costs
// are not the picker's: it uses the picker's codec, so it does not spend
// the CPU gRPC-Go's default codec does zeroing a 1 MiB buffer for every
// message over 32 KiB.
func exchangeDial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(256<<20), grpc.WithInitialConnWindowSize(256<<20),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20), grpc.MaxCallRecvMsgSize(64<<20), grpc.ForceCodecV2(newCodec())))
}
