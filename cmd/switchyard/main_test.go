package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// runCLI runs the command line args in process, as the binary's main
// would (without its os.Exit), and returns the exit code, stdout and
// stderr. Commands that fail before serving start no process and no
// server, so these tests run under -short too.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestValidateCommand(t *testing.T) {
	t.Parallel()
	root := testutil.RepoRoot(t)
	cases := []struct {
		desc   string
		args   []string
		code   int
		stdout string
		stderr []string
		once   []string // each printed exactly once
	}{
		{desc: "single pool", args: []string{"validate", "-config", filepath.Join(root, "examples/single-pool.hcl")},
			stdout: "ok: 1 pool, 1 model, 1 listener\n"},
		{desc: "multi pool", args: []string{"validate", "-config", filepath.Join(root, "examples/multi-pool.hcl")},
			stdout: "ok: 2 pools, 4 models, 1 listener\n"},
		{desc: "demo directory", args: []string{"validate", "-config", filepath.Join(root, "examples/demo")},
			stdout: "ok: 1 pool, 4 models, 1 listener\n"},
		{desc: "bad file", args: []string{"validate", "-config", "testdata/bad.hcl"}, code: 1, stderr: []string{
			"testdata/bad.hcl:4:10: error: Unknown pool: Pool \"lama\" is not defined (defined pools: \"llama\")\n" +
				"  4 |   pool = \"lama\"\n" +
				"    |          ^^^^^^\n",
			"testdata/bad.hcl:8:13: error: Invalid address: \"localhost:8080\": \"localhost\" is not an IP address",
			"  8 |   address = \"localhost:8080\"\n",
			"2 errors\n",
		}, once: []string{"Unknown pool", "Invalid address", `pool = "lama"`}},
		{desc: "kv events", args: []string{"validate", "-config", filepath.Join(root, "examples/kv-events.hcl")},
			stdout: "ok: 1 pool, 1 model, 1 listener\n"},
		{desc: "bad kv events", args: []string{"validate", "-config", "testdata/../../../registry/hclfile/testdata/bad/kv_events.hcl"}, code: 1, stderr: []string{
			"kv_events.hcl:4:19: error: Invalid kv_events: Port 70000 is not in 1-65535",
			"  4 |     port        = 70000\n",
			"kv_events.hcl:20:3: error: Invalid kv_events: KV-cache events need engine \"vllm\"",
			"6 errors\n",
		}},
		{desc: "directory without hcl", args: []string{"validate", "-config", "testdata/../../../registry/hclfile/testdata/nohcl"}, code: 1,
			stderr: []string{"error: No configuration files: ", "contains no *.hcl files", "1 error\n"}, once: []string{"No configuration files"}},
		{desc: "missing config flag", args: []string{"validate"}, code: 2, stderr: []string{"-config is required", "Usage: switchyard validate"}},
		{desc: "stray argument", args: []string{"validate", "-config", "x.hcl", "extra"}, code: 2, stderr: []string{"unexpected arguments"}},
		{desc: "unknown command", args: []string{"frobnicate"}, code: 2, stderr: []string{`unknown command "frobnicate"`, "Usage:"}},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := runCLI(t, tc.args...)
			if code != tc.code {
				t.Errorf("exit code %d, want %d\nstdout: %s\nstderr: %s", code, tc.code, stdout, stderr)
			}
			if tc.code == 0 && stdout != tc.stdout {
				t.Errorf("stdout = %q, want %q", stdout, tc.stdout)
			}
			if missing := testutil.ContainsAll(stderr, tc.stderr...); len(missing) > 0 {
				t.Errorf("stderr lacks %q:\n%s", missing, stderr)
			}
			for _, o := range tc.once {
				if n := strings.Count(stderr, o); n != 1 {
					t.Errorf("stderr has %q %d times, want once:\n%s", o, n, stderr)
				}
			}
		})
	}
}

func TestHelpListsEveryFlag(t *testing.T) {
	t.Parallel()
	code, stdout, _ := runCLI(t, "-h")
	if code != 0 || testutil.ContainsAll(stdout, "serve", "validate", "version") != nil {
		t.Errorf("switchyard -h: exit %d\n%s", code, stdout)
	}
	code, _, stderr := runCLI(t, "serve", "-h")
	if code != 0 {
		t.Errorf("serve -h exit code %d", code)
	}
	if missing := testutil.ContainsAll(stderr, "-config path", "-extproc-addr address", "127.0.0.1:9002",
		"-xds-addr address", "127.0.0.1:18000", "-admin-addr address", "127.0.0.1:9090",
		"-log-level level", "-log-format format", "SIGHUP", "Exit status: 0", "2 for a command-line error"); len(missing) > 0 {
		t.Errorf("serve -h lacks %q:\n%s", missing, stderr)
	}
	code, _, stderr = runCLI(t, "validate", "-h")
	if code != 0 || !strings.Contains(stderr, "-config path") {
		t.Errorf("validate -h: exit %d\n%s", code, stderr)
	}
}

func TestVersionCommand(t *testing.T) {
	t.Parallel()
	code, stdout, _ := runCLI(t, "version")
	if code != 0 || !strings.HasPrefix(stdout, "switchyard devel") || !strings.Contains(stdout, "go1.") {
		t.Errorf("version: exit %d, %q", code, stdout)
	}
}

func TestVersionLdflagsOverride(t *testing.T) {
	// Not parallel: it sets the package-level ldflags variable.
	old := version
	version = "v9.8.7"
	defer func() { version = old }()
	var out bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &out, &out); code != 0 || !strings.HasPrefix(out.String(), "switchyard v9.8.7 (") {
		t.Fatalf("version: %d %q", code, out.String())
	}
}

func TestServeRejectsBadConfig(t *testing.T) {
	t.Parallel()
	code, _, stderr := runCLI(t, "serve", "-config", "testdata/bad.hcl")
	if code != 1 || !strings.Contains(stderr, "testdata/bad.hcl:4:10: error: Unknown pool") {
		t.Errorf("exit %d, stderr:\n%s", code, stderr)
	}
	code, _, stderr = runCLI(t, "serve", "-config", "testdata/bad.hcl", "-log-format", "xml")
	if code != 2 || !strings.Contains(stderr, `bad -log-format "xml"`) {
		t.Errorf("exit %d, stderr:\n%s", code, stderr)
	}
}

// TestServe runs the binary and follows it through /api/status and
// /readyz: it publishes the configuration, applies edits, survives a bad
// edit, reloads on SIGHUP, drains and shuts down cleanly on SIGTERM.
func TestServe(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := func(port int) string {
		return fmt.Sprintf("listener \"l\" {\n  address = \"127.0.0.1:8080\"\n}\npool \"p\" {\n  endpoints = [\"127.0.0.1:%d\"]\n}\nmodel \"m\" {\n  pool = \"p\"\n}\n", port)
	}
	// -config names a symlink to a directory, as deployment tools that
	// swap whole configuration directories do. The file watch follows the
	// directory the link named at start, so edits in it apply at once,
	// while a swap of the link is seen only by a reload (SIGHUP, or the
	// re-read every minute): that makes the SIGHUP observable.
	v1, v2 := filepath.Join(dir, "v1"), filepath.Join(dir, "v2")
	config := filepath.Join(dir, "config")
	for _, d := range []string{v1, v2} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(v1, config); err != nil {
		t.Fatal(err)
	}
	file := testutil.WriteFile(t, v1, "switchyard.hcl", cfg(8001))
	admin := testutil.FreeAddr(t)
	p := testutil.Start(t, "switchyard", testutil.Binary(t, "switchyard"), "serve", "-config", config, "-drain-delay", "3s",
		"-extproc-addr", testutil.FreeAddr(t), "-xds-addr", testutil.FreeAddr(t), "-admin-addr", admin)
	waitStatus := func(what string, cond func(s *status) error) *status {
		t.Helper()
		var last *status
		testutil.Eventually(t, 10*time.Second, what, func() error {
			if p.Exited() {
				return errors.New("switchyard exited:\n" + p.Output())
			}
			var s status
			if err := getJSON("http://"+admin+"/api/status", &s); err != nil {
				return err
			}
			last = &s
			return cond(&s)
		})
		return last
	}
	// published checks that version is in force, translated for Envoy,
	// with pool p's endpoints want and no configuration error.
	published := func(version uint64, want ...string) func(s *status) error {
		return func(s *status) error {
			if s.RegistryVersion != version || s.XDS.RegistryVersion != version {
				return fmt.Errorf("registry version %d, xDS built from %d, want %d", s.RegistryVersion, s.XDS.RegistryVersion, version)
			}
			if got := s.endpoints("p"); !slices.Equal(got, want) {
				return fmt.Errorf("pool p has %v, want %v", got, want)
			}
			if s.ConfigError != "" {
				return fmt.Errorf("config_error %q", s.ConfigError)
			}
			return nil
		}
	}
	waitStatus("version 1 published", published(1, "127.0.0.1:8001"))
	// Ready once its snapshot is served (internal/ready looks every 50 ms).
	testutil.Eventually(t, 10*time.Second, "/readyz with version 1 in force", func() error {
		if code, body := getText(t, "http://"+admin+"/readyz"); code != http.StatusOK {
			return fmt.Errorf("%d %q", code, body)
		}
		return nil
	})

	// A bad edit is reported with its position; version 1 stays in force.
	testutil.WriteFile(t, v1, "bad.hcl", "model \"x\" {\n  pool = \"nope\"\n}\n")
	s := waitStatus("bad edit reported", func(s *status) error {
		if !strings.Contains(s.ConfigError, "bad.hcl:2:10: error: Unknown pool") {
			return fmt.Errorf("config_error %q", s.ConfigError)
		}
		return nil
	})
	if s.RegistryVersion != 1 || !slices.Equal(s.endpoints("p"), []string{"127.0.0.1:8001"}) {
		t.Errorf("after the bad edit: version %d with %v, want version 1 in force", s.RegistryVersion, s.endpoints("p"))
	}
	if err := os.Remove(filepath.Join(v1, "bad.hcl")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(cfg(8002)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitStatus("good edit published", published(2, "127.0.0.1:8002"))

	// A reload of identical content makes no version (the registry unit
	// tests pin that); the swapped directory, read by the next reload, is
	// version 3.
	if err := p.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, v2, "switchyard.hcl", cfg(8003))
	swapped := filepath.Join(dir, "config.new")
	if err := os.Symlink(v2, swapped); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(swapped, config); err != nil {
		t.Fatal(err)
	}
	if err := p.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitStatus("swapped configuration published after SIGHUP", published(3, "127.0.0.1:8003"))

	// SIGTERM: not ready while draining (-drain-delay keeps it serving),
	// then a clean exit.
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "/readyz reports the drain", func() error {
		if p.Exited() {
			return errors.New("switchyard exited before /readyz reported the drain:\n" + p.Output())
		}
		if code, body := getText(t, "http://"+admin+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "draining") {
			return fmt.Errorf("/readyz: %d %q", code, body)
		}
		return nil
	})
	select {
	case <-p.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("switchyard did not exit after SIGTERM")
	}
	if code := p.Cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM\n%s", code, p.Output())
	}
}

// getText GETs url and returns the status code and body (0 and the error
// when the request fails).
func getText(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err.Error()
	}
	return resp.StatusCode, string(b)
}

// TestServeExitCodes checks the documented scheme in process: 1 when serve
// cannot start (configuration, store), 2 for command-line errors. Every
// case fails before anything listens.
func TestServeExitCodes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	good := testutil.WriteFile(t, dir, "ok.hcl", "listener \"l\" {\n  address = \"127.0.0.1:8080\"\n}\npool \"p\" {\n  endpoints = [\"127.0.0.1:8001\"]\n}\n")
	missingDir := filepath.Join(dir, "no", "such")
	shortKey := testutil.WriteFile(t, dir, "short.key", "too-short\n")
	cases := []struct {
		desc string
		args []string
		code int
		want []string
	}{
		{"bad configuration", []string{"-config", "testdata/bad.hcl"}, 1, []string{"testdata/bad.hcl:4:10: error: Unknown pool"}},
		{"store directory missing", []string{"-config", good, "-store", filepath.Join(missingDir, "s.db")}, 1,
			[]string{"serve: store " + filepath.Join(missingDir, "s.db") + ": directory " + missingDir + " does not exist; create it"}},
		{"store is a directory", []string{"-config", good, "-store", dir}, 1,
			[]string{"serve: store " + dir + ": is a directory; the store needs a file path"}},
		{"P/D signing key too short", []string{"-config", good, "-pd-signing-key-file", shortKey}, 1,
			[]string{"serve: -pd-signing-key-file " + shortKey + ": pd: signing key is 9 bytes, want at least 16"}},
		{"P/D signing key missing", []string{"-config", good, "-pd-signing-key-file", filepath.Join(missingDir, "k")}, 1,
			[]string{"serve: -pd-signing-key-file: open " + filepath.Join(missingDir, "k")}},
		{"missing -config", nil, 2, []string{"-config is required"}},
		{"bad -log-level", []string{"-config", good, "-log-level", "loud"}, 2, []string{`bad -log-level "loud"`}},
		{"bad -extproc-advertise", []string{"-config", good, "-extproc-advertise", "picker:9002"}, 2, []string{"-extproc-advertise"}},
		{"unknown flag", []string{"-config", good, "-frobnicate"}, 2, []string{"flag provided but not defined: -frobnicate"}},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			args := append([]string{"serve", "-extproc-addr", "127.0.0.1:0", "-xds-addr", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0"}, tc.args...)
			code := run(t.Context(), args, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit code %d, want %d\nstderr: %s", code, tc.code, stderr.String())
			}
			if missing := testutil.ContainsAll(stderr.String(), tc.want...); len(missing) > 0 {
				t.Errorf("stderr lacks %q:\n%s", missing, stderr.String())
			}
		})
	}
}
