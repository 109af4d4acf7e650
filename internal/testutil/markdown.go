package testutil

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// CodeBlock is one fenced code block of a Markdown file.
type CodeBlock struct {
	// Lang is the fence's info string up to the first space ("hcl", "sh").
	Lang string
	// Line is the 1-based line of the block's first content line.
	Line int
	// Text is the block's content, each line ending in "\n".
	Text string
}

// MarkdownFiles returns the repository's Markdown files, relative to root:
// every *.md outside hidden directories, bin/ and testdata/.
func MarkdownFiles(t testing.TB, root string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || name == "bin" || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(d.Name(), ".md") {
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	return files
}

// MarkdownCodeBlocks returns the fenced (```) code blocks of a Markdown
// file, in order. A fence may be indented by up to three spaces, as
// CommonMark allows; a block's lines lose that indentation.
func MarkdownCodeBlocks(t testing.TB, path string) []CodeBlock {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []CodeBlock
	var cur *CodeBlock
	var fence, indent string
	for i, line := range strings.Split(string(b), "\n") {
		trimmed := strings.TrimLeft(line, " ")
		if cur == nil {
			if n := len(line) - len(trimmed); n <= 3 && strings.HasPrefix(trimmed, "```") {
				rest := strings.TrimLeft(trimmed, "`")
				fence = trimmed[:len(trimmed)-len(rest)]
				indent = line[:n]
				lang, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
				cur = &CodeBlock{Lang: lang, Line: i + 2}
			}
			continue
		}
		if strings.HasPrefix(trimmed, fence) && strings.TrimSpace(strings.TrimLeft(trimmed, "`")) == "" {
			blocks = append(blocks, *cur)
			cur = nil
			continue
		}
		cur.Text += strings.TrimPrefix(line, indent) + "\n"
	}
	if cur != nil {
		t.Fatalf("%s:%d: code block never closed", path, cur.Line-1)
	}
	return blocks
}
