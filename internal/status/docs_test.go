package status

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/testutil"
)

// docs/observability.md's metrics table lists every metric switchyard
// exports, and only those.
func TestDocsListEveryMetric(t *testing.T) {
	path := filepath.Join(testutil.RepoRoot(t), "docs", "observability.md")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Metrics\n")
	if !ok {
		t.Fatalf("%s has no \"## Metrics\" section", path)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	documented := map[string]bool{}
	name := regexp.MustCompile("`((?:switchyard|inference)_[a-z0-9_]+)(?:\\{[^`]*\\})?`")
	for _, line := range strings.Split(section, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		for _, m := range name.FindAllStringSubmatch(line, -1) {
			documented[m[1]] = true
		}
	}
	exported := describedNames()
	if len(exported) < 20 || len(documented) < 20 {
		t.Fatalf("%d metrics exported, %d documented: is a pattern broken?", len(exported), len(documented))
	}
	for n := range exported {
		if !documented[n] {
			t.Errorf("metric %s is exported but not in the metrics table of docs/observability.md", n)
		}
	}
	for n := range documented {
		if !exported[n] {
			t.Errorf("docs/observability.md lists metric %s, which switchyard does not export", n)
		}
	}
}
