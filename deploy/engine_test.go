package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/deploy/composetest"
	"github.com/switchyard/switchyard/internal/testutil"
)

// TestEngineStandins: deploy/engine/standins.sh builds a stand-in for
// every image the stack needs and no registry here serves: the
// Dockerfiles' base images and syntax frontend, and the images of the
// compose services (the gpu profile's agent included; its real vLLM needs
// GPUs and is never run here). A stand-in without a user would be dead
// weight, so the two lists must be equal.
func TestEngineStandins(t *testing.T) {
	root := testutil.RepoRoot(t)
	script, err := os.ReadFile(filepath.Join(root, "deploy", "engine", "standins.sh"))
	if err != nil {
		t.Fatal(err)
	}
	table := regexp.MustCompile(`(?s)declare -A tags=\((.*?)\n\)`).FindSubmatch(script)
	if table == nil {
		t.Fatal("standins.sh has no tags table")
	}
	var have []string
	for _, m := range regexp.MustCompile(`\[(\w+)\]=(\S+)`).FindAllSubmatch(table[1], -1) {
		have = append(have, string(m[2]))
		if _, err := os.Stat(filepath.Join(root, "deploy", "engine", "standins", string(m[1])+".Dockerfile")); err != nil {
			if _, err2 := os.Stat(filepath.Join(root, "deploy", "engine", "standins", string(m[1])+".sh")); err2 != nil {
				t.Errorf("stand-in %s has no recipe (standins/%s.Dockerfile or .sh)", m[1], m[1])
			}
		}
	}

	need := map[string]bool{}
	for _, file := range []string{switchyardDockerfile, simDockerfile, sidecarDockerfile} {
		b, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		if m := regexp.MustCompile(`(?m)^# syntax=(\S+)`).FindSubmatch(b); m != nil {
			need[string(m[1])] = true
		}
		for _, st := range parseDockerfile(t, filepath.Join(root, file)) {
			need[st.image] = true
		}
	}
	for _, s := range loadProject(t, "gpu").Services {
		if s.Build == nil && !strings.HasPrefix(s.Image, gpuImage+":") {
			need[s.Image] = true
		}
	}
	var want []string
	for img := range need {
		want = append(want, img)
	}
	sort.Strings(want)
	sort.Strings(have)
	if !slices.Equal(have, want) {
		t.Errorf("standins.sh builds %v; the Dockerfiles and %s need %v", have, composeFile, want)
	}
}

// TestEngineLockNotHeld: deploy/engine/install.sh serialises installs with
// a lock file; the dockerd it starts must not inherit the lock's
// descriptor, or every later install (the next make test) waits for as
// long as dockerd runs. Checks every process holding the lock is an
// install in progress.
func TestEngineLockNotHeld(t *testing.T) {
	compose := os.Getenv(composetest.EnvCompose)
	if compose == "" {
		t.Skip("no " + composetest.EnvCompose + ": make test sets it to the cached Compose")
	}
	lock := filepath.Join(filepath.Dir(filepath.Dir(compose)), "engine.lock")
	if _, err := os.Stat(lock); err != nil {
		t.Skipf("no install has run: %v", err)
	}
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	for _, fd := range fds {
		if target, err := os.Readlink(fd); err != nil || target != lock {
			continue
		}
		pid := strings.Split(fd, "/")[2]
		cmd, _ := os.ReadFile("/proc/" + pid + "/cmdline")
		args := strings.Split(strings.TrimRight(string(cmd), "\x00"), "\x00")
		if !slices.ContainsFunc(args, func(a string) bool {
			return strings.HasSuffix(a, "install.sh") || a == "flock"
		}) {
			t.Errorf("process %s (%q) holds %s: the next make engine would wait for it forever", pid, args, lock)
		}
	}
}
