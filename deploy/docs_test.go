package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestDeploymentDocs: docs/deployment.md states what a host needs before
// `docker compose up` works (issue 26: nowhere stated): Go and make for
// the certificates, at the version go.mod asks; Compose v2; BuildKit; how
// to build behind a proxy that intercepts TLS (the build-ca secret the
// compose file defines); and the fault table with the command that
// measures it. The compose file points there.
func TestDeploymentDocs(t *testing.T) {
	root := testutil.RepoRoot(t)
	b, err := os.ReadFile(filepath.Join(root, "docs", "deployment.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	goVersion := regexp.MustCompile(`^\d+\.\d+`).FindString(goDirective(t, root))
	for _, want := range []string{
		"Compose v2", "BuildKit", "DOCKER_BUILDKIT=1", "make compose-certs", "Go (the version in `go.mod`, " + goVersion + ")",
		"SWITCHYARD_BUILD_CA", "id=build-ca", "make test-compose", "| fault | requests | failed |",
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("docs/deployment.md does not mention %q", want)
		}
	}
	compose, err := os.ReadFile(filepath.Join(root, composeFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"docs/deployment.md", "SWITCHYARD_BUILD_CA", "build-ca"} {
		if !strings.Contains(string(compose), want) {
			t.Errorf("%s does not mention %s", composeFile, want)
		}
	}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil || !strings.Contains(string(mk), "\ntest-compose:") {
		t.Errorf("the Makefile has no test-compose target, which the fault table names: %v", err)
	}
}
