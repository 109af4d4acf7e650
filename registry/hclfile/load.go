package hclfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/switchyard/switchyard/registry"
)

// SourceName is the name the file source's endpoints carry in
// registry.Endpoint.Source.
const SourceName = "file"

// Config is the result of loading configuration files.
type Config struct {
	// Files holds every file that was parsed, keyed by the name used in
	// diagnostics, so callers can print source snippets
	// (WriteDiagnostics).
	Files map[string]*hcl.File
	// Update is the files' contribution to the registry. It is only
	// meaningful when the diagnostics have no errors.
	Update registry.Update
	// State is Update merged on its own (Version 0), for summaries.
	State *registry.State
	// Consul is the top-level consul block (nil when there is none). It
	// is not part of the registry state: serve reads it once, at start.
	Consul *ConsulAgent
	// TLS is the top-level tls block (nil when there is none), read once
	// at start like Consul.
	TLS *TLS
	// KeyFiles are the files the configuration reads keys or key hashes
	// from (api_key_file, upstream_api_key_file): Source watches them too.
	KeyFiles []string
	// Tracing is the top-level tracing block (nil when there is none),
	// read once at start.
	Tracing *Tracing
}

// Load reads the configuration at path: one HCL file, or every *.hcl file
// directly inside a directory (in name order, hidden files skipped), merged
// as if they were one file. The diagnostics name file:line:column for every
// problem found; all problems are reported, not just the first. A directory
// without *.hcl files is an error. Pools' scheduling blocks are judged by
// the rules given (registry.Validate; nil: not judged).
func Load(path string, rules registry.SchedulingRules) (*Config, hcl.Diagnostics) {
	files, diags := ListFiles(path)
	if diags.HasErrors() {
		return &Config{Files: map[string]*hcl.File{}}, diags
	}
	srcs := make([]Input, 0, len(files))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			diags = append(diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Cannot read configuration file",
				Detail: fmt.Sprintf("Reading %s: %s.", f, err)})
			continue
		}
		srcs = append(srcs, Input{Name: f, Src: b})
	}
	if diags.HasErrors() {
		return &Config{Files: map[string]*hcl.File{}}, diags
	}
	return Parse(srcs, rules)
}

// ListFiles returns the files Load would read for path.
func ListFiles(path string) ([]string, hcl.Diagnostics) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, hcl.Diagnostics{{Severity: hcl.DiagError, Summary: "Cannot read configuration",
			Detail: fmt.Sprintf("%s.", err)}}
	}
	if !fi.IsDir() {
		return []string{path}, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, hcl.Diagnostics{{Severity: hcl.DiagError, Summary: "Cannot read configuration directory",
			Detail: fmt.Sprintf("%s.", err)}}
	}
	var files []string
	for _, e := range entries {
		if isConfigName(e.Name()) && !e.IsDir() {
			files = append(files, filepath.Join(path, e.Name()))
		}
	}
	sort.Strings(files)
	if len(files) == 0 {
		return nil, hcl.Diagnostics{{Severity: hcl.DiagError, Summary: "No configuration files",
			Detail: fmt.Sprintf("Directory %s contains no *.hcl files.", path)}}
	}
	return files, nil
}

func isConfigName(name string) bool {
	return strings.HasSuffix(name, ".hcl") && !strings.HasPrefix(name, ".")
}

// Input is one configuration file's name (used in diagnostics) and content.
type Input struct {
	Name string
	Src  []byte
}

// Parse decodes the given files as one configuration; see Load.
func Parse(inputs []Input, rules registry.SchedulingRules) (*Config, hcl.Diagnostics) {
	parser := hclparse.NewParser()
	d := newDecoder()
	for _, in := range inputs {
		f, diags := parser.ParseHCL(in.Src, in.Name)
		d.diags = append(d.diags, diags...)
		if f == nil || diags.HasErrors() {
			continue
		}
		d.file(f.Body)
	}
	cfg := &Config{Files: parser.Files()}

	u := registry.Update{
		Source:         SourceName,
		Pools:          d.pools,
		Models:         d.models,
		Tenants:        d.tenants,
		TenantSettings: d.tenantSettings,
	}
	for _, name := range d.listenerOrder {
		u.Listeners = append(u.Listeners, *d.listeners[name])
	}
	u.Routing = d.routing
	if r := d.replicas; r != nil {
		disc := r.disc
		u.ReplicaDiscovery, u.Replicas = &disc, r.peers
	}
	if len(inputs) > 0 && len(d.declared) == 0 && !d.diags.HasErrors() {
		// Most likely a file caught half-written (truncated) or emptied by
		// mistake: refuse rather than withdraw every pool.
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Empty configuration",
			Detail: "The configuration declares no listener, routing, pool or model block."})
	}
	d.mixedModelLists()
	d.tenantWarnings()
	s, _, mergeErr := registry.Merge([]registry.Update{u})
	d.validation(errors.Join(mergeErr, registry.Validate(s, rules)))
	if len(u.Listeners) == 0 && !d.diags.HasErrors() {
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagWarning, Summary: "No listener",
			Detail: "No listener block is defined, so Envoy gets no listener and serves no client traffic."})
	}
	cfg.Update = u
	cfg.State = s
	cfg.Consul = d.agent
	cfg.TLS = d.tls
	cfg.KeyFiles = d.keyFiles
	cfg.Tracing = d.tracing
	sortDiagnostics(d.diags)
	return cfg, d.diags
}

// mixedModelLists warns about pools where some endpoints list the models
// they serve and others list none. The picker judges an endpoint without a
// list by what its server lists in /v1/models, but until the server has
// answered (or when it has no such API) such an endpoint may get any model
// of the pool, including those the lists were written to confine
// (typically a LoRA adapter loaded on some servers only).
func (d *decoder) mixedModelLists() {
	for _, name := range slices.Sorted(maps.Keys(d.pools)) {
		p := d.pools[name]
		var bare []string
		listed := map[string][]string{} // model -> endpoints listing it
		for _, ep := range p.Endpoints {
			if len(ep.Models) == 0 {
				bare = append(bare, ep.Address)
				continue
			}
			for _, m := range ep.Models {
				listed[m] = append(listed[m], ep.Address)
			}
		}
		if len(bare) == 0 || len(listed) == 0 {
			continue
		}
		var parts []string
		for _, m := range slices.Sorted(maps.Keys(listed)) {
			parts = append(parts, fmt.Sprintf("%q (listed by %s)", m, strings.Join(listed[m], ", ")))
		}
		r, ok := d.endpointAt[name][bare[0]]
		if !ok {
			r = d.ranges[loc{kind: registry.KindPool, name: name}]
		}
		d.diags = append(d.diags, &hcl.Diagnostic{
			Severity: hcl.DiagWarning,
			Summary:  "Endpoints without a models list",
			Detail: fmt.Sprintf("In pool %q, %s list no models: the picker sends them only models their servers list in /v1/models, "+
				"but before a server has answered (or if it has no such API) any model of the pool, including %s. "+
				"Give them a models list to be certain.", name, strings.Join(bare, ", "), strings.Join(parts, ", ")),
			Subject: r.Ptr(),
		})
	}
}

// validation turns registry.Validate problems into diagnostics at the
// attribute that caused them, skipping objects that already have a decode
// error (their values were not usable).
func (d *decoder) validation(err error) {
	for _, ve := range registry.ValidationErrors(err) {
		obj := loc{kind: ve.Kind, name: ve.Name, pool: ve.Pool}
		if d.tainted[obj] || d.tainted[obj.with(ve.Field)] {
			continue
		}
		r := d.rangeFor(obj, ve.Field)
		msg := strings.TrimPrefix(ve.Msg, ve.Err.Error()+": ")
		d.diags = append(d.diags, &hcl.Diagnostic{
			Severity: hcl.DiagError,
			Summary:  summaryFor(ve),
			Detail:   capitalize(msg) + ".",
			Subject:  r,
		})
	}
}

func (d *decoder) rangeFor(obj loc, field string) *hcl.Range {
	for f := field; ; {
		k := obj
		k.field = f
		if r, ok := d.ranges[k]; ok {
			return r.Ptr()
		}
		if f == "" {
			break
		}
		if i := strings.LastIndexByte(f, '.'); i >= 0 {
			f = f[:i]
		} else {
			f = ""
		}
	}
	if obj.kind == registry.KindEndpoint {
		if r, ok := d.ranges[loc{kind: registry.KindPool, name: obj.pool}]; ok {
			return r.Ptr()
		}
	}
	return nil
}

func summaryFor(ve *registry.ValidationError) string {
	switch {
	case errors.Is(ve, registry.ErrUnknownPool):
		return "Unknown pool"
	case errors.Is(ve, registry.ErrDuplicate) && ve.Field == "api_keys":
		return "Duplicate API key"
	case errors.Is(ve, registry.ErrDuplicate):
		return "Duplicate " + ve.Kind
	case errors.Is(ve, registry.ErrUnknownEngine):
		return "Unknown engine"
	case errors.Is(ve, registry.ErrUnknownFailureMode):
		return "Unknown failure_mode"
	case errors.Is(ve, registry.ErrBadMetricsPath):
		return "Invalid metrics_path"
	case errors.Is(ve, registry.ErrBadScheduling):
		return "Invalid scheduling"
	case errors.Is(ve, registry.ErrBadDisaggregation):
		return "Invalid disaggregation"
	case errors.Is(ve, registry.ErrBadRole):
		return "Invalid role"
	case errors.Is(ve, registry.ErrBadAdmission):
		return "Invalid admission"
	case errors.Is(ve, registry.ErrBadWeights):
		return "Invalid target weights"
	case errors.Is(ve, registry.ErrSelfTarget):
		return "Model targets itself"
	case errors.Is(ve, registry.ErrBadAddress):
		return "Invalid address"
	case errors.Is(ve, registry.ErrBadLimit):
		return "Invalid limit"
	case errors.Is(ve, registry.ErrUnknownModel):
		return "Unknown model"
	case errors.Is(ve, registry.ErrBadKVEvents):
		return "Invalid kv_events"
	default:
		return "Invalid configuration"
	}
}

// sortDiagnostics orders diagnostics by file and position; those without a
// position come first.
func sortDiagnostics(diags hcl.Diagnostics) {
	sort.SliceStable(diags, func(i, j int) bool {
		a, b := diags[i].Subject, diags[j].Subject
		switch {
		case a == nil || b == nil:
			return a == nil && b != nil
		case a.Filename != b.Filename:
			return a.Filename < b.Filename
		default:
			return a.Start.Byte < b.Start.Byte
		}
	})
}

// FormatDiagnostics renders diagnostics one per line as
// "file:line:column: error: summary: detail", the compact form used in logs
// and error strings.
func FormatDiagnostics(diags hcl.Diagnostics) string {
	lines := make([]string, 0, len(diags))
	for _, diag := range diags {
		sev := "error"
		if diag.Severity == hcl.DiagWarning {
			sev = "warning"
		}
		var b strings.Builder
		if diag.Subject != nil {
			b.WriteString(pos(*diag.Subject))
			b.WriteString(": ")
		}
		b.WriteString(sev)
		b.WriteString(": ")
		b.WriteString(diag.Summary)
		if diag.Detail != "" {
			b.WriteString(": ")
			b.WriteString(strings.TrimSuffix(diag.Detail, "."))
		}
		lines = append(lines, b.String())
	}
	return strings.Join(lines, "\n")
}

// WriteDiagnostics prints every diagnostic once, for people: its compact
// "file:line:column: error: summary: detail" line (as FormatDiagnostics),
// then, when the file is in files, the source line it points at with the
// offending range underlined.
func WriteDiagnostics(w io.Writer, files map[string]*hcl.File, diags hcl.Diagnostics) error {
	var b strings.Builder
	for i, d := range diags {
		b.WriteString(FormatDiagnostics(diags[i : i+1]))
		b.WriteByte('\n')
		if d.Subject != nil {
			if f := files[d.Subject.Filename]; f != nil {
				writeSnippet(&b, f.Bytes, *d.Subject)
			}
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// writeSnippet writes the source line where rng starts, numbered, and a
// line of carets under the part of it rng covers.
func writeSnippet(b *strings.Builder, src []byte, rng hcl.Range) {
	start := rng.Start.Byte
	if start < 0 || start > len(src) {
		return
	}
	lineStart := bytes.LastIndexByte(src[:start], '\n') + 1
	lineEnd := len(src)
	if n := bytes.IndexByte(src[start:], '\n'); n >= 0 {
		lineEnd = start + n
	}
	line := strings.TrimRight(string(src[lineStart:lineEnd]), "\r")
	end := min(max(rng.End.Byte, start), lineStart+len(line))
	num := strconv.Itoa(rng.Start.Line)
	gutter := strings.Repeat(" ", len(num))
	fmt.Fprintf(b, "  %s | %s\n", num, line)
	// Keep tabs as tabs so the carets line up however tabs are shown.
	var pad strings.Builder
	for _, r := range string(src[lineStart:start]) {
		if r == '\t' {
			pad.WriteByte('\t')
		} else {
			pad.WriteByte(' ')
		}
	}
	width := max(utf8.RuneCount(src[start:end]), 1)
	fmt.Fprintf(b, "  %s | %s%s\n", gutter, pad.String(), strings.Repeat("^", width))
}

// DiagnosticsError is the error a failed load produces: it keeps the
// diagnostics (errors and warnings) and the parsed files for snippets.
type DiagnosticsError struct {
	Diags hcl.Diagnostics
	Files map[string]*hcl.File
}

func (e *DiagnosticsError) Error() string {
	var errs hcl.Diagnostics
	for _, d := range e.Diags {
		if d.Severity == hcl.DiagError {
			errs = append(errs, d)
		}
	}
	return strings.ReplaceAll(FormatDiagnostics(errs), "\n", "; ")
}
