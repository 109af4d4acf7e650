package status

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard/switchyard/internal/testutil"
)

// describedNames lists every metric family the collector can emit.
func describedNames() map[string]bool {
	ch := make(chan *prometheus.Desc, 64)
	go func() { collector{}.Describe(ch); close(ch) }()
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	for d := range ch {
		if m := fq.FindStringSubmatch(d.String()); m != nil {
			names[m[1]] = true
		}
	}
	return names
}

// The Grafana dashboard in examples/ only queries metrics switchyard
// actually exports, so a rename cannot silently blank a panel.
func TestGrafanaDashboardUsesExportedMetrics(t *testing.T) {
	path := filepath.Join(testutil.RepoRoot(t), "examples", "grafana", "switchyard-dashboard.json")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	names := describedNames()
	if len(names) < 20 {
		t.Fatalf("collector describes only %d metrics", len(names))
	}
	ident := regexp.MustCompile(`\b(switchyard|inference)_[a-z_]+\b`)
	queried := 0
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, tg := range p.Targets {
			for _, name := range ident.FindAllString(tg.Expr, -1) {
				queried++
				if base := strings.TrimSuffix(name, "_bucket"); base != name && names[base] {
					name = base // a histogram's series
				}
				if !names[name] {
					t.Errorf("panel %q queries %s, which switchyard does not export", p.Title, name)
				}
			}
		}
	}
	if queried == 0 {
		t.Fatal("dashboard queries no switchyard metric")
	}
}
