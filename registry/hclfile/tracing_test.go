package hclfile

import (
	"reflect"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/sched"
)

func TestTracingBlock(t *testing.T) {
	t.Parallel()
	src := tlsListener + `
tracing {
  endpoint       = "https://otel.internal:4317"
  envoy_endpoint = "10.0.0.9:4317"
  sample_ratio   = 0.25
  service_name   = "sy"
  envoy          = false
}
`
	cfg, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if len(diags) > 0 {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	want := &Tracing{Endpoint: "https://otel.internal:4317", EnvoyEndpoint: "10.0.0.9:4317", SampleRatio: 0.25, HasSampleRatio: true, ServiceName: "sy"}
	if !reflect.DeepEqual(cfg.Tracing, want) {
		t.Fatalf("Tracing = %+v, want %+v", cfg.Tracing, want)
	}
	cfg, _ = Parse([]Input{{Name: "c.hcl", Src: []byte(tlsListener + "tracing {\n endpoint = \"127.0.0.1:4317\"\n}\n")}}, sched.Rules)
	if tr := cfg.Tracing; tr == nil || !tr.Envoy || tr.HasSampleRatio {
		t.Fatalf("defaults: %+v", tr)
	}
}

// Problems name file:line:column.
func TestTracingBlockErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ desc, body, want string }{
		{"no endpoint", `sample_ratio = 0.5`, "c.hcl:5:1: error: No collector endpoint"},
		{"ratio above 1", "endpoint = \"127.0.0.1:4317\"\nsample_ratio = 1.5", "c.hcl:7:16: error: Invalid sample ratio"},
		{"no port", `endpoint = "collector"`, "c.hcl:6:12: error: Invalid collector endpoint"},
		{"bad scheme", `endpoint = "ftp://c:1"`, "Invalid collector endpoint"},
		{"scheme for envoy", "endpoint = \"127.0.0.1:4317\"\nenvoy_endpoint = \"http://c:1\"", "c.hcl:7:18: error: Invalid collector endpoint"},
		{"unknown attribute", "endpoint = \"127.0.0.1:4317\"\nratio = 1", "Unsupported argument"},
		{"wrong type", "endpoint = \"127.0.0.1:4317\"\nenvoy = \"yes\"", "Incorrect value type"},
	} {
		t.Run(c.desc, func(t *testing.T) {
			src := tlsListener + "\ntracing {\n" + c.body + "\n}\n"
			_, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
			if !diags.HasErrors() || !strings.Contains(FormatDiagnostics(diags), c.want) {
				t.Fatalf("want %q, got:\n%s", c.want, FormatDiagnostics(diags))
			}
		})
	}
	_, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(tlsListener + "tracing {\nendpoint = \"127.0.0.1:1\"\n}\n")}, {Name: "b.hcl", Src: []byte("tracing {\nendpoint = \"127.0.0.1:1\"\n}\n")}}, sched.Rules)
	if !strings.Contains(FormatDiagnostics(diags), "Duplicate tracing") {
		t.Fatalf("two tracing blocks accepted:\n%s", FormatDiagnostics(diags))
	}
}
