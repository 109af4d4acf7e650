package xds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.DiscardHandler)
}

// startXDS serves an xDS Server for view on a free loopback port and runs
// it until the test ends. It returns the server and its address.
func startXDS(t testing.TB, view registry.View, opts Options) (*Server, string) {
	t.Helper()
	srv, addr, _ := startXDSAt(t, "127.0.0.1:0", view, opts)
	return srv, addr
}

// startXDSAt is startXDS on a given address; stop ends it early (it is
// also called at cleanup, and is idempotent).
func startXDSAt(t testing.TB, addr string, view registry.View, opts Options) (srv *Server, bound string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv = NewServer(view, opts, testLogger(t))
	g := grpc.NewServer(GRPCServerOptions()...)
	srv.Register(g)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Run(ctx); close(done) }()
	go func() { _ = g.Serve(lis) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			g.Stop()
		})
	}
	t.Cleanup(stop)
	return srv, lis.Addr().String(), stop
}

// startEnvoy runs a real Envoy bootstrapped at xdsAddr (with the shipped
// bootstrap's ADS protocol) and returns its admin base URL.
func startEnvoy(t *testing.T, nodeID, xdsAddr string) (string, *testutil.Process) {
	t.Helper()
	return startEnvoyAPI(t, nodeID, xdsAddr, "")
}

// apiTypes are the ADS protocol variants Envoy tests run under.
var apiTypes = []string{envoy.APITypeSotW, envoy.APITypeDelta}

// startEnvoyAPI is startEnvoy on ADS protocol apiType (envoy.APITypeSotW
// or envoy.APITypeDelta; "" for the bootstrap's default).
func startEnvoyAPI(t *testing.T, nodeID, xdsAddr, apiType string) (string, *testutil.Process) {
	t.Helper()
	bin := testutil.EnvoyPath(t)
	host, port, _ := net.SplitHostPort(xdsAddr)
	var xdsPort int
	fmt.Sscan(port, &xdsPort)
	adminPort := testutil.FreePort(t)
	cfg, err := envoy.Bootstrap(envoy.Params{NodeID: nodeID, NodeCluster: "test", XDSHost: host, XDSPort: xdsPort, AdminPort: adminPort, ADSAPIType: apiType})
	if err != nil {
		t.Fatal(err)
	}
	path := testutil.WriteFile(t, t.TempDir(), "bootstrap.yaml", cfg)
	proc := testutil.Start(t, "envoy", bin, "-c", path, "--use-dynamic-base-id", "-l", envoyLogLevel(), "--drain-time-s", "0", "--concurrency", "1")
	admin := fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	testutil.WaitHTTP(t, admin+"/ready", 10*time.Second)
	return admin, proc
}

func httpGet(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// backend is a plain HTTP server that answers with its own address, so a
// test can see which endpoint served a request.
type backend struct {
	Addr string
	// release lets a /stream request send its second chunk.
	release chan struct{}
	// fails counts requests to /fail, which always answers 503.
	fails atomic.Int32
}

func startBackend(t *testing.T) *backend { return startBackendAt(t, "127.0.0.1:0") }

func startBackendAt(t *testing.T, addr string) *backend {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	b := &backend{Addr: lis.Addr().String(), release: make(chan struct{}, 1)}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/fail" {
			b.fails.Add(1)
			http.Error(w, `{"error":"overloaded"}`, http.StatusServiceUnavailable)
			return
		}
		if r.URL.Path == "/stream" {
			// An SSE-style stream: the second event is only sent once the
			// test has received the first, proving nothing buffers it.
			w.Header().Set("content-type", "text/event-stream")
			fmt.Fprint(w, "data: first\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-b.release:
			case <-time.After(5 * time.Second):
			}
			fmt.Fprint(w, "data: second\n\ndata: [DONE]\n\n")
			return
		}
		w.Header().Set("x-served-by", b.Addr)
		w.Header().Set("content-type", "application/json")
		fmt.Fprintf(w, `{"served_by":%q,"request_bytes":%d,"client_dest":%q,"content_length":%d,"transfer_encoding":%q,"prefiller":%q}`,
			b.Addr, len(body), r.Header.Get("x-gateway-destination-endpoint"), r.ContentLength, r.TransferEncoding, r.Header.Get(pd.PrefillerHeader))
	})}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() { _ = srv.Close() })
	return b
}

// responder is a tiny ext_proc server standing in for the picker: it
// speaks FULL_DUPLEX_STREAMED like the picker must, and routes each request
// to the pool and endpoint named in the test-only request headers
// x-test-pool and x-test-pick. Without x-test-pool it sets nothing.
type responder struct {
	extprocv3.UnimplementedExternalProcessorServer
	Addr string
	// Stop kills the responder's gRPC server (and its health service).
	Stop func()

	mu     sync.Mutex
	served []string // envoy.lb served-host metadata seen on response headers
}

func startResponder(t *testing.T) *responder { return startResponderAt(t, "127.0.0.1:0") }

// startResponderAt starts a responder on addr (to restart one in place).
func startResponderAt(t *testing.T, addr string) *responder {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	r := &responder{Addr: lis.Addr().String()}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, r)
	hs := health.NewServer()
	hs.SetServingStatus(ir.PickerHealthService, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, hs)
	go func() { _ = g.Serve(lis) }()
	r.Stop = g.Stop
	t.Cleanup(g.Stop)
	return r
}

func (r *responder) Served() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.served...)
}

func headerValue(h *corev3.HeaderMap, name string) string {
	for _, kv := range h.GetHeaders() {
		if strings.EqualFold(kv.GetKey(), name) {
			if len(kv.GetRawValue()) > 0 {
				return string(kv.GetRawValue())
			}
			return kv.GetValue()
		}
	}
	return ""
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

func (r *responder) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	var pool, pick string
	send := func(resp *extprocv3.ProcessingResponse) error { return stream.Send(resp) }
	// headersResponse releases the request headers with the routing
	// decision; in full-duplex mode it goes out once the body is complete.
	headersResponse := func() *extprocv3.ProcessingResponse {
		common := &extprocv3.CommonResponse{ClearRouteCache: true}
		resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: common},
		}}
		if pool == "" {
			return resp
		}
		common.HeaderMutation = &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{
				setHeader(ir.PoolHeader, pool),
				setHeader(ir.DestinationKey, pick),
			},
		}
		md, _ := structpb.NewStruct(map[string]any{ir.LBNamespace: map[string]any{ir.DestinationKey: pick}})
		resp.DynamicMetadata = md
		return resp
	}
	var body []byte
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		switch v := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			pool = headerValue(v.RequestHeaders.GetHeaders(), "x-test-pool")
			pick = headerValue(v.RequestHeaders.GetHeaders(), "x-test-pick")
			if v.RequestHeaders.GetEndOfStream() {
				if err := send(headersResponse()); err != nil {
					return err
				}
			}
		case *extprocv3.ProcessingRequest_RequestBody:
			body = append(body, v.RequestBody.GetBody()...)
			if !v.RequestBody.GetEndOfStream() {
				continue
			}
			if err := send(headersResponse()); err != nil {
				return err
			}
			if err := send(streamedBody(true, body, true)); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			served := req.GetMetadataContext().GetFilterMetadata()[ir.LBNamespace].GetFields()[ir.ServedKey].GetStringValue()
			r.mu.Lock()
			r.served = append(r.served, served)
			r.mu.Unlock()
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			if err := send(streamedBody(false, v.ResponseBody.GetBody(), v.ResponseBody.GetEndOfStream())); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}); err != nil {
				return err
			}
		}
	}
}

func streamedBody(request bool, body []byte, end bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: end}},
	}}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// envoyLogLevel is the log level of test Envoys: $SY_ENVOY_LOG (e.g.
// "debug" to see host selection and health checks), default "warning".
func envoyLogLevel() string {
	if l := os.Getenv("SY_ENVOY_LOG"); l != "" {
		return l
	}
	return "warning"
}
