package main

import (
	"strings"
	"testing"

	"github.com/switchyard/switchyard/registry/hclfile"
)

// Flags win over the tracing block; Envoy follows unless told not to.
func TestObservabilityFrom(t *testing.T) {
	block := &hclfile.Tracing{Endpoint: "127.0.0.1:4317", EnvoyEndpoint: "10.0.0.9:4317", Envoy: true, SampleRatio: 0.2, HasSampleRatio: true, EnvoyServiceName: "edge"}
	o, err := observabilityFrom(obsFlags{decisionsSample: 1}, block, "v", "r1")
	if err != nil {
		t.Fatal(err)
	}
	defer o.tracer.Shutdown(t.Context())
	if o.tracer == nil || o.envoy == nil || o.envoy.Collector != "10.0.0.9:4317" || o.envoy.SamplePercent != 20 || o.envoy.ServiceName != "edge" {
		t.Fatalf("from the block: tracer %v envoy %+v", o.tracer != nil, o.envoy)
	}
	f := obsFlags{decisionsSample: 0.5, decisionsBuffer: 10, tracingNoEnvoy: true}
	_ = f.tracingRatio.Set("0.5")
	o, err = observabilityFrom(f, block, "v", "r1")
	if err != nil {
		t.Fatal(err)
	}
	defer o.tracer.Shutdown(t.Context())
	if o.envoy != nil || o.decisions.Options().Size != 10 || o.decisions.Options().Sample != 0.5 {
		t.Fatalf("flags: envoy %+v decisions %+v", o.envoy, o.decisions.Options())
	}
	// Envoy's collector defaults to switchyard's host:port.
	o, err = observabilityFrom(obsFlags{tracingEndpoint: "http://127.0.0.1:4317"}, nil, "v", "r1")
	if err != nil {
		t.Fatal(err)
	}
	defer o.tracer.Shutdown(t.Context())
	if o.envoy == nil || o.envoy.Collector != "127.0.0.1:4317" || o.envoy.SamplePercent != 100 {
		t.Fatalf("defaults: %+v", o.envoy)
	}
	for _, c := range []struct {
		f    obsFlags
		want string
	}{
		{obsFlags{decisionsSample: 2}, "-decisions-sample"},
		{obsFlags{tracingService: "x"}, "need -tracing-endpoint"},
		{obsFlags{tracingEndpoint: "nope"}, "host:port"},
	} {
		if _, err := observabilityFrom(c.f, nil, "v", "r"); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.f, err, c.want)
		}
	}
	// No tracing at all: no tracer, records of every request.
	o, err = observabilityFrom(obsFlags{decisionsSample: 1}, nil, "v", "r")
	if err != nil || o.tracer != nil || o.envoy != nil || !o.decisions.Sample() {
		t.Fatalf("off: %+v %v", o, err)
	}
}
