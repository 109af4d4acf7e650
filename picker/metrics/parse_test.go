package metrics

import (
	"bytes"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/registry"
)

func fixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseDialects(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc    string
		engine  registry.Engine
		fixture string
		want    Values
	}{
		{
			desc: "vllm 0.11 page with histograms and lora history", engine: registry.EngineVLLM, fixture: "vllm.txt",
			want: Values{Waiting: 3, Running: 7, KVUsage: 0.4213, BlockSize: 16, NumBlocks: 27904, MaxLoras: 4,
				// The series with the largest timestamp value wins.
				RunningAdapters: []string{"sql-lora", "chat-lora"}, WaitingAdapters: []string{"tone-lora"},
				// The 0.11 page has no inference-time or prefill-token
				// histograms (later versions added them).
				Hists: [NumHists]Hist{HistQueue: {2771.42, 1500}, HistPrefill: {3485.92, 1704}}},
		},
		{
			desc: "legacy vllm gpu_cache_usage_perc, two model_name series", engine: registry.EngineVLLM, fixture: "vllm_legacy.txt",
			// Queue gauges are summed, KV usage is the max.
			want: Values{Waiting: 7, Running: 6, KVUsage: 0.625, BlockSize: 32, NumBlocks: 8192},
		},
		{
			desc: "empty engine means vllm", engine: "", fixture: "vllm_legacy.txt",
			want: Values{Waiting: 7, Running: 6, KVUsage: 0.625, BlockSize: 32, NumBlocks: 8192},
		},
		{
			desc: "sglang", engine: registry.EngineSGLang, fixture: "sglang.txt",
			want: Values{Waiting: 6, Running: 11, KVUsage: 0.77, BlockSize: 1, NumBlocks: 62500},
		},
		{
			desc: "trtllm-serve", engine: registry.EngineTRTLLM, fixture: "trtllm.txt",
			want: Values{Waiting: 1, Running: 9, KVUsage: 0.12, BlockSize: 64, NumBlocks: 4096},
		},
		{
			desc: "triton label-selected series", engine: registry.EngineTritonTRT, fixture: "triton.txt",
			want: Values{Waiting: 3, Running: 5, KVUsage: 0.55, BlockSize: 32, NumBlocks: 2048},
		},
		{
			desc: "wrong dialect reports every required metric missing", engine: registry.EngineSGLang, fixture: "vllm.txt",
			want: Values{Missing: []string{LogicalWaiting, LogicalRunning, LogicalKVUsage}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			p, err := NewParser(tc.engine, nil)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.Parse(fixture(t, tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			got.TTFT = nil // TestEngineTTFT
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got  %+v\nwant %+v", got, tc.want)
			}
			// A parser is reused across scrapes: a second parse of the same
			// page gives the same answer.
			again, err := p.Parse(fixture(t, tc.fixture))
			again.TTFT = nil
			if err != nil || !reflect.DeepEqual(again, tc.want) {
				t.Fatalf("second parse: %+v, %v", again, err)
			}
		})
	}
}

func TestParseOverrides(t *testing.T) {
	t.Parallel()
	page := []byte(`# TYPE custom_queue gauge
custom_queue{model="a"} 4
custom_queue{model="b"} 1
# TYPE custom_reqs gauge
custom_reqs{state="running"} 9
custom_reqs{state="other"} 100
# TYPE custom_kv gauge
custom_kv 0.25
# TYPE custom_cache gauge
custom_cache{block_size="8",num_gpu_blocks="100"} 1
vllm:num_requests_waiting 50
vllm:num_requests_running 50
vllm:kv_cache_usage_perc 0.9
`)
	p, err := NewParser(registry.EngineVLLM, map[string]string{
		LogicalWaiting:     "custom_queue",
		LogicalRunning:     `custom_reqs{state="running"}`,
		LogicalKVUsage:     " custom_kv ",
		LogicalCacheConfig: "custom_cache",
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.Parse(page)
	if err != nil {
		t.Fatal(err)
	}
	want := Values{Waiting: 5, Running: 9, KVUsage: 0.25, BlockSize: 8, NumBlocks: 100}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v want %+v", got, want)
	}
}

func TestOverrideErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc      string
		overrides map[string]string
		wantErr   string
	}{
		{"unknown logical name", map[string]string{"queue": "x"}, `"queue": unknown logical name`},
		{"bad metric name", map[string]string{LogicalWaiting: "9abc"}, "invalid metric name"},
		{"bad matcher", map[string]string{LogicalRunning: "x{state=running}"}, "label matcher"},
		{"unterminated", map[string]string{LogicalRunning: `x{state="a"`}, "missing '}'"},
		{"empty", map[string]string{LogicalKVUsage: ""}, "empty metric name"},
	} {
		err := ValidateOverrides(tc.overrides)
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: err = %v, want containing %q", tc.desc, err, tc.wantErr)
		}
		if _, err := NewParser(registry.EngineVLLM, tc.overrides); err == nil {
			t.Errorf("%s: NewParser accepted bad overrides", tc.desc)
		}
	}
	if err := ValidateOverrides(map[string]string{LogicalLoraInfo: `lora{x="y"}`}); err != nil {
		t.Errorf("valid override rejected: %v", err)
	}
	if _, err := NewParser("tgi", nil); err == nil || !strings.Contains(err.Error(), "unknown engine") {
		t.Errorf("unknown engine: err = %v", err)
	}
}

func TestParseMalformed(t *testing.T) {
	t.Parallel()
	p, err := NewParser(registry.EngineVLLM, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Parse([]byte("vllm:num_requests_waiting{model_name=\"a\" 3\n"))
	if err == nil || !strings.Contains(err.Error(), "parse metrics") {
		t.Fatalf("err = %v", err)
	}
	// The parser recovers on the next good page.
	v, err := p.Parse([]byte("vllm:num_requests_waiting 3\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 1.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	if v.Waiting != 3 || v.Running != 1 || v.KVUsage != 1 {
		t.Fatalf("got %+v (KV must clamp to 1)", v)
	}
}

// BenchmarkParse is the CPU of parsing one page alone: the 20 KB vLLM
// 0.11-shaped fixture and the 53 KB page a real vLLM 0.32 server served
// (issue 25: a whole scrape of a 30 KB page within 100 µs). Run:
//
//	go test -run '^$' -bench 'Parse(VLLM|Real)' -benchmem ./picker/metrics/
func BenchmarkParseVLLM(b *testing.B) { benchParse(b, fixture(b, "vllm.txt")) }

func BenchmarkParseRealVLLM032(b *testing.B) {
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		b.Fatal(err)
	}
	benchParse(b, page)
}

func benchParse(b *testing.B, page []byte) {
	p, err := NewParser(registry.EngineVLLM, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.Parse(page); err != nil {
			b.Fatal(err)
		}
	}
}

func TestTargetsFromState(t *testing.T) {
	t.Parallel()
	s := registry.Empty()
	s.Pools["b"] = &registry.Pool{Name: "b", Engine: registry.EngineSGLang, MetricsPath: "/metrics",
		Scheduling: &registry.Scheduling{ScrapeIntervalMS: 200, IdleScrapeIntervalMS: 3000, Metrics: map[string]string{LogicalWaiting: "q"}},
		Endpoints: []registry.Endpoint{
			{Address: "10.0.0.1:30000"},
			{Address: "10.0.0.2:30000", MetricsPath: "/m2"},
			{Address: "10.0.0.3:30000", Draining: true},
		}}
	s.Pools["a"] = &registry.Pool{Name: "a", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{{Address: "10.0.1.1:8000"}}}
	got := TargetsFromState(s)
	want := []Target{
		{Pool: "a", Address: "10.0.1.1:8000", Engine: registry.EngineVLLM},
		{Pool: "b", Address: "10.0.0.1:30000", MetricsPath: "/metrics", Engine: registry.EngineSGLang, Interval: 200 * time.Millisecond, IdleInterval: 3 * time.Second, Overrides: map[string]string{LogicalWaiting: "q"}},
		{Pool: "b", Address: "10.0.0.2:30000", MetricsPath: "/m2", Engine: registry.EngineSGLang, Interval: 200 * time.Millisecond, IdleInterval: 3 * time.Second, Overrides: map[string]string{LogicalWaiting: "q"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
	if TargetsFromState(nil) != nil {
		t.Error("nil state must give no targets")
	}
}

// BenchmarkExpfmtFullPage is the baseline Parser avoids: handing the whole
// page (histograms included) to the Prometheus text parser.
func BenchmarkExpfmtFullPage(b *testing.B) {
	page := fixture(b, "vllm.txt")
	tp := expfmt.NewTextParser(model.UTF8Validation)
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tp.TextToMetricFamilies(bytes.NewReader(page)); err != nil {
			b.Fatal(err)
		}
	}
}

// TestParseRealVLLM032 parses the /metrics page a real vLLM 0.32 server
// produced (recorded by the real-vLLM tests): after an adapter request it
// carries two lora_requests_info series, and the newest (largest value)
// must win wherever it appears on the page.
func TestParseRealVLLM032(t *testing.T) {
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	var lora []string
	var rest []string
	for _, l := range strings.Split(string(page), "\n") {
		if strings.HasPrefix(l, "vllm:lora_requests_info{") {
			lora = append(lora, l)
		} else {
			rest = append(rest, l)
		}
	}
	if len(lora) < 2 {
		t.Fatalf("recording has %d lora_requests_info series, want several", len(lora))
	}
	p, err := NewParser("vllm", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, order := range [][]string{lora, {lora[1], lora[0]}} {
		v, err := p.Parse([]byte(strings.Join(append(append([]string{}, rest...), order...), "\n") + "\n"))
		if err != nil {
			t.Fatal(err)
		}
		if len(v.Missing) > 0 || v.BlockSize != 32 || v.NumBlocks != 512 || v.MaxLoras != 2 {
			t.Fatalf("parsed %+v; want nothing missing, block size 32, 512 blocks, 2 LoRA slots", v)
		}
		// The newest series is the idle one recorded after the request.
		if len(v.RunningAdapters) != 0 || len(v.WaitingAdapters) != 0 {
			t.Fatalf("adapters running %v waiting %v: an older series won", v.RunningAdapters, v.WaitingAdapters)
		}
		// Every latency histogram the TTFT prediction learns from is
		// on a 0.32 page (values as recorded).
		want := [NumHists]Hist{
			HistQueue: {9.153399878414348e-05, 5}, HistPrefill: {0.04569521099801932, 5},
			HistInference: {0.10833344199818384, 5}, HistPrefillTokens: {54, 5},
		}
		if v.Hists != want {
			t.Fatalf("histograms %+v, want %+v", v.Hists, want)
		}
		if v.TTFT == nil || v.TTFT.Sum != 0.0697789192199707 || v.TTFT.Count != 5 {
			t.Fatalf("TTFT histogram %+v, want sum 0.0698 over 5", v.TTFT)
		}
	}
}

// The engine's own TTFT histogram is read (summed over its series), for
// the status page to show beside the router's measurement and for Perf's
// mean TTFT (its sum too).
func TestEngineTTFT(t *testing.T) {
	page, err := os.ReadFile("testdata/vllm.txt")
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewParser(registry.EngineVLLM, nil)
	if err != nil {
		t.Fatal(err)
	}
	v, err := p.Parse(page)
	if err != nil {
		t.Fatal(err)
	}
	h := v.TTFT
	if h == nil {
		t.Fatal("no TTFT histogram")
	}
	if h.Count != 2279 || len(h.Bounds) != 16 || h.Bounds[0] != 0.001 || h.Cumulative[0] != 298 || h.Cumulative[15] != 2279 || h.Sum != 5779.2783 {
		t.Fatalf("histogram %+v", h)
	}
	// Engines without one have none.
	tp, _ := NewParser(registry.EngineTRTLLM, nil)
	page2, _ := os.ReadFile("testdata/trtllm.txt")
	if v, err := tp.Parse(page2); err != nil || v.TTFT != nil {
		t.Fatalf("trtllm: %+v %v", v.TTFT, err)
	}
}
