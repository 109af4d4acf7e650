package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
)

func TestBadFlagsExitTwoAndNameEveryProblem(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run([]string{"-model", "m", "-stages", "10", "-output-len", "9-3", "-lora", "x"}, &stdout, &stderr)
	if code != 2 || stdout.Len() != 0 {
		t.Fatalf("exit %d, stdout %q", code, stdout.String())
	}
	for _, want := range []string{"-stages", "-output-len", "-lora"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr lacks %s:\n%s", want, stderr.String())
		}
	}
	stderr.Reset()
	if code := run([]string{"-workload", "bursty"}, &stdout, &stderr); code != 2 ||
		!strings.Contains(stderr.String(), `workload "bursty"`) || !strings.Contains(stderr.String(), "model: required") {
		t.Errorf("exit %d, stderr:\n%s", code, stderr.String())
	}
}

// The flags reach the wire: chat path, extra header, LoRA adapter model,
// shared-prefix lengths, max_tokens; the JSON report goes to stdout and to
// -json.
func TestFlagsDriveARun(t *testing.T) {
	var mu sync.Mutex
	var bodies []map[string]any
	var tenants []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		var b map[string]any
		_ = json.NewDecoder(r.Body).Decode(&b)
		mu.Lock()
		bodies = append(bodies, b)
		tenants = append(tenants, r.Header.Get("X-Tenant"))
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("x-served-by", "sim-a")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"abcd\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\" efgh\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()

	jsonPath := filepath.Join(t.TempDir(), "out.json")
	var stdout, stderr bytes.Buffer
	code := run([]string{
		"-url", srv.URL, "-api", "chat", "-model", "base", "-H", "X-Tenant: blue",
		"-workload", "shared-prefix", "-groups", "2", "-users-per-group", "2", "-system-len", "6", "-question-len", "3",
		"-output-len", "2", "-lora", "sql-lora:1", "-stages", "20:250ms", "-format", "json", "-json", jsonPath,
	}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, stderr.String())
	}
	var rep load.Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("stdout is not a JSON report: %v\n%s", err, stdout.String())
	}
	fileJSON, err := os.ReadFile(jsonPath)
	if err != nil || !json.Valid(fileJSON) {
		t.Fatalf("-json file: %v", err)
	}
	tot := rep.Total
	if tot.Sent != 5 || tot.Completed != 5 || tot.Servers["sim-a"] != 5 || tot.Models["sql-lora"] != 5 || tot.PrefixCacheHitRate != 0.4 {
		t.Errorf("total %+v", tot)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, b := range bodies {
		msgs, _ := b["messages"].([]any)
		if b["model"] != "sql-lora" || b["max_tokens"] != 2.0 || len(msgs) != 2 || tenants[i] != "blue" {
			t.Fatalf("request %d: body %v, X-Tenant %q", i, b, tenants[i])
		}
		sys, _ := msgs[0].(map[string]any)["content"].(string)
		if len(strings.Fields(sys)) != 6 {
			t.Errorf("system prompt %q: want 6 words", sys)
		}
	}
}
