package envoy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
)

// dirEntries maps each name in dir to its inode (for links: the link's
// own inode, not its target's).
func dirEntries(t *testing.T, dir string) map[string]uint64 {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, e := range entries {
		info, err := os.Lstat(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = info.Sys().(*syscall.Stat_t).Ino
	}
	return out
}

func set(gen int) []File {
	return []File{
		{Name: "cert.pem", Data: []byte(fmt.Sprintf("cert %d", gen)), Mode: 0o644},
		{Name: "key.pem", Data: []byte(fmt.Sprintf("key %d", gen)), Mode: 0o600},
	}
}

func checkSet(t *testing.T, dir string, gen int) {
	t.Helper()
	for _, f := range set(gen) {
		p := filepath.Join(dir, f.Name)
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, f.Data) {
			t.Errorf("%s = %q (%v), want %q", f.Name, got, err, f.Data)
		}
		if target, err := os.Readlink(p); err != nil || target != filepath.Join(DataLink, f.Name) {
			t.Errorf("%s is not the link %s/%s: %q %v", f.Name, DataLink, f.Name, target, err)
		}
		if info, err := os.Stat(p); err != nil || info.Mode().Perm() != f.Mode {
			t.Errorf("%s: mode %v (%v), want %v", f.Name, info.Mode().Perm(), err, f.Mode)
		}
	}
}

// TestWriteFileSetSwapsOneEntry: after the first write, a rotation changes
// exactly one name a watcher of the directory sees moved in (DataLink);
// the names readers open keep their links, and the old set is removed.
func TestWriteFileSetSwapsOneEntry(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	if err := WriteFileSet(dir, 0o755, set(1)); err != nil {
		t.Fatal(err)
	}
	checkSet(t, dir, 1)
	for gen := 2; gen <= 4; gen++ {
		before := dirEntries(t, dir)
		if err := WriteFileSet(dir, 0o755, set(gen)); err != nil {
			t.Fatal(err)
		}
		checkSet(t, dir, gen)
		after := dirEntries(t, dir)
		var changed, sets []string
		for name, ino := range after {
			if strings.HasPrefix(name, setPrefix) {
				sets = append(sets, name)
				continue
			}
			if before[name] != ino {
				changed = append(changed, name)
			}
		}
		if len(changed) != 1 || changed[0] != DataLink {
			t.Errorf("rotation %d changed %v, want only %s", gen, changed, DataLink)
		}
		if len(sets) != 1 || len(after) != 2+2 {
			t.Errorf("rotation %d left %v in the directory", gen, after)
		}
	}
}

// TestWriteFileSetAdoptsPlainFiles: a directory of plain files (from an
// earlier version) is converted without ever pairing new with old: its
// files first become a set of their own.
func TestWriteFileSetAdoptsPlainFiles(t *testing.T) {
	dir := t.TempDir()
	for _, f := range set(1) {
		if err := os.WriteFile(filepath.Join(dir, f.Name), f.Data, f.Mode); err != nil {
			t.Fatal(err)
		}
	}
	if err := WriteFileSet(dir, 0o755, set(2)); err != nil {
		t.Fatal(err)
	}
	checkSet(t, dir, 2)
	// Something other than a plain file or a link is refused.
	odd := t.TempDir()
	if err := os.Mkdir(filepath.Join(odd, "cert.pem"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileSet(odd, 0o755, set(1)); err == nil {
		t.Error("a directory named cert.pem was replaced")
	}
	if err := WriteFileSet(t.TempDir(), 0o755, []File{{Name: "../x"}}); err == nil {
		t.Error("a file name with a path was accepted")
	}
}

// TestWriteFileSetIgnoresUmask: containers that bind-mount the directory
// run as other users; under umask 077 the directories must still be
// 0755 (issue 26: devcerts made 0700 directories, and the stack never
// became healthy). Not parallel: the umask is the process's.
func TestWriteFileSetIgnoresUmask(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dir := filepath.Join(t.TempDir(), "a", "tls")
	if err := WriteFileSet(dir, 0o755, set(1)); err != nil {
		t.Fatal(err)
	}
	checkSet(t, dir, 1)
	for _, d := range []string{dir, filepath.Join(dir, DataLink)} {
		info, err := os.Stat(d)
		if err != nil || info.Mode().Perm() != 0o755 {
			t.Errorf("%s: mode %v (%v), want 0755", d, info.Mode().Perm(), err)
		}
	}
	l := TLSLayout(filepath.Join(t.TempDir(), "envoy"))
	if err := l.Write([]byte("c"), []byte("k"), []byte("ca"), nil); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{l.Cert, l.CA, l.CertSDS, l.CASDS} {
		if info, err := os.Stat(f); err != nil || info.Mode().Perm()&0o004 == 0 {
			t.Errorf("%s is not world-readable under umask 077: %v %v", f, info.Mode().Perm(), err)
		}
	}
}

// TestEnvoyRotationNeverMismatched runs a real Envoy on a certificate
// directory written by Layout.Write and rotates its certificate and key
// several times: Envoy loads each new certificate, and never tries a new
// certificate with an old key (sds.<secret>.key_rotation_failed stays 0;
// a key renamed before its certificate failed every rotation).
func TestEnvoyRotationNeverMismatched(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy")
	}
	envoyBin := testutil.EnvoyPath(t)
	ca, err := certgen.NewCA("rotation test CA", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	issue := func() *certgen.Leaf {
		leaf, err := ca.Issue(certgen.LeafOptions{CommonName: "envoy", SANs: []string{"envoy.internal"}, Client: true})
		if err != nil {
			t.Fatal(err)
		}
		return leaf
	}
	dir := t.TempDir()
	l := TLSLayout(filepath.Join(dir, "tls"))
	leaf := issue()
	if err := l.Write(leaf.CertPEM, leaf.KeyPEM, ca.CertPEM, []string{"switchyard"}); err != nil {
		t.Fatal(err)
	}
	admin := testutil.FreePort(t)
	// The ADS server does not exist: Envoy keeps retrying it, and loads
	// the cluster's certificate all the same.
	rendered, err := Bootstrap(Params{NodeID: "rotation", XDSPort: testutil.FreePort(t), AdminPort: admin, TLSDir: l.Dir})
	if err != nil {
		t.Fatal(err)
	}
	cfg := testutil.WriteFile(t, dir, "envoy.yaml", rendered)
	testutil.Start(t, "envoy", envoyBin, "-c", cfg, "-l", "warning", "--use-dynamic-base-id", "--disable-hot-restart")
	adminURL := fmt.Sprintf("http://127.0.0.1:%d", admin)
	get := func(path string) (string, error) {
		resp, err := http.Get(adminURL + path)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	loaded := func(l *certgen.Leaf) {
		t.Helper()
		want := fmt.Sprintf("%x", l.Cert.SerialNumber)
		testutil.Eventually(t, 30*time.Second, "Envoy serves certificate "+want, func() error {
			out, err := get("/certs")
			if err != nil {
				return err
			}
			if !strings.Contains(strings.ToLower(out), want) {
				return fmt.Errorf("/certs lacks serial %s", want)
			}
			return nil
		})
	}
	loaded(leaf)
	for range 4 {
		leaf = issue()
		if err := l.Write(leaf.CertPEM, leaf.KeyPEM, ca.CertPEM, []string{"switchyard"}); err != nil {
			t.Fatal(err)
		}
		loaded(leaf)
	}
	stats, err := get("/stats?filter=" + CertificateSecret)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^sds\.` + regexp.QuoteMeta(CertificateSecret) + `\.key_rotation_failed: (\d+)$`).FindStringSubmatch(stats)
	if m == nil {
		t.Fatalf("no key_rotation_failed stat for %s:\n%s", CertificateSecret, stats)
	}
	if m[1] != "0" {
		t.Errorf("Envoy failed %s rotations (KEY_VALUES_MISMATCH): it saw a certificate next to another key\n%s", m[1], stats)
	}
}
