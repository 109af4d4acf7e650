package hclfile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

const goodConfig = `
listener "public" {
  address = "127.0.0.1:8080"
}

pool "llama" {
  endpoints = [%s]
}

model "chat" {
  pool = "llama"
}
`

func good(addrs ...string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = fmt.Sprintf("%q", a)
	}
	return fmt.Sprintf(goodConfig, strings.Join(q, ", "))
}

const badConfig = `
listener "public" {
  address = "127.0.0.1:8080"
}

model "chat" {
  pool = "nope"
}
`

// replaceFile writes content the way editors do: to a temporary file in the
// same directory, then renamed over the target.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

type harness struct {
	src *Source
	m   *registry.Manager
	pub *registry.Publisher
}

func start(t *testing.T, path string, opts ...SourceOption) *harness {
	t.Helper()
	logger := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	src := NewSource(path, append([]SourceOption{WithLogger(logger), WithSettle(10 * time.Millisecond), WithRefresh(0)}, opts...)...)
	pub := registry.NewPublisher(nil)
	m := registry.NewManager(pub, registry.WithDebounce(0, 0), registry.WithLogger(logger))
	if err := m.AddSource(SourceName, src); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = m.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("manager did not stop")
		}
	})
	return &harness{src: src, m: m, pub: pub}
}

// waitEndpoints waits for a published state whose pool "llama" has exactly
// addrs, and returns it.
func (h *harness) waitEndpoints(t *testing.T, addrs ...string) *registry.State {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	want := strings.Join(addrs, ",")
	s, err := registry.WaitFor(ctx, h.pub, func(s *registry.State) bool {
		p := s.Pools["llama"]
		if p == nil {
			return false
		}
		var got []string
		for _, e := range p.Endpoints {
			got = append(got, e.Address)
		}
		return strings.Join(got, ",") == want
	})
	if err != nil {
		t.Fatalf("waiting for endpoints %s: %v (version %d)", want, err, s.Version)
	}
	return s
}

// waitFailed waits until the source and the manager report a failed load
// mentioning substr.
func (h *harness) waitFailed(t *testing.T, substr string) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "failed reload reported", func() error {
		for _, err := range []error{h.src.LastError(), h.m.LastError()} {
			if err == nil || !strings.Contains(err.Error(), substr) {
				return fmt.Errorf("LastError = %v", err)
			}
		}
		return nil
	})
}

func TestSourceWatchesDirectory(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := testutil.WriteFile(t, dir, "llama.hcl", good("127.0.0.1:8001"))
	h := start(t, dir)
	if s := h.waitEndpoints(t, "127.0.0.1:8001"); s.Version != 1 {
		t.Fatalf("first version = %d", s.Version)
	}

	// A bad edit is reported with its position and changes nothing.
	replaceFile(t, file, badConfig)
	h.waitFailed(t, filepath.Join(dir, "llama.hcl")+`:7:10: error: Unknown pool: Pool "nope" is not defined`)
	var de *DiagnosticsError
	if !errors.As(h.src.LastError(), &de) || len(de.Diags) != 1 || de.Files[file] == nil {
		t.Fatalf("LastError = %#v", h.src.LastError())
	}
	if s, _ := h.pub.Current(); s.Version != 1 || len(s.Pools["llama"].Endpoints) != 1 {
		t.Fatalf("state changed after a bad edit: version %d", s.Version)
	}

	// The next good edit is picked up, as exactly one new version.
	replaceFile(t, file, good("127.0.0.1:8001", "127.0.0.1:8002"))
	if s := h.waitEndpoints(t, "127.0.0.1:8001", "127.0.0.1:8002"); s.Version != 2 {
		t.Fatalf("version after good edit = %d, want 2", s.Version)
	}
	testutil.Eventually(t, 5*time.Second, "errors cleared", func() error {
		if err := errors.Join(h.src.LastError(), h.m.LastError()); err != nil {
			return err
		}
		return nil
	})

	// A new file in the directory is merged in.
	testutil.WriteFile(t, dir, "extra.hcl", "model \"sql-lora\" {\n  pool = \"llama\"\n}\n")
	testutil.Eventually(t, 5*time.Second, "new file merged", func() error {
		if s, _ := h.pub.Current(); s.Models["sql-lora"] == nil {
			return fmt.Errorf("version %d has models %v", s.Version, s.ModelNames())
		}
		return nil
	})

	// Removing every file is an error, not a withdrawal.
	for _, f := range []string{file, filepath.Join(dir, "extra.hcl")} {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	h.waitFailed(t, "contains no *.hcl files")
	if s, _ := h.pub.Current(); s.Models["sql-lora"] == nil || len(s.Pools["llama"].Endpoints) != 2 {
		t.Fatalf("state withdrawn after files were removed: %s", s.Summary())
	}
}

func TestSourceWatchesSingleFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := testutil.WriteFile(t, dir, "switchyard.hcl", good("127.0.0.1:8001"))
	// Other files in the same directory are not part of the configuration.
	testutil.WriteFile(t, dir, "other.hcl", "this is not valid")
	h := start(t, file)
	h.waitEndpoints(t, "127.0.0.1:8001")

	replaceFile(t, file, good("127.0.0.1:8003"))
	h.waitEndpoints(t, "127.0.0.1:8003")

	// An in-place write (truncate, then write) is seen too.
	if err := os.WriteFile(file, []byte(good("127.0.0.1:8004")), 0o644); err != nil {
		t.Fatal(err)
	}
	h.waitEndpoints(t, "127.0.0.1:8004")
}

// TestSourceReload is the SIGHUP path: without file notifications, only
// Reload makes the source re-read its file.
func TestSourceReload(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := testutil.WriteFile(t, dir, "switchyard.hcl", good("127.0.0.1:8001"))
	h := start(t, file, WithoutWatch())
	h.waitEndpoints(t, "127.0.0.1:8001")

	replaceFile(t, file, badConfig)
	if n := h.src.Loads(); n != 1 {
		t.Fatalf("source loaded %d times without a trigger", n)
	}
	h.m.Reload()
	h.waitFailed(t, `:7:10: error: Unknown pool`)

	replaceFile(t, file, good("127.0.0.1:8002"))
	h.m.Reload()
	if s := h.waitEndpoints(t, "127.0.0.1:8002"); s.Version != 2 {
		t.Fatalf("version = %d, want 2", s.Version)
	}
}

func TestSourcePeriodicRefresh(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := testutil.WriteFile(t, dir, "switchyard.hcl", good("127.0.0.1:8001"))
	h := start(t, file, WithoutWatch(), WithRefresh(20*time.Millisecond))
	h.waitEndpoints(t, "127.0.0.1:8001")
	replaceFile(t, file, good("127.0.0.1:8005"))
	h.waitEndpoints(t, "127.0.0.1:8005")
}

func TestEmptyConfigurationIsAnError(t *testing.T) {
	t.Parallel()
	_, diags := Parse([]Input{{Name: "empty.hcl", Src: []byte("# nothing yet\n")}}, sched.Rules)
	if got := FormatDiagnostics(diags); !diags.HasErrors() || !strings.HasPrefix(got, "error: Empty configuration") {
		t.Fatalf("diagnostics = %q", got)
	}
}

// The consul block is read once at start; changing it later is applied
// only by a restart, and the source says so.
func TestSourceWarnsWhenConsulBlockChanges(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	withAgent := func(addr, endpoint string) string {
		return fmt.Sprintf("consul {\n  address = %q\n}\n", addr) + good(endpoint)
	}
	file := testutil.WriteFile(t, dir, "switchyard.hcl", withAgent("127.0.0.1:8500", "127.0.0.1:8001"))
	var logs testutil.SyncBuffer
	h := start(t, file, WithoutWatch(), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	h.waitEndpoints(t, "127.0.0.1:8001")

	replaceFile(t, file, withAgent("127.0.0.1:8500", "127.0.0.1:8002"))
	h.m.Reload()
	h.waitEndpoints(t, "127.0.0.1:8002")
	if strings.Contains(logs.String(), "consul block changed") {
		t.Fatalf("warned although the consul block did not change:\n%s", logs.String())
	}

	replaceFile(t, file, withAgent("10.0.0.5:8500", "127.0.0.1:8003"))
	h.m.Reload()
	h.waitEndpoints(t, "127.0.0.1:8003") // the rest of the change applies
	if n := strings.Count(logs.String(), "consul block changed"); n != 1 {
		t.Errorf("%d warnings about the changed consul block, want 1:\n%s", n, logs.String())
	}
}

// TestSourceWatchesKeyFiles: an API key file outside the configuration
// directory is watched too, so revoking a key (deleting its line) takes
// effect without a reload.
func TestSourceWatchesKeyFiles(t *testing.T) {
	t.Parallel()
	dir, keyDir := t.TempDir(), t.TempDir()
	keyFile := testutil.WriteFile(t, keyDir, "team.keys", apikey.Hash("k1")+"\n"+apikey.Hash("k2")+"\n")
	file := testutil.WriteFile(t, dir, "switchyard.hcl", good("127.0.0.1:8001")+"tenant \"team\" {\n  api_key_file = \""+keyFile+"\"\n}\n")
	h := start(t, file)
	h.waitEndpoints(t, "127.0.0.1:8001")
	keys := func() []string {
		s, _ := h.pub.Current()
		if s.Tenants["team"] == nil {
			return nil
		}
		return s.Tenants["team"].KeyHashes
	}
	if got := keys(); len(got) != 2 {
		t.Fatalf("keys %q", got)
	}
	replaceFile(t, keyFile, apikey.Hash("k2")+"\n")
	testutil.Eventually(t, 5*time.Second, "revoked key gone", func() error {
		if got := keys(); len(got) != 1 || got[0] != apikey.Hash("k2") {
			return fmt.Errorf("keys %q", got)
		}
		return nil
	})
}
