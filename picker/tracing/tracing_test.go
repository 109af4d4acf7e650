package tracing

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/internal/testutil/otlptest"
)

// Spans reach a real OTLP collector over gRPC, as children of the
// traceparent they were started from, with the request's attributes and
// events.
func TestSpansReachCollector(t *testing.T) {
	col := otlptest.Start(t)
	tr, err := New(Config{Endpoint: col.Addr, ServiceName: "sy-test", SampleRatio: 1, Version: "v1", Instance: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Shutdown(context.Background())

	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	start := time.Now()
	sp := tr.Start(context.Background(), "00-"+traceID+"-"+parentID+"-01", "", start)
	if sp == nil {
		t.Fatal("sampled parent, but no span")
	}
	if sp.TraceID() != traceID {
		t.Fatalf("trace %s, want the parent's %s", sp.TraceID(), traceID)
	}
	sp.Parsed("/v1/chat/completions", "req-1", "chat", "llama", "pool-a", "", 120, 480)
	sp.Queued(0, "tenant-a")
	sp.Admitted(12*time.Millisecond, "dispatched")
	sp.Scheduled(3, "not-draining=2 model=2", 2, "queue*2", "10.0.0.1:8000 total=2.000 queue=1.000; 10.0.0.2:8000 total=1.000 queue=0.500")
	sp.Picked("10.0.0.1:8000", "10.0.0.2:8000")
	sp.Served("10.0.0.2:8000")
	sp.Responded(200)
	sp.End(start.Add(50*time.Millisecond), 20*time.Millisecond, 8)
	if err := tr.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	var got otlptest.Span
	testutil.Eventually(t, 10*time.Second, "span at the collector", func() error {
		for _, s := range col.Spans() {
			got = s
			return nil
		}
		return fmt.Errorf("no span yet")
	})
	checks := map[string][2]string{
		"service":      {got.Service, "sy-test"},
		"trace":        {got.TraceID(), traceID},
		"parent":       {got.ParentID(), parentID},
		"model":        {got.Attr("gen_ai.request.model"), "chat"},
		"pool":         {got.Attr("switchyard.pool"), "pool-a"},
		"picked":       {got.Attr("switchyard.endpoint.picked"), "10.0.0.1:8000"},
		"served":       {got.Attr("switchyard.endpoint.served"), "10.0.0.2:8000"},
		"status":       {got.Attr("http.response.status_code"), "200"},
		"waited":       {got.Attr("switchyard.admission.waited_ms"), "12"},
		"filter event": {got.EventAttr("scheduled", "switchyard.filters"), "not-draining=2 model=2"},
		"scorers":      {got.EventAttr("scheduled", "switchyard.scorers"), "queue*2"},
		"scores":       {got.EventAttr("scheduled", "switchyard.scores"), "10.0.0.1:8000 total=2.000 queue=1.000; 10.0.0.2:8000 total=1.000 queue=0.500"},
		"fallbacks":    {got.Attr("switchyard.endpoint.fallbacks"), "10.0.0.2:8000"},
	}
	for what, c := range checks {
		if c[0] != c[1] {
			t.Errorf("%s: %q, want %q", what, c[0], c[1])
		}
	}
	if d := time.Duration(got.Span.GetEndTimeUnixNano() - got.Span.GetStartTimeUnixNano()); d != 50*time.Millisecond {
		t.Errorf("span lasts %v, want 50ms", d)
	}
}

// The sampling rule: a parent's decision holds; without one, the ratio
// decides; a ratio of 0 starts nothing.
func TestSampling(t *testing.T) {
	col := otlptest.Start(t)
	for _, c := range []struct {
		desc   string
		ratio  float64
		parent string
		want   bool
	}{
		{"no parent, ratio 1", 1, "", true},
		{"no parent, ratio 0", 0, "", false},
		{"sampled parent, ratio 0", 0, "01", true},
		{"unsampled parent, ratio 1", 1, "00", false},
	} {
		tr, err := New(Config{Endpoint: col.Addr, SampleRatio: c.ratio})
		if err != nil {
			t.Fatal(err)
		}
		tp := ""
		if c.parent != "" {
			tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-" + c.parent
		}
		if got := tr.Start(context.Background(), tp, "", time.Now()) != nil; got != c.want {
			t.Errorf("%s: traced %v, want %v", c.desc, got, c.want)
		}
		_ = tr.Shutdown(context.Background())
	}
	var nilTracer *Tracer
	if nilTracer.Start(context.Background(), "", "", time.Now()) != nil {
		t.Error("nil tracer traced")
	}
	var nilSpan *Span
	nilSpan.Parsed("", "", "", "", "", "", 0, 0) // no panic
	nilSpan.End(time.Now(), 0, 0)
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Endpoint: "127.0.0.1:4317", SampleRatio: 0.5}, ""},
		{Config{Endpoint: "https://otel.internal:4317"}, ""},
		{Config{}, ""},
		{Config{SampleRatio: 1.5}, "from 0 to 1"},
		{Config{Endpoint: "ftp://x:1"}, "scheme"},
		{Config{Endpoint: "collector"}, "host:port"},
	} {
		err := c.cfg.Validate()
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: %v, want %q", c.cfg, err, c.want)
		}
	}
	if hp, err := CollectorHostPort("http://10.0.0.9:4317"); err != nil || hp != "10.0.0.9:4317" {
		t.Errorf("CollectorHostPort: %q %v", hp, err)
	}
}
