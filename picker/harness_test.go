package picker

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// testState: pool alpha (3 endpoints), pool beta (2, one draining, one
// advertising only "beta-small").
func testState() *registry.State {
	st := registry.Empty()
	st.Version = 1
	st.Pools["alpha"] = &registry.Pool{Name: "alpha", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{
		{Address: "10.0.0.1:8000"}, {Address: "10.0.0.2:8000"}, {Address: "10.0.0.3:8000"},
	}}
	st.Pools["beta"] = &registry.Pool{Name: "beta", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{
		{Address: "10.0.1.1:8000", Draining: true},
		{Address: "10.0.1.2:8000", Models: []string{"beta-small"}},
		{Address: "10.0.1.3:8000", Models: []string{"beta-large"}},
	}}
	st.Models["llama"] = &registry.Model{Name: "llama", Pool: "alpha"}
	st.Models["chat"] = &registry.Model{Name: "chat", Pool: "alpha", Targets: []registry.Target{{Name: "llama-3-8b-instruct", Weight: 1}}}
	st.Models["bulk"] = &registry.Model{Name: "bulk", Pool: "alpha", Priority: -1}
	st.Models["beta-small"] = &registry.Model{Name: "beta-small", Pool: "beta"}
	st.Models["beta-gone"] = &registry.Model{Name: "beta-gone", Pool: "beta"}
	return st
}

type harness struct {
	t      *testing.T
	srv    *Server
	pub    *registry.Publisher
	client extprocv3.ExternalProcessorClient
	conn   *grpc.ClientConn
}

// newHarness serves a picker over real gRPC on 127.0.0.1:0.
func newHarness(t *testing.T, st *registry.State, opts Options) *harness {
	t.Helper()
	// The test states name unroutable 10.x addresses: do not scrape them.
	opts.DisableMetrics = true
	return newScrapingHarness(t, st, opts)
}

// newScrapingHarness is newHarness with metrics scraping as configured in
// opts (for states naming real vllm-sim processes).
func newScrapingHarness(t *testing.T, st *registry.State, opts Options) *harness {
	t.Helper()
	pub := registry.NewPublisher(st)
	return serveHarness(t, New(pub, opts, nil), pub)
}

// serveHarness runs srv (reading pub) and serves it over real gRPC on
// 127.0.0.1:0.
func serveHarness(t *testing.T, srv *Server, pub *registry.Publisher) *harness {
	t.Helper()
	runPicker(t, srv)
	addr := serveGRPC(t, srv)
	conn, err := grpc.NewClient(addr.String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &harness{t: t, srv: srv, pub: pub, client: extprocv3.NewExternalProcessorClient(conn), conn: conn}
}

// runPicker runs srv's Run loop until the test ends (after the cleanups
// registered later, such as serveGRPC's).
func runPicker(t testing.TB, srv *Server) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-runDone })
	// Until Run applies the state, pools have no admission queue and
	// requests are forwarded whatever the load: wait for the queues.
	testutil.Eventually(t, 10*time.Second, "picker running", func() error {
		for name, pv := range srv.snap.Load().pools {
			if pv.state.queue.Load() == nil {
				return fmt.Errorf("pool %s has no admission queue yet", name)
			}
		}
		return nil
	})
}

// serveGRPC serves srv's ext_proc and health services, with its gRPC
// options, on a loopback port until the test ends, and returns the address.
func serveGRPC(t testing.TB, srv *Server) *net.TCPAddr {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(srv.GRPCServerOptions()...)
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return lis.Addr().(*net.TCPAddr)
}

// newBenchHarness serves a 100-endpoint picker over loopback gRPC and
// returns a client.
func newBenchHarness(b *testing.B) extprocv3.ExternalProcessorClient {
	srv := New(registry.NewPublisher(benchState(100)), Options{}, nil)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close(); g.Stop() })
	return extprocv3.NewExternalProcessorClient(conn)
}

type extStream struct {
	t      *testing.T
	c      extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
	first  bool
	reqM   extprocfilterv3.ProcessingMode_BodySendMode
	respM  extprocfilterv3.ProcessingMode_BodySendMode
	// early mirrors send_body_without_waiting_for_header_response.
	early bool
}

// open starts one ext_proc stream, as Envoy does for one HTTP request.
func (h *harness) open(reqMode, respMode extprocfilterv3.ProcessingMode_BodySendMode) *extStream {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	c, err := h.client.Process(ctx)
	if err != nil {
		cancel()
		h.t.Fatal(err)
	}
	h.t.Cleanup(cancel)
	return &extStream{t: h.t, c: c, cancel: cancel, first: true, reqM: reqMode, respM: respMode}
}

func (h *harness) duplex() *extStream {
	return h.open(extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
}

func (s *extStream) send(r *extprocv3.ProcessingRequest) {
	s.t.Helper()
	if s.first {
		r.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: s.reqM, ResponseBodyMode: s.respM,
			SendBodyWithoutWaitingForHeaderResponse: s.early}
		s.first = false
	}
	if err := s.c.Send(r); err != nil {
		s.t.Fatalf("send: %v", err)
	}
}

func (s *extStream) recv() *extprocv3.ProcessingResponse {
	s.t.Helper()
	r, err := s.c.Recv()
	if err != nil {
		s.t.Fatalf("recv: %v", err)
	}
	return r
}

func headerMap(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func reqHeaders(eos bool, kv ...string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(kv...), EndOfStream: eos},
	}}
}

func postHeaders(path string, extra ...string) *extprocv3.ProcessingRequest {
	return reqHeaders(false, append([]string{":method", "POST", ":path", path, "content-type", "application/json"}, extra...)...)
}

func reqBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

func reqTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{Trailers: headerMap()},
	}}
}

func respHeaders(eos bool, kv ...string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(kv...), EndOfStream: eos},
	}}
}

func respBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos},
	}}
}

func respTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{
		ResponseTrailers: &extprocv3.HttpTrailers{Trailers: headerMap()},
	}}
}

// withMetadata attaches filter_metadata[ns][key] = v to r.
func withMetadata(r *extprocv3.ProcessingRequest, ns, key string, v *structpb.Value) *extprocv3.ProcessingRequest {
	if r.MetadataContext == nil {
		r.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{}}
	}
	s := r.MetadataContext.FilterMetadata[ns]
	if s == nil {
		s = &structpb.Struct{Fields: map[string]*structpb.Value{}}
		r.MetadataContext.FilterMetadata[ns] = s
	}
	s.Fields[key] = v
	return r
}

func listValue(items ...string) *structpb.Value {
	l := &structpb.ListValue{}
	for _, it := range items {
		l.Values = append(l.Values, structpb.NewStringValue(it))
	}
	return structpb.NewListValue(l)
}

// decision is what a headers (or buffered body) response told Envoy.
type decision struct {
	dest, pool, contentLength, metaDest string
	set                                 map[string]string
	remove                              []string
	clearRouteCache                     bool
}

func decisionOf(t *testing.T, r *extprocv3.ProcessingResponse) decision {
	t.Helper()
	var cr *extprocv3.CommonResponse
	switch {
	case r.GetRequestHeaders() != nil:
		cr = r.GetRequestHeaders().GetResponse()
	case r.GetRequestBody() != nil:
		cr = r.GetRequestBody().GetResponse()
	default:
		t.Fatalf("expected a request headers/body response carrying the decision, got %v", r)
	}
	d := decision{set: map[string]string{}, clearRouteCache: cr.GetClearRouteCache()}
	for _, h := range cr.GetHeaderMutation().GetSetHeaders() {
		if h.GetAppendAction() != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
			t.Errorf("header %s: append action %v, want OVERWRITE_IF_EXISTS_OR_ADD", h.GetHeader().GetKey(), h.GetAppendAction())
		}
		d.set[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	d.remove = cr.GetHeaderMutation().GetRemoveHeaders()
	d.dest, d.pool, d.contentLength = d.set[HeaderDestination], d.set[HeaderPool], d.set["content-length"]
	d.metaDest = r.GetDynamicMetadata().GetFields()[MetadataNamespace].GetStructValue().GetFields()[MetadataDestination].GetStringValue()
	if d.dest == "" || d.dest != d.metaDest {
		t.Fatalf("destination header %q and envoy.lb metadata %q must be equal and non-empty", d.dest, d.metaDest)
	}
	if !d.clearRouteCache {
		t.Errorf("clear_route_cache not set")
	}
	return d
}

// immediateOf asserts r is a local reply with status code and returns its
// JSON body.
func immediateOf(t *testing.T, r *extprocv3.ProcessingResponse, code int) string {
	t.Helper()
	ir := r.GetImmediateResponse()
	if ir == nil {
		t.Fatalf("want immediate response %d, got %v", code, r)
	}
	if int(ir.GetStatus().GetCode()) != code {
		t.Fatalf("immediate status %d, want %d (body %s)", ir.GetStatus().GetCode(), code, ir.GetBody())
	}
	ct := ""
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		if h.GetHeader().GetKey() == "content-type" {
			ct = string(h.GetHeader().GetRawValue())
		}
	}
	if ct != "application/json" {
		t.Errorf("immediate content-type %q", ct)
	}
	if want := fmt.Sprintf(`"code":%d`, code); !strings.Contains(string(ir.GetBody()), want) {
		t.Errorf("immediate body %s lacks %s", ir.GetBody(), want)
	}
	return string(ir.GetBody())
}

// streamedBodies receives duplex body responses until end_of_stream (or
// until wantEOS is false and n messages were read), returning the bytes.
func (s *extStream) readStreamedRequestBody() (body []byte, chunks int) {
	s.t.Helper()
	for {
		r := s.recv()
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			s.t.Fatalf("want streamed request body response, got %v", r)
		}
		body = append(body, sr.GetBody()...)
		chunks++
		if len(sr.GetBody()) > 64<<10 {
			s.t.Errorf("streamed chunk of %d bytes exceeds 64 KiB", len(sr.GetBody()))
		}
		if sr.GetEndOfStream() {
			return body, chunks
		}
	}
}

func (h *harness) inFlight() int64 {
	n, _ := h.srv.InFlight()
	return n
}

func (h *harness) waitInFlight(want int64) {
	h.t.Helper()
	testutil.Eventually(h.t, 5*time.Second, fmt.Sprintf("in-flight == %d", want), func() error {
		if n := h.inFlight(); n != want {
			return fmt.Errorf("in-flight %d", n)
		}
		return nil
	})
}
