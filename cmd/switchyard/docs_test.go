package main

import (
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/switchyard/switchyard/internal/testutil"
)

// notValidated marks an hcl block the docs show on purpose without it
// being a valid configuration (a fragment, or an error shown as such).
// The reason after the colon is required.
var notValidated = regexp.MustCompile(`(?m)^\s*# not validated: \S`)

// Every hcl block of the Markdown files is a configuration that
// `switchyard validate` accepts, unless it says why not; and its addresses
// are ones no test or reader could reach by accident (loopback, 10/8,
// fd00::/8, or a listener's unspecified address).
func TestDocsHCLBlocksValidate(t *testing.T) {
	t.Parallel()
	root := testutil.RepoRoot(t)
	checked := map[string]int{}
	for _, md := range testutil.MarkdownFiles(t, root) {
		for _, b := range testutil.MarkdownCodeBlocks(t, filepath.Join(root, md)) {
			if b.Lang != "hcl" {
				continue
			}
			where := md + ":" + strconv.Itoa(b.Line)
			if strings.Contains(b.Text, "# not validated") {
				if !notValidated.MatchString(b.Text) {
					t.Errorf("%s: a block marked \"# not validated\" must say why (# not validated: reason)", where)
				}
				continue
			}
			checkDocAddresses(t, where, b.Text)
			path := testutil.WriteFile(t, t.TempDir(), "block.hcl", b.Text)
			code, stdout, stderr := runCLI(t, "validate", "-config", path)
			if code != 0 {
				t.Errorf("%s: switchyard validate exits %d:\n%s%s\nthe block:\n%s", where, code, stdout, stderr, b.Text)
			}
			checked[md]++
		}
	}
	// The pages that must carry validated examples.
	for _, md := range []string{"README.md", "docs/configuration.md", "docs/operations.md", "docs/deployment.md"} {
		if checked[md] == 0 {
			t.Errorf("%s: no hcl block validated", md)
		}
	}
	if checked["docs/configuration.md"] < 10 {
		t.Errorf("docs/configuration.md: %d hcl blocks validated, want one per block type", checked["docs/configuration.md"])
	}
}

var (
	ipv4Literal = regexp.MustCompile(`\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b`)
	ipv6Literal = regexp.MustCompile(`\[([0-9a-fA-F:]+)\]`)
)

func checkDocAddresses(t *testing.T, where, text string) {
	t.Helper()
	var addrs []string
	addrs = append(addrs, ipv4Literal.FindAllString(text, -1)...)
	for _, m := range ipv6Literal.FindAllStringSubmatch(text, -1) {
		addrs = append(addrs, m[1])
	}
	for _, s := range addrs {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Errorf("%s: %q is not an IP address", where, s)
			continue
		}
		private := a.IsLoopback() || a.IsUnspecified() ||
			netip.MustParsePrefix("10.0.0.0/8").Contains(a) || netip.MustParsePrefix("fd00::/8").Contains(a)
		if !private {
			t.Errorf("%s: address %s: docs use loopback, 10/8 or fd00::/8 addresses only", where, a)
		}
	}
}

// Every relative link of the Markdown files points at a file or directory
// of the repository, and every #anchor at a heading of its page.
func TestDocsLinks(t *testing.T) {
	t.Parallel()
	root := testutil.RepoRoot(t)
	files := testutil.MarkdownFiles(t, root)
	anchors := map[string]map[string]bool{}
	for _, md := range files {
		anchors[md] = headingAnchors(t, filepath.Join(root, md))
	}
	links := 0
	for _, md := range files {
		text := markdownProse(t, filepath.Join(root, md))
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			links++
			path, anchor, _ := strings.Cut(target, "#")
			dest := md
			if path != "" {
				dest = filepath.Clean(filepath.Join(filepath.Dir(md), path))
				if strings.HasPrefix(dest, "..") {
					t.Errorf("%s: link %q leaves the repository", md, target)
					continue
				}
				if _, err := os.Stat(filepath.Join(root, dest)); err != nil {
					t.Errorf("%s: link %q: %s does not exist", md, target, dest)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			set, ok := anchors[dest]
			if !ok {
				t.Errorf("%s: link %q has an anchor, but %s is not a Markdown page", md, target, dest)
				continue
			}
			if !set[anchor] {
				t.Errorf("%s: link %q: %s has no heading #%s", md, target, dest, anchor)
			}
		}
	}
	if links < 50 {
		t.Errorf("found only %d relative links in %d Markdown files: is the link pattern broken?", links, len(files))
	}
}

// mdLink matches an inline link or image, [text](target "title"); the
// target is the first group.
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)

// markdownProse returns the file without its fenced code blocks and code
// spans, where link syntax is only text.
func markdownProse(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	inFence := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimLeft(line, " "), "```") {
			inFence = !inFence
			continue
		}
		if !inFence {
			out.WriteString(codeSpan.ReplaceAllString(line, "``"))
			out.WriteByte('\n')
		}
	}
	return out.String()
}

var codeSpan = regexp.MustCompile("`[^`]*`")

// headingAnchors returns the anchors GitHub gives a page's headings: the
// heading lower-cased, without punctuation other than '-' and '_', spaces
// as '-', and "-1", "-2", ... for repeats.
func headingAnchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimLeft(line, " "), "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		slug := headingSlug(text)
		if n := seen[slug]; n > 0 {
			set[slug+"-"+strconv.Itoa(n)] = true
		} else {
			set[slug] = true
		}
		seen[slug]++
	}
	return set
}

func headingSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Every flag `switchyard serve -h` lists is documented in
// docs/configuration.md.
func TestDocsListEveryServeFlag(t *testing.T) {
	t.Parallel()
	code, _, usage := runCLI(t, "serve", "-h")
	if code != 0 {
		t.Fatalf("serve -h exits %d", code)
	}
	doc, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	flags := regexp.MustCompile(`(?m)^  (-[a-z][a-z-]*)`).FindAllStringSubmatch(usage, -1)
	if len(flags) < 20 {
		t.Fatalf("found %d flags in serve -h:\n%s", len(flags), usage)
	}
	for _, f := range flags {
		if !strings.Contains(string(doc), "`"+f[1]+"`") {
			t.Errorf("docs/configuration.md does not document %s", f[1])
		}
	}
}
