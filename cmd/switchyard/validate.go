package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/hashicorp/hcl/v2"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry/hclfile"
)

func validateCmd(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("validate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	config := fs.String("config", "", "configuration `path`: an HCL file, or a directory whose *.hcl files are merged (required)")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `Usage: switchyard validate -config PATH

Checks the configuration without starting anything. Every problem is printed
with its file, line and column and a source snippet. Exits 0 and prints a
one-line summary when the configuration is valid, 1 when it is not, 2 for
a command-line error.

Flags:
`)
		fs.PrintDefaults()
	}
	if code, done := parseFlags(fs, args); done {
		return code
	}
	if *config == "" {
		fmt.Fprintln(stderr, "validate: -config is required")
		fs.Usage()
		return 2
	}
	cfg, diags := hclfile.Load(*config, sched.Rules)
	writeDiagnostics(stderr, cfg.Files, diags)
	if diags.HasErrors() {
		return 1
	}
	fmt.Fprintf(stdout, "ok: %s\n", cfg.State.Summary())
	return 0
}

// writeDiagnostics prints each diagnostic once, as
// "file:line:column: error: summary: detail" followed by the source line
// it points at, then the number of errors.
func writeDiagnostics(w io.Writer, files map[string]*hcl.File, diags hcl.Diagnostics) {
	if len(diags) == 0 {
		return
	}
	_ = hclfile.WriteDiagnostics(w, files, diags)
	n := 0
	for _, d := range diags {
		if d.Severity == hcl.DiagError {
			n++
		}
	}
	switch n {
	case 0:
	case 1:
		fmt.Fprintln(w, "1 error")
	default:
		fmt.Fprintf(w, "%d errors\n", n)
	}
}
