package testutil

import (
	"bytes"
	"image"
	"image/png"
	"os"
	"os/exec"
	"strconv"
	"testing"
)

// ChromiumPath finds Debian's chromium, or skips the test (fails it under
// CI, where `make tools` installs it).
func ChromiumPath(t testing.TB) string {
	t.Helper()
	SkipProcesses(t, "chromium")
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("chromium not installed (make tools installs Debian's chromium package)")
	}
	t.Skip("chromium not installed; apt-get install chromium")
	return ""
}

// Headless runs headless chromium with args and returns its standard
// output, with the flags this sandbox needs (no sandbox as root, no
// background networking) and a window of width x height.
func Headless(t testing.TB, width, height int, args ...string) []byte {
	t.Helper()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
		"--user-data-dir=" + t.TempDir(), "--window-size=" + strconv.Itoa(width) + "," + strconv.Itoa(height), "--virtual-time-budget=4000"}
	cmd := exec.Command(ChromiumPath(t), append(base, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	return stdout.Bytes()
}

// DecodePNG reads the PNG screenshot at path, failing the test if there is
// none or it does not decode.
func DecodePNG(t testing.TB, path string) image.Image {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("no screenshot: %v", err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("screenshot is not a PNG: %v", err)
	}
	return img
}
