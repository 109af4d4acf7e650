package hclfile

import (
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/hashicorp/hcl/v2"
)

// Tracing is the top-level tracing block: where switchyard and Envoy send
// OpenTelemetry spans and which requests they trace. Like the tls block
// it is read once, at start, and is not part of the registry state;
// serve's -tracing-* flags override its fields.
type Tracing struct {
	// Endpoint is the OTLP/gRPC collector switchyard exports to
	// ("host:port", "http://host:port" or "https://host:port").
	Endpoint string
	// EnvoyEndpoint is the collector as the Envoy hosts reach it
	// ("host:port"; default Endpoint's host:port).
	EnvoyEndpoint string
	// Envoy says whether Envoy traces too (default true).
	Envoy bool
	// ServiceName and EnvoyServiceName name the spans' services
	// (defaults "switchyard" and "envoy").
	ServiceName, EnvoyServiceName string
	// SampleRatio is the share of requests traced, 0 to 1 (default 1);
	// HasSampleRatio reports whether it was set.
	SampleRatio    float64
	HasSampleRatio bool
}

// tracingBlank is the detail of an empty attribute in the tracing block.
const tracingBlank = "The tracing block's %s is empty; leave it out instead."

// collectorCheck accepts a collector endpoint: host:port with an optional
// http:// or https:// scheme (schemes only when allowScheme).
func collectorCheck(allowScheme bool) check {
	return func(name, v string) (string, string) {
		hp := v
		if strings.Contains(v, "://") {
			u, err := url.Parse(v)
			if !allowScheme || err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Path != "" && u.Path != "/" {
				what := "host:port"
				if allowScheme {
					what = "host:port, http://host:port (plaintext) or https://host:port (TLS)"
				}
				return "Invalid collector endpoint", fmt.Sprintf("%s %q must be %s.", name, v, what)
			}
			hp = u.Host
		}
		if host, port, err := net.SplitHostPort(hp); err != nil || host == "" || port == "" {
			return "Invalid collector endpoint", fmt.Sprintf("%s %q must name a host and a port, like \"127.0.0.1:4317\".", name, v)
		}
		return "", ""
	}
}

var tracingBody = newBody([]attr[*Tracing]{
	strAttr("endpoint", func(t *Tracing, v string) { t.Endpoint = v }, notBlank(tracingBlank), collectorCheck(true)),
	strAttr("envoy_endpoint", func(t *Tracing, v string) { t.EnvoyEndpoint = v }, notBlank(tracingBlank), collectorCheck(false)),
	boolAttr("envoy", func(t *Tracing, v bool) { t.Envoy = v }),
	strAttr("service_name", func(t *Tracing, v string) { t.ServiceName = v }, notBlank(tracingBlank)),
	strAttr("envoy_service_name", func(t *Tracing, v string) { t.EnvoyServiceName = v }, notBlank(tracingBlank)),
	{name: "sample_ratio", decode: func(d *decoder, f field, t *Tracing) {
		v, ok := d.number(f.at, f.attr.Expr)
		if !ok {
			return
		}
		if v < 0 || v > 1 {
			d.errorAt(f.at, f.rng(), "Invalid sample ratio", fmt.Sprintf("sample_ratio %v must be from 0 to 1 (the share of requests traced).", v))
			return
		}
		t.SampleRatio, t.HasSampleRatio = v, true
	}},
})

func (d *decoder) tracingBlock(b *hcl.Block) {
	const kind = "tracing"
	if !d.declare(kind, "", b) {
		return
	}
	obj := loc{kind: kind}
	t := &Tracing{Envoy: true}
	d.tracing = t
	decodeBody(d, b.Body, tracingBody, obj.at(""), t)
	if t.Endpoint == "" {
		d.errorAt(obj, b.DefRange, "No collector endpoint", "The tracing block needs endpoint, the OTLP/gRPC collector switchyard sends its spans to.")
	}
}
