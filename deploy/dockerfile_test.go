package deploy

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/testutil"
)

// instruction is one Dockerfile instruction with its continuation lines
// joined.
type instruction struct {
	line int
	cmd  string // upper case
	args string
}

// stage is one FROM ... section of a multi-stage Dockerfile.
type stage struct {
	image, name string
	body        []instruction
}

// parseDockerfile splits a Dockerfile into stages. It understands what the
// project's Dockerfiles use: comments, "\" continuations, FROM [--flags]
// image [AS name].
func parseDockerfile(t *testing.T, file string) []stage {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatalf("read Dockerfile: %v", err)
	}
	var (
		ins     []instruction
		pending strings.Builder
		start   int
	)
	for i, raw := range strings.Split(string(b), "\n") {
		line := strings.TrimSpace(raw)
		if strings.HasPrefix(line, "#") || line == "" && pending.Len() == 0 {
			continue
		}
		if pending.Len() == 0 {
			start = i + 1
		}
		cont := strings.HasSuffix(line, `\`)
		pending.WriteString(strings.TrimSuffix(line, `\`))
		pending.WriteString(" ")
		if cont {
			continue
		}
		text := strings.TrimSpace(pending.String())
		pending.Reset()
		cmd, args, _ := strings.Cut(text, " ")
		ins = append(ins, instruction{line: start, cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)})
	}
	if pending.Len() > 0 {
		t.Fatalf("%s: ends inside a continuation line", file)
	}
	var stages []stage
	for _, in := range ins {
		if in.cmd == "FROM" {
			var words []string
			for _, w := range strings.Fields(in.args) {
				if !strings.HasPrefix(w, "--") {
					words = append(words, w)
				}
			}
			st := stage{}
			switch {
			case len(words) == 1:
				st.image = words[0]
			case len(words) == 3 && strings.EqualFold(words[1], "AS"):
				st.image, st.name = words[0], words[2]
			default:
				t.Fatalf("%s:%d: cannot parse FROM %s", file, in.line, in.args)
			}
			stages = append(stages, st)
			continue
		}
		if len(stages) == 0 {
			if in.cmd != "ARG" {
				t.Fatalf("%s:%d: %s before the first FROM", file, in.line, in.cmd)
			}
			continue
		}
		stages[len(stages)-1].body = append(stages[len(stages)-1].body, in)
	}
	return stages
}

func (s stage) all(cmd string) []instruction {
	var out []instruction
	for _, in := range s.body {
		if in.cmd == cmd {
			out = append(out, in)
		}
	}
	return out
}

func (s stage) last(cmd string) (instruction, bool) {
	all := s.all(cmd)
	if len(all) == 0 {
		return instruction{}, false
	}
	return all[len(all)-1], true
}

func TestDockerfiles(t *testing.T) {
	root := testutil.RepoRoot(t)
	goVersion := goDirective(t, root)
	for _, tc := range []struct {
		file, binary string
		ports        []int
		version      bool // sets main.version
	}{
		{switchyardDockerfile, "switchyard", []int{9002, 18000, 9090}, true},
		{simDockerfile, "vllm-sim", []int{8000}, false},
		{sidecarDockerfile, "pd-sidecar", []int{8000}, false},
	} {
		t.Run(tc.binary, func(t *testing.T) {
			file := filepath.Join(root, tc.file)
			stages := parseDockerfile(t, file)
			if len(stages) < 2 {
				t.Fatalf("%s: want a multi-stage build (builder + small runtime), got %d stage(s)", tc.file, len(stages))
			}
			build, final := stages[0], stages[len(stages)-1]

			// Builder: an official Go image new enough for go.mod.
			repo, tag, _ := strings.Cut(build.image, ":")
			if repo != "golang" || build.name == "" {
				t.Errorf("%s: first stage %q AS %q, want golang:<version> AS <name>", tc.file, build.image, build.name)
			}
			if !goTagSatisfies(tag, goVersion) {
				t.Errorf("%s: builder golang:%s is older than go.mod's go %s", tc.file, tag, goVersion)
			}
			var gobuild string
			for _, in := range build.all("RUN") {
				if strings.Contains(in.args, "go build") {
					gobuild = in.args
				}
			}
			for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "--mount=type=cache,target=/go/pkg/mod", "--mount=type=cache,target=/root/.cache/go-build", "./cmd/" + tc.binary} {
				if !strings.Contains(gobuild, want) {
					t.Errorf("%s: go build step %q lacks %q", tc.file, gobuild, want)
				}
			}
			if tc.version {
				if !strings.Contains(gobuild, "-X main.version=") {
					t.Errorf("%s: go build does not stamp the version (-ldflags -X main.version=...)", tc.file)
				}
				// -X on a variable that does not exist is silently ignored.
				if !declaresStringVar(t, filepath.Join(root, "cmd", tc.binary), "version") {
					t.Errorf("package cmd/%s declares no string variable \"version\" for -X main.version", tc.binary)
				}
			}

			// Runtime: small, non-root, runs the binary built above.
			if strings.HasPrefix(final.image, "golang") {
				t.Errorf("%s: final stage is %s; ship only the binary", tc.file, final.image)
			}
			if !strings.Contains(final.image, ":") || strings.HasSuffix(final.image, ":latest") {
				t.Errorf("%s: final image %q is not pinned to a version", tc.file, final.image)
			}
			copied := false
			for _, in := range final.all("COPY") {
				copied = copied || strings.Contains(in.args, "--from="+build.name)
			}
			if !copied {
				t.Errorf("%s: final stage copies nothing --from=%s", tc.file, build.name)
			}
			user, ok := final.last("USER")
			if !ok {
				t.Errorf("%s: final stage sets no USER: the container would run as root", tc.file)
			} else if u, _, _ := strings.Cut(user.args, ":"); u == "root" || u == "0" {
				t.Errorf("%s: USER %s is root", tc.file, user.args)
			}
			ep, ok := final.last("ENTRYPOINT")
			var argv []string
			if !ok || json.Unmarshal([]byte(ep.args), &argv) != nil || len(argv) == 0 {
				t.Errorf("%s: want ENTRYPOINT in exec (JSON) form, so signals reach the binary; got %q", tc.file, ep.args)
			} else if path.Base(argv[0]) != tc.binary {
				t.Errorf("%s: ENTRYPOINT runs %q, want %s", tc.file, argv[0], tc.binary)
			}
			var exposed []int
			for _, in := range final.all("EXPOSE") {
				for _, f := range strings.Fields(in.args) {
					n, _ := strconv.Atoi(strings.TrimSuffix(f, "/tcp"))
					exposed = append(exposed, n)
				}
			}
			for _, port := range tc.ports {
				if !slices.Contains(exposed, port) {
					t.Errorf("%s: EXPOSE lacks %d (have %v)", tc.file, port, exposed)
				}
			}
		})
	}
}

// goDirective returns go.mod's go version, e.g. "1.26.8".
func goDirective(t *testing.T, root string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+(?:\.\d+)?)\s*$`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	return string(m[1])
}

// goTagSatisfies reports whether image tag golang:<tag> provides at least
// Go version want. A "1.26" tag floats to the newest 1.26.x and satisfies
// any 1.26 patch release; variant suffixes ("-alpine") are ignored.
func goTagSatisfies(tag, want string) bool {
	tag, _, _ = strings.Cut(tag, "-")
	have := versionParts(tag)
	need := versionParts(want)
	if len(have) < 2 || len(need) < 2 {
		return false
	}
	for i := 0; i < len(need); i++ {
		if i >= len(have) {
			return true // floating tag: newest release of this line
		}
		if have[i] != need[i] {
			return have[i] > need[i]
		}
	}
	return true
}

func versionParts(v string) []int {
	var out []int
	for _, p := range strings.Split(v, ".") {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil
		}
		out = append(out, n)
	}
	return out
}

func TestGoTagSatisfies(t *testing.T) {
	for _, tc := range []struct {
		tag, want string
		ok        bool
	}{
		{"1.26", "1.26.8", true},
		{"1.26-alpine", "1.26.8", true},
		{"1.26.8", "1.26.8", true},
		{"1.26.9", "1.26.8", true},
		{"1.26.7", "1.26.8", false},
		{"1.25", "1.26.8", false},
		{"1.27", "1.26.8", true},
		{"latest", "1.26.8", false},
		{"", "1.26.8", false},
	} {
		if got := goTagSatisfies(tc.tag, tc.want); got != tc.ok {
			t.Errorf("goTagSatisfies(%q, %q) = %v, want %v", tc.tag, tc.want, got, tc.ok)
		}
	}
}

// TestDockerignore checks that the build context keeps every file the Go
// build of the images reads (sources, embedded files, go.mod/go.sum) and
// leaves out the large local directories.
func TestDockerignore(t *testing.T) {
	root := testutil.RepoRoot(t)
	ign := readDockerignore(t, filepath.Join(root, ".dockerignore"))

	for _, big := range []string{".git/HEAD", ".venv/bin/envoy", "bin/switchyard"} {
		if out, _ := ign.excluded(big); !out {
			t.Errorf(".dockerignore does not exclude %s", big)
		}
	}

	testutil.SkipProcesses(t, "go list")
	cmd := exec.Command("go", "list", "-deps", "-f",
		`{{if .Module}}{{if .Module.Main}}{{range .GoFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{range .EmbedFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{end}}{{end}}`,
		"./cmd/switchyard", "./cmd/vllm-sim")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOOS=linux", "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	needed := []string{"go.mod", "go.sum"}
	for _, f := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		rel, err := filepath.Rel(root, f)
		if err != nil {
			t.Fatal(err)
		}
		needed = append(needed, filepath.ToSlash(rel))
	}
	if len(needed) < 10 {
		t.Fatalf("go list found only %d files: %q", len(needed), needed)
	}
	for _, f := range needed {
		if out, by := ign.excluded(f); out {
			t.Errorf(".dockerignore pattern %q excludes %s, which the image build needs", by, f)
		}
	}
}

func TestDockerignoreMatching(t *testing.T) {
	ign := dockerignore{}
	for _, p := range []string{"**/testdata", "*.md", "bin", "!bin/keep"} {
		neg := strings.HasPrefix(p, "!")
		ign = append(ign, ignoreRule{re: regexp.MustCompile("^" + globToRegexp(strings.TrimPrefix(p, "!")) + "$"), negate: neg, text: p})
	}
	for _, tc := range []struct {
		path string
		out  bool
	}{
		{"registry/hclfile/testdata/bad/x.hcl", true},
		{"testdata/a", true},
		{"README.md", true},
		{"cmd/README.md", false},
		{"bin/switchyard", true},
		{"bin/keep", false},
		{"binary/x.go", false},
		{"cmd/switchyard/main.go", false},
	} {
		if got, _ := ign.excluded(tc.path); got != tc.out {
			t.Errorf("excluded(%q) = %v, want %v", tc.path, got, tc.out)
		}
	}
}

// declaresStringVar reports whether the Go package in dir declares a
// package-level string variable name (what -ldflags -X can set).
func declaresStringVar(t *testing.T, dir, name string) bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("parse %s: %v", f, err)
		}
		for _, decl := range file.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, n := range vs.Names {
					if n.Name != name {
						continue
					}
					if id, ok := vs.Type.(*ast.Ident); ok && id.Name == "string" {
						return true
					}
					if vs.Type == nil && i < len(vs.Values) {
						if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
							return true
						}
					}
				}
			}
		}
	}
	return false
}

// TestNoBuildOutputsInRepo: `go build ./cmd/X` at the repository root
// leaves a binary X there. Every such name is ignored by git and left out
// of the image build context, and no binary is committed (issue 26: a
// 5.5 MB devcerts was, and made up most of every build context).
func TestNoBuildOutputsInRepo(t *testing.T) {
	root := testutil.RepoRoot(t)
	ign := readDockerignore(t, filepath.Join(root, ".dockerignore"))
	cmds, err := filepath.Glob(filepath.Join(root, "cmd", "*", "main.go"))
	if err != nil || len(cmds) == 0 {
		t.Fatalf("no commands under cmd/: %v", err)
	}
	testutil.SkipProcesses(t, "git")
	git := func(args ...string) *exec.Cmd {
		cmd := exec.Command("git", args...)
		cmd.Dir = root
		return cmd
	}
	for _, m := range cmds {
		name := filepath.Base(filepath.Dir(m))
		if out, _ := ign.excluded(name); !out {
			t.Errorf(".dockerignore does not exclude /%s (go build ./cmd/%s)", name, name)
		}
		if out, _ := ign.excluded("cmd/" + name + "/main.go"); out {
			t.Errorf(".dockerignore's rule for /%s also drops cmd/%s", name, name)
		}
		if err := git("check-ignore", "-q", "--no-index", name).Run(); err != nil {
			t.Errorf(".gitignore does not ignore /%s (go build ./cmd/%s): %v", name, name, err)
		}
		if err := git("check-ignore", "-q", "--no-index", "cmd/"+name+"/main.go").Run(); err == nil {
			t.Errorf(".gitignore's rule for /%s also ignores cmd/%s", name, name)
		}
	}
	out, err := git("ls-files", "-z").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	for _, f := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		fh, err := os.Open(filepath.Join(root, f))
		if err != nil {
			continue // deleted in the work tree
		}
		head := make([]byte, 4)
		n, _ := fh.Read(head)
		fh.Close()
		if n == 4 && string(head) == "\x7fELF" {
			t.Errorf("%s is a committed binary", f)
		}
	}
}
