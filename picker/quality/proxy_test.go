package quality

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/switchyard/switchyard/picker"
)

// dataPlane is the harness's stand-in for Envoy: an HTTP server that asks
// the picker (over ext_proc) where each request goes and forwards it there.
// Of the response it shows the picker the headers, the first body bytes
// (before the client gets them) and the end.
type dataPlane struct {
	// ext are the pickers (replicas), used in turn per request like
	// Envoy's round-robin picker cluster.
	ext      []extprocv3.ExternalProcessorClient
	next     atomic.Uint64
	upstream *http.Client
}

// startDataPlane serves the data plane on 127.0.0.1:0 and returns its base
// URL; it talks to the pickers' gRPC servers at pickerAddrs, in turn.
func startDataPlane(t testing.TB, pickerAddrs ...string) string {
	t.Helper()
	dp := &dataPlane{
		upstream: &http.Client{Transport: &http.Transport{
			Proxy: nil, MaxIdleConns: 4096, MaxIdleConnsPerHost: 1024, IdleConnTimeout: 30 * time.Second,
			DisableCompression: true,
		}},
	}
	var conns []*grpc.ClientConn
	for _, addr := range pickerAddrs {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, conn)
		dp.ext = append(dp.ext, extprocv3.NewExternalProcessorClient(conn))
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: dp, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = hs.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(ctx)
		for _, c := range conns {
			c.Close()
		}
	})
	return "http://" + lis.Addr().String()
}

func hv(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }

func (dp *dataPlane) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	ext := dp.ext[(dp.next.Add(1)-1)%uint64(len(dp.ext))]
	ps, err := ext.Process(ctx)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return
	}
	hdrs := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		hv(":method", r.Method), hv(":path", r.URL.RequestURI()), hv(":authority", r.Host),
		hv("content-length", strconv.Itoa(len(body))),
	}}
	for k, vs := range r.Header {
		if k == "Content-Length" {
			continue
		}
		hdrs.Headers = append(hdrs.Headers, hv(strings.ToLower(k), strings.Join(vs, ",")))
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
	bodyMsg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}
	for _, m := range []*extprocv3.ProcessingRequest{first, bodyMsg} {
		if err := ps.Send(m); err != nil {
			http.Error(w, "ext_proc send: "+err.Error(), http.StatusInternalServerError)
			return
		}
	}
	resp, err := ps.Recv()
	if err != nil {
		http.Error(w, "ext_proc recv: "+err.Error(), http.StatusInternalServerError)
		return
	}
	if ir := resp.GetImmediateResponse(); ir != nil {
		for _, h := range ir.GetHeaders().GetSetHeaders() {
			w.Header().Set(h.GetHeader().GetKey(), string(h.GetHeader().GetRawValue()))
		}
		w.Header().Set("content-type", "application/json")
		w.WriteHeader(int(ir.GetStatus().GetCode()))
		_, _ = w.Write(ir.GetBody())
		return
	}
	dest := ""
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == picker.HeaderDestination {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	dest, _, _ = strings.Cut(dest, ",")
	var out bytes.Buffer
	for {
		m, err := ps.Recv()
		if err != nil {
			http.Error(w, "ext_proc body: "+err.Error(), http.StatusInternalServerError)
			return
		}
		sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		out.Write(sr.GetBody())
		if sr.GetEndOfStream() {
			break
		}
	}
	if dest == "" {
		http.Error(w, "no destination", http.StatusBadGateway)
		return
	}
	up, err := http.NewRequestWithContext(ctx, r.Method, "http://"+dest+r.URL.RequestURI(), &out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	up.Header = r.Header.Clone()
	up.ContentLength = int64(out.Len())
	ur, err := dp.upstream.Do(up)
	if err != nil {
		http.Error(w, fmt.Sprintf("upstream %s: %v", dest, err), http.StatusBadGateway)
		return
	}
	defer ur.Body.Close()
	// Response headers, then (after the body) end of stream: the picker
	// releases the request's in-flight count when the response ends.
	respHdr := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			hv(":status", strconv.Itoa(ur.StatusCode)), hv("content-type", ur.Header.Get("content-type"))}}}}}
	if err := ps.Send(respHdr); err == nil {
		_, _ = ps.Recv()
	}
	for k, vs := range ur.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(ur.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	firstChunk := true
	for {
		n, err := ur.Body.Read(buf)
		if n > 0 {
			if firstChunk {
				// The first bytes go through the picker before the client
				// sees them, as Envoy sends every chunk in
				// FULL_DUPLEX_STREAMED (the picker sees the first token);
				// the rest go straight on, which keeps this harness's CPU
				// per token low (the picker passes them unchanged here).
				firstChunk = false
				chunk := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
					ResponseBody: &extprocv3.HttpBody{Body: buf[:n]}}}
				if err := ps.Send(chunk); err == nil {
					_, _ = ps.Recv()
				}
			}
			if _, werr := w.Write(buf[:n]); werr != nil {
				break
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err != nil {
			break
		}
	}
	end := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{EndOfStream: true}}}
	if err := ps.Send(end); err == nil {
		_, _ = ps.Recv()
	}
	_ = ps.CloseSend()
}
