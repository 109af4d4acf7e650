package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
)

// The simulator is held to real vLLM: the same probes are sent to a real
// vLLM 0.32 server (recorded into testdata/vllm-0.32.0 by the real-vLLM
// pass) and to the simulator, and the shapes of what comes back must
// agree: JSON field paths and types, HTTP status codes, SSE framing, and
// metric families with their label names.

const samplesDir = "testdata/vllm-0.32.0"

// probe is one request sent to both servers.
type probe struct {
	name   string
	method string
	path   string
	body   map[string]any // nil for GET
}

// probes name the model "tiny" and the adapter "sql-lora", as the real
// server serves them and as the simulator is started below.
func probes() []probe {
	long := strings.Repeat("ka lo mi ne ", 700) // over max-model-len 2048
	msgs := []map[string]string{{"role": "user", "content": "ka lo mi ne ru ta"}}
	return []probe{
		{"models", http.MethodGet, "/v1/models", nil},
		{"completion", http.MethodPost, "/v1/completions", map[string]any{"model": "tiny", "prompt": "ka lo mi ne ru ta", "max_tokens": 4, "ignore_eos": true}},
		{"completion-stream", http.MethodPost, "/v1/completions", map[string]any{"model": "tiny", "prompt": "ka lo mi", "max_tokens": 3, "ignore_eos": true, "stream": true, "stream_options": map[string]bool{"include_usage": true}}},
		{"chat", http.MethodPost, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs, "max_tokens": 4, "ignore_eos": true}},
		{"chat-stream", http.MethodPost, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs, "max_tokens": 3, "ignore_eos": true, "stream": true, "stream_options": map[string]bool{"include_usage": true}}},
		{"adapter", http.MethodPost, "/v1/completions", map[string]any{"model": "sql-lora", "prompt": "ka lo mi ne", "max_tokens": 2, "ignore_eos": true}},
		{"unknown-model", http.MethodPost, "/v1/completions", map[string]any{"model": "no-such-model", "prompt": "ka", "max_tokens": 1}},
		{"too-long", http.MethodPost, "/v1/completions", map[string]any{"model": "tiny", "prompt": long, "max_tokens": 1}},
	}
}

// sample is what one probe got back.
type sample struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
}

func send(t *testing.T, base string, p probe) sample {
	t.Helper()
	var rd io.Reader
	if p.body != nil {
		b, err := json.Marshal(p.body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(p.method, base+p.path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	c := &http.Client{Timeout: time.Minute}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	return sample{Status: resp.StatusCode, Body: string(b)}
}

func getMetrics(t *testing.T, base string) string {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// jsonShape lists "path: kind" for every value in a JSON document; array
// elements share the path "[]", so the shape does not depend on lengths.
func jsonShape(doc string) ([]string, error) {
	var v any
	dec := json.NewDecoder(strings.NewReader(doc))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	set := map[string]bool{}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch x := v.(type) {
		case map[string]any:
			set[path+": object"] = true
			for k, e := range x {
				walk(path+"."+k, e)
			}
		case []any:
			set[path+": array"] = true
			for _, e := range x {
				walk(path+"[]", e)
			}
		case string:
			set[path+": string"] = true
		case json.Number:
			set[path+": number"] = true
		case bool:
			set[path+": bool"] = true
		case nil:
			// Optional fields: real vLLM sends many as null, and a client
			// cannot tell null from absent, so nulls are not compared.
		}
	}
	walk("", v)
	return slices.Sorted(func(yield func(string) bool) {
		for k := range set {
			if !yield(k) {
				return
			}
		}
	}), nil
}

// bodyShape is the shape of a body: one JSON document, or an SSE stream
// (the union of its data chunks' shapes, and whether it ends in [DONE]).
func bodyShape(body string) ([]string, error) {
	if !strings.HasPrefix(body, "data: ") {
		return jsonShape(body)
	}
	set := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			set["sse: [DONE]"] = true
			continue
		}
		s, err := jsonShape(data)
		if err != nil {
			return nil, fmt.Errorf("SSE chunk: %w", err)
		}
		for _, k := range s {
			set["sse"+k] = true
		}
	}
	return slices.Sorted(func(yield func(string) bool) {
		for k := range set {
			if !yield(k) {
				return
			}
		}
	}), nil
}

// metricShape lists "family{label,...}" for every vllm: family, with the
// label names sorted.
func metricShape(page string) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(page, "\n") {
		if !strings.HasPrefix(line, "vllm:") {
			continue
		}
		name, rest, _ := strings.Cut(line, "{")
		var labels []string
		if rest != "" {
			for _, kv := range splitLabels(rest[:strings.LastIndexByte(rest, '}')]) {
				k, _, _ := strings.Cut(kv, "=")
				labels = append(labels, k)
			}
		} else {
			name, _, _ = strings.Cut(name, " ")
		}
		sort.Strings(labels)
		out[name+"{"+strings.Join(labels, ",")+"}"] = true
	}
	return out
}

// splitLabels splits `a="x",b="y,z"` on the commas between pairs.
func splitLabels(s string) []string {
	var out []string
	start, quoted := 0, false
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	if start < len(s) {
		out = append(out, s[start:])
	}
	return out
}

// TestRealVLLMSamples sends the probes to a real vLLM server and checks
// that what it answers still has the recorded shapes (a new vLLM would
// show here first). SWITCHYARD_RECORD=1 rewrites the recording instead.
func TestRealVLLMSamples(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	srv := realvllm.StartFleet(t, py, m, realvllm.Options{Name: "tiny", Adapter: "sql-lora"})[0]
	got := map[string]sample{}
	for _, p := range probes() {
		got[p.name] = send(t, srv.URL(), p)
	}
	page := getMetrics(t, srv.URL())
	if os.Getenv("SWITCHYARD_RECORD") == "1" {
		if err := os.MkdirAll(samplesDir, 0o755); err != nil {
			t.Fatal(err)
		}
		b, err := json.MarshalIndent(got, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(samplesDir, "responses.json"), append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(samplesDir, "metrics.txt"), []byte(page), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("recorded %d responses and the metrics page into %s", len(got), samplesDir)
		return
	}
	want := loadSamples(t)
	for _, p := range probes() {
		compareSample(t, "real vLLM now", p.name, want[p.name], got[p.name], nil)
	}
	recorded, err := os.ReadFile(filepath.Join(samplesDir, "metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for fam := range metricShape(string(recorded)) {
		if !metricShape(page)[fam] {
			t.Errorf("real vLLM no longer reports %s (recorded in %s)", fam, samplesDir)
		}
	}
}

func loadSamples(t *testing.T) map[string]sample {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(samplesDir, "responses.json"))
	if err != nil {
		t.Fatalf("recorded samples: %v (record with SWITCHYARD_RECORD=1 go test -run TestRealVLLMSamples ./cmd/vllm-sim)", err)
	}
	var s map[string]sample
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// compareSample fails the test where got's status or shape differs from
// want's; paths listed in ignore may differ.
func compareSample(t *testing.T, who, name string, want, got sample, ignore map[string]bool) {
	t.Helper()
	if want.Status != got.Status {
		t.Errorf("%s %s: status %d, real vLLM %d", who, name, got.Status, want.Status)
		return
	}
	ws, err := bodyShape(want.Body)
	if err != nil {
		t.Fatalf("recorded %s: %v", name, err)
	}
	gs, err := bodyShape(got.Body)
	if err != nil {
		t.Errorf("%s %s: %v: %s", who, name, err, got.Body)
		return
	}
	for _, k := range ws {
		if !slices.Contains(gs, k) && !ignore[k] {
			t.Errorf("%s %s: lacks %q, which real vLLM sends", who, name, k)
		}
	}
	for _, k := range gs {
		if !slices.Contains(ws, k) && !ignore[k] {
			t.Errorf("%s %s: sends %q, which real vLLM does not", who, name, k)
		}
	}
}

// TestSimMatchesRealVLLM holds the simulator to the recorded real answers.
func TestSimMatchesRealVLLM(t *testing.T) {
	want := loadSamples(t)
	s := startSim(t, "-model", "tiny", "-lora-modules", "sql-lora=/adapters/sql",
		"-max-model-len", "2048", "-block-size", "32", "-num-gpu-blocks-override", "512")
	for _, p := range probes() {
		compareSample(t, "vllm-sim", p.name, want[p.name], send(t, "http://"+s.addr, p), simIgnores[p.name])
	}
	recorded, err := os.ReadFile(filepath.Join(samplesDir, "metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	real := metricShape(string(recorded))
	sim := metricShape(getMetrics(t, "http://"+s.addr))
	for fam := range sim {
		if !real[fam] {
			t.Errorf("vllm-sim reports %s, which real vLLM 0.32 does not", fam)
		}
	}
	// Every real family, with the same label names: what a router or a
	// dashboard reads, and the page's size and shape (a fleet of
	// simulators costs a scraper what real servers would).
	for fam := range real {
		if !sim[fam] {
			t.Errorf("vllm-sim lacks %s, which real vLLM 0.32 reports", fam)
		}
	}
}

// simIgnores are fields of real answers the simulator leaves out on
// purpose, per probe.
var simIgnores = map[string]map[string]bool{}
