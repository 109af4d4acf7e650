// Package tracing owns the picker's OpenTelemetry tracing: the tracer
// provider and its OTLP/gRPC exporter, the sampling rule, reading the
// W3C trace context Envoy (or the client) sent, and the one span per
// request the picker records, with its attributes and events (parsing,
// admission wait, filters, scores, pick, served endpoint, status).
//
// The picker calls a handful of Span methods; every method is a no-op on
// a nil *Span, so an untraced request costs a nil check.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// DefaultServiceName names switchyard's spans when Config.ServiceName is
// empty.
const DefaultServiceName = "switchyard"

// Config says where switchyard sends its spans and which requests it
// traces.
type Config struct {
	// Endpoint is the OTLP/gRPC collector: "host:port" or
	// "http://host:port" for plaintext, "https://host:port" for TLS (the
	// system's roots). Empty turns tracing off.
	Endpoint string
	// ServiceName is the spans' service.name (default "switchyard").
	ServiceName string
	// SampleRatio is the share of requests traced when no sampled parent
	// says otherwise, in [0, 1]. A request whose traceparent carries a
	// sampling decision follows it, so Envoy's decision holds end to end.
	SampleRatio float64
	// Version and Instance become service.version and
	// service.instance.id (the replica).
	Version, Instance string
}

// Validate checks c (an empty Endpoint is valid: tracing off).
func (c Config) Validate() error {
	if c.SampleRatio < 0 || c.SampleRatio > 1 {
		return fmt.Errorf("tracing sample ratio %v: want a number from 0 to 1", c.SampleRatio)
	}
	if c.Endpoint == "" {
		return nil
	}
	_, _, err := collectorURL(c.Endpoint)
	return err
}

// collectorURL normalises an endpoint to a URL with a scheme and returns
// its host:port.
func collectorURL(ep string) (string, string, error) {
	if !strings.Contains(ep, "://") {
		ep = "http://" + ep
	}
	u, err := url.Parse(ep)
	if err != nil {
		return "", "", fmt.Errorf("tracing endpoint %q: %w", ep, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", "", fmt.Errorf("tracing endpoint %q: scheme must be http (plaintext) or https (TLS)", ep)
	}
	if _, port, err := net.SplitHostPort(u.Host); err != nil || port == "" {
		return "", "", fmt.Errorf("tracing endpoint %q: want host:port", ep)
	}
	return u.String(), u.Host, nil
}

// CollectorHostPort returns the host:port of an endpoint as Config takes
// it (for configuring Envoy's exporter to the same collector).
func CollectorHostPort(ep string) (string, error) {
	_, hp, err := collectorURL(ep)
	return hp, err
}

// Tracer starts the picker's spans. A nil *Tracer traces nothing.
type Tracer struct {
	tp    *sdktrace.TracerProvider
	tr    trace.Tracer
	prop  propagation.TraceContext
	ratio float64
}

// New returns a Tracer exporting to cfg.Endpoint over OTLP/gRPC, or nil
// when cfg.Endpoint is empty. The exporter connects lazily and retries:
// a collector that is down loses spans, never requests. Call Shutdown to
// flush.
func New(cfg Config) (*Tracer, error) {
	if cfg.Endpoint == "" {
		return nil, nil
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	u, _, _ := collectorURL(cfg.Endpoint)
	exp, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpointURL(u), otlptracegrpc.WithTimeout(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("tracing exporter: %w", err)
	}
	return NewWithExporter(cfg, exp), nil
}

// NewWithExporter is New with a given exporter (tests, benchmarks).
func NewWithExporter(cfg Config, exp sdktrace.SpanExporter) *Tracer {
	name := cfg.ServiceName
	if name == "" {
		name = DefaultServiceName
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", name)}
	if cfg.Version != "" {
		attrs = append(attrs, attribute.String("service.version", cfg.Version))
	}
	if cfg.Instance != "" {
		attrs = append(attrs, attribute.String("service.instance.id", cfg.Instance))
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second)),
		sdktrace.WithResource(resource.NewSchemaless(attrs...)),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.SampleRatio))),
	)
	return &Tracer{tp: tp, tr: tp.Tracer("github.com/switchyard/switchyard/picker"), ratio: cfg.SampleRatio}
}

// Shutdown exports what is buffered and stops the exporter.
func (t *Tracer) Shutdown(ctx context.Context) error {
	if t == nil {
		return nil
	}
	if err := t.tp.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("tracing shutdown: %w", err)
	}
	return nil
}

// ForceFlush exports every ended span now (tests).
func (t *Tracer) ForceFlush(ctx context.Context) error {
	if t == nil {
		return nil
	}
	return t.tp.ForceFlush(ctx)
}

// traceContext carries the two W3C trace context headers.
type traceContext struct{ parent, state string }

func (c *traceContext) Get(k string) string {
	switch k {
	case "traceparent":
		return c.parent
	case "tracestate":
		return c.state
	}
	return ""
}
func (c *traceContext) Set(string, string) {}
func (c *traceContext) Keys() []string     { return []string{"traceparent", "tracestate"} }

// Start begins the span of one request at start, as a child of the W3C
// trace context traceparent and tracestate carry (e.g. from the ext_proc
// stream's gRPC metadata, where Envoy puts its own span, or the request's
// headers), or of a new trace when traceparent is empty. It returns nil
// when the request is not sampled.
func (t *Tracer) Start(ctx context.Context, traceparent, tracestate string, start time.Time) *Span {
	if t == nil {
		return nil
	}
	if traceparent != "" {
		ctx = t.prop.Extract(ctx, &traceContext{parent: traceparent, state: tracestate})
	}
	if psc := trace.SpanContextFromContext(ctx); !psc.IsValid() && t.ratio <= 0 {
		return nil
	}
	_, s := t.tr.Start(ctx, "switchyard.pick", trace.WithTimestamp(start), trace.WithSpanKind(trace.SpanKindServer))
	if !s.IsRecording() {
		return nil
	}
	sp := &Span{s: s}
	sp.attrs = sp.buf[:0]
	return sp
}

// Span is one request's span. Its methods are no-ops on nil. Attributes
// are gathered and set once, at End (one copy into the span, not one per
// call).
type Span struct {
	s     trace.Span
	attrs []attribute.KeyValue
	buf   [16]attribute.KeyValue
}

// TraceID returns the span's trace ID in hex ("" for nil).
func (sp *Span) TraceID() string {
	if sp == nil {
		return ""
	}
	return sp.s.SpanContext().TraceID().String()
}

// Attribute keys of the picker's span. Model names follow the OpenTelemetry
// GenAI conventions; the rest are switchyard's own.
const (
	keyModel        = "gen_ai.request.model"
	keyTarget       = "switchyard.target_model"
	keyPool         = "switchyard.pool"
	keyTenant       = "switchyard.tenant"
	keyPromptTokens = "switchyard.prompt_tokens"
	keyBodyBytes    = "switchyard.body_bytes"
	keyPath         = "url.path"
	keyRequestID    = "switchyard.request_id"
	keyPicked       = "switchyard.endpoint.picked"
	keyFallbacks    = "switchyard.endpoint.fallbacks"
	keyServed       = "switchyard.endpoint.served"
	keyStatus       = "http.response.status_code"
	keyQueued       = "switchyard.admission.queued"
	keyWaitMS       = "switchyard.admission.waited_ms"
	keyOutcome      = "switchyard.admission.outcome"
	keyOutputTokens = "switchyard.output_tokens"
	keyTTFTMS       = "switchyard.ttft_ms"
	keyPDDecision   = "switchyard.pd.decision"
	keyPDPrefill    = "switchyard.pd.prefill"
	keyPDUncached   = "switchyard.pd.uncached_tokens"
	keyPDResult     = "switchyard.pd.result"
)

// Parsed records the parsed request: its model, the target it is sent as,
// the pool, and its size.
func (sp *Span) Parsed(path, requestID, model, target, pool, tenant string, promptTokens int64, bodyBytes int) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs,
		attribute.String(keyPath, path), attribute.String(keyModel, model), attribute.String(keyTarget, target),
		attribute.String(keyPool, pool), attribute.Int64(keyPromptTokens, promptTokens), attribute.Int(keyBodyBytes, bodyBytes))
	if requestID != "" {
		sp.attrs = append(sp.attrs, attribute.String(keyRequestID, requestID))
	}
	if tenant != "" {
		sp.attrs = append(sp.attrs, attribute.String(keyTenant, tenant))
	}
}

// Queued records that the request waits in its pool's admission queue.
func (sp *Span) Queued(priority int, flow string) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.Bool(keyQueued, true))
	sp.s.AddEvent("admission.queued", trace.WithAttributes(attribute.Int("switchyard.priority", priority), attribute.String("switchyard.flow", flow)))
}

// Admitted records how the admission wait ended: "dispatched", or the
// reason it was turned away.
func (sp *Span) Admitted(waited time.Duration, outcome string) {
	if sp == nil {
		return
	}
	ms := float64(waited.Microseconds()) / 1000
	sp.attrs = append(sp.attrs, attribute.Float64(keyWaitMS, ms), attribute.String(keyOutcome, outcome))
	sp.s.AddEvent("admission.released", trace.WithAttributes(attribute.Float64(keyWaitMS, ms), attribute.String(keyOutcome, outcome)))
}

// Scheduled records the scheduling in one event: the filters that ran,
// in order, with the candidates each left, as "name=left" words (e.g.
// "not-draining=3 model=2") out of pool endpoints; and, when candidates
// were scored (count of them), the scorers with their weights ("prefix*3
// queue*2 ...") and the best candidates, best first, each with its
// weighted total and every scorer's score before its weight
// ("10.0.0.1:8000 total=4.600 prefix=0.900 queue=0.950; ...").
func (sp *Span) Scheduled(pool int, filters string, count int, scorers, best string) {
	if sp == nil {
		return
	}
	if count == 0 {
		sp.s.AddEvent("scheduled", trace.WithAttributes(attribute.Int("switchyard.pool_size", pool),
			attribute.String("switchyard.filters", filters), attribute.Int("switchyard.candidates.count", 0)))
		return
	}
	sp.s.AddEvent("scheduled", trace.WithAttributes(attribute.Int("switchyard.pool_size", pool),
		attribute.String("switchyard.filters", filters), attribute.Int("switchyard.candidates.count", count),
		attribute.String("switchyard.scorers", scorers), attribute.String("switchyard.scores", best)))
}

// Picked records the destination: the primary and its fallbacks (comma
// separated).
func (sp *Span) Picked(primary, fallbacks string) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.String(keyPicked, primary), attribute.String(keyFallbacks, fallbacks))
}

// PD records a prefill/decode decision: "split" (the prefill on
// prefill) or why not, and the prompt's tokens not cached on the decode
// server.
func (sp *Span) PD(decision, prefill string, uncached int) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.String(keyPDDecision, decision), attribute.Int(keyPDUncached, uncached))
	if prefill != "" {
		sp.attrs = append(sp.attrs, attribute.String(keyPDPrefill, prefill))
	}
}

// PDResult records what the decode server's sidecar reported having done
// (split, fallback, local).
func (sp *Span) PDResult(result string) {
	if sp == nil || result == "" {
		return
	}
	sp.attrs = append(sp.attrs, attribute.String(keyPDResult, result))
}

// Rejected records a local reply.
func (sp *Span) Rejected(code int, msg string) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.Int(keyStatus, code))
	sp.s.SetStatus(codes.Error, msg)
	sp.s.AddEvent("rejected", trace.WithAttributes(attribute.Int(keyStatus, code), attribute.String("switchyard.reason", msg)))
}

// Served records the endpoint Envoy reports as having served the
// request.
func (sp *Span) Served(addr string) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.String(keyServed, addr))
}

// Responded records the model server's response status.
func (sp *Span) Responded(code int) {
	if sp == nil {
		return
	}
	sp.attrs = append(sp.attrs, attribute.Int(keyStatus, code))
	if code >= 500 {
		sp.s.SetStatus(codes.Error, fmt.Sprintf("HTTP %d", code))
	}
}

// End finishes the span at end with what the response measured (ttft 0:
// no body was seen).
func (sp *Span) End(end time.Time, ttft time.Duration, outputTokens int) {
	if sp == nil {
		return
	}
	if ttft > 0 {
		sp.attrs = append(sp.attrs, attribute.Float64(keyTTFTMS, float64(ttft.Microseconds())/1000), attribute.Int(keyOutputTokens, outputTokens))
	}
	sp.s.SetAttributes(sp.attrs...)
	sp.s.End(trace.WithTimestamp(end))
}
