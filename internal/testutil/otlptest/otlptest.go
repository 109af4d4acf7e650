// Package otlptest owns an OpenTelemetry collector for tests: a real
// OTLP/gRPC TraceService on 127.0.0.1 that keeps every span it is sent,
// with the service that sent it, so tests can check which spans arrived
// and how they link.
package otlptest

import (
	"context"
	"encoding/hex"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
)

// Span is one received span.
type Span struct {
	Service string
	Span    *tracepb.Span
}

// TraceID, SpanID and ParentID are the span's IDs in hex ("" for none).
func (s Span) TraceID() string  { return hex.EncodeToString(s.Span.GetTraceId()) }
func (s Span) SpanID() string   { return hex.EncodeToString(s.Span.GetSpanId()) }
func (s Span) ParentID() string { return hex.EncodeToString(s.Span.GetParentSpanId()) }

// Attr returns the span's attribute key as text ("" if absent); an
// array is its elements joined by ",".
func (s Span) Attr(key string) string {
	for _, kv := range s.Span.GetAttributes() {
		if kv.GetKey() == key {
			return text(kv.GetValue())
		}
	}
	return ""
}

// EventAttr is Attr of the span's first event named name.
func (s Span) EventAttr(name, key string) string {
	e := s.Event(name)
	for _, kv := range e.GetAttributes() {
		if kv.GetKey() == key {
			return text(kv.GetValue())
		}
	}
	return ""
}

func text(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return strconv.FormatInt(x.IntValue, 10)
	case *commonpb.AnyValue_DoubleValue:
		return strconv.FormatFloat(x.DoubleValue, 'g', -1, 64)
	case *commonpb.AnyValue_BoolValue:
		return strconv.FormatBool(x.BoolValue)
	case *commonpb.AnyValue_ArrayValue:
		var parts []string
		for _, e := range x.ArrayValue.GetValues() {
			parts = append(parts, text(e))
		}
		return strings.Join(parts, ",")
	}
	return ""
}

// Event returns the span's first event named name, or nil.
func (s Span) Event(name string) *tracepb.Span_Event {
	for _, e := range s.Span.GetEvents() {
		if e.GetName() == name {
			return e
		}
	}
	return nil
}

// Collector is a running OTLP/gRPC trace collector.
type Collector struct {
	collectorpb.UnimplementedTraceServiceServer
	// Addr is its host:port.
	Addr string

	mu    sync.Mutex
	spans []Span
}

// Start runs a collector on a free loopback port until the test ends.
func Start(t testing.TB) *Collector {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &Collector{Addr: lis.Addr().String()}
	g := grpc.NewServer()
	collectorpb.RegisterTraceServiceServer(g, c)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return c
}

// Export implements the OTLP TraceService.
func (c *Collector) Export(_ context.Context, req *collectorpb.ExportTraceServiceRequest) (*collectorpb.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				c.spans = append(c.spans, Span{Service: service, Span: sp})
			}
		}
	}
	return &collectorpb.ExportTraceServiceResponse{}, nil
}

// Spans returns every span received so far.
func (c *Collector) Spans() []Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Span(nil), c.spans...)
}
