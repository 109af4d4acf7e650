package hclfile

import (
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"

	"github.com/switchyard/switchyard/picker/sched"
)

func TestWriteDiagnosticsPrintsEachOnceWithSnippet(t *testing.T) {
	src := "pool \"p\" {\n\tendpoints = [\"127.0.0.1:1\"]\n\tengine    = \"vlm\"\n}\nmodel \"é\" { pool = \"nope\" }\n"
	cfg, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(src)}}, sched.Rules)
	diags = append(diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "No position", Detail: "Nothing to point at."})
	var b strings.Builder
	if err := WriteDiagnostics(&b, cfg.Files, diags); err != nil {
		t.Fatal(err)
	}
	want := `a.hcl:3:14: error: Unknown engine: Unknown engine "vlm": want one of "vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"
  3 | 	engine    = "vlm"
    | 	            ^^^^^
a.hcl:5:20: error: Unknown pool: Pool "nope" is not defined (defined pools: "p")
  5 | model "é" { pool = "nope" }
    |                    ^^^^^^
error: No position: Nothing to point at
`
	if got := b.String(); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
}

func TestWriteDiagnosticsWithoutSource(t *testing.T) {
	// A diagnostic in a file that is not in the map gets no snippet; a
	// range past the end of the source is ignored.
	d := hcl.Diagnostics{
		{Severity: hcl.DiagWarning, Summary: "W", Subject: &hcl.Range{Filename: "gone.hcl", Start: hcl.Pos{Line: 1, Column: 1}}},
		{Severity: hcl.DiagError, Summary: "E", Subject: &hcl.Range{Filename: "x.hcl", Start: hcl.Pos{Line: 9, Column: 1, Byte: 500}}},
	}
	files := map[string]*hcl.File{"x.hcl": {Bytes: []byte("a = 1\n")}}
	var b strings.Builder
	if err := WriteDiagnostics(&b, files, d); err != nil {
		t.Fatal(err)
	}
	if got, want := b.String(), "gone.hcl:1:1: warning: W\nx.hcl:9:1: error: E\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}
