// Package composetest runs docker-compose projects in a real container
// engine for tests: it finds the engine and the Compose CLI (the ones `make
// test` installs, deploy/engine/install.sh), brings a project up under a
// name of its own with an override file, waits for health, kills,
// restarts and inspects its containers, drives load through published
// ports, and removes everything the project created (containers,
// networks, volumes, the images it built) when the test ends. Images it
// did not build (the stand-ins, the build cache) are kept.
//
// A test must not depend on the host's other interfaces or containers:
// FreeSubnet picks an IPv4 /24 no Docker network and no host route uses,
// and test traffic goes only to ports published on 127.0.0.1 or to the
// addresses of the project's own containers.
package composetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Environment variables the package reads.
const (
	// EnvCompose names the Compose v2 binary (a docker CLI plugin) the
	// tests run, e.g. the one install.sh built. When it is set the engine
	// is required: a test fails instead of skipping when it is missing.
	EnvCompose = "SWITCHYARD_COMPOSE"
	// EnvRequire set to 1 requires the engine too (with the host's own
	// `docker compose`).
	EnvRequire = "SWITCHYARD_REQUIRE_ENGINE"
)

// MinComposeVersion is the oldest Compose the package accepts: override
// files use the !override tag (2.24) and depends_on's required (2.20).
const MinComposeVersion = "2.24.0"

// Engine is a container engine and the Compose CLI that drives it.
type Engine struct {
	docker string
	env    []string
	// ComposeVersion is `docker compose version --short`.
	ComposeVersion string
}

// Require returns the engine, or skips the test when there is none (fails
// when EnvCompose or EnvRequire asks for one, or under CI).
func Require(t testing.TB) *Engine {
	t.Helper()
	if testing.Short() {
		t.Skip("runs a container engine: not in -short runs")
	}
	required := os.Getenv(EnvCompose) != "" || os.Getenv(EnvRequire) == "1" || os.Getenv("CI") != ""
	missing := func(format string, args ...any) {
		t.Helper()
		msg := fmt.Sprintf(format, args...) + " (make test installs it: deploy/engine/install.sh)"
		if required {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	docker, err := exec.LookPath("docker")
	if err != nil {
		missing("no docker CLI on PATH")
	}
	e := &Engine{docker: docker, env: engineEnv()}
	if plugin := os.Getenv(EnvCompose); plugin != "" {
		// A private CLI configuration holding only this Compose: the
		// test runs the pinned one, whatever the user's ~/.docker has
		// (plugins, a current context).
		cfg := t.TempDir()
		dir := filepath.Join(cfg, "cli-plugins")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(plugin, filepath.Join(dir, "docker-compose")); err != nil {
			t.Fatal(err)
		}
		e.env = append(e.env, "DOCKER_CONFIG="+cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := e.Docker(ctx, "version", "--format", "{{.Server.Version}}"); err != nil {
		missing("no container engine answers: %v: %s", err, out)
	}
	v, err := e.Docker(ctx, "compose", "version", "--short")
	if err != nil {
		missing("no Compose v2 (docker compose): %v: %s", err, v)
	}
	e.ComposeVersion = strings.TrimPrefix(strings.TrimSpace(v), "v")
	if !versionAtLeast(e.ComposeVersion, MinComposeVersion) {
		missing("Compose %s is older than %s", e.ComposeVersion, MinComposeVersion)
	}
	return e
}

// engineEnv is the caller's environment without what would change what
// Compose loads (COMPOSE_FILE, COMPOSE_PROFILES, ...), with BuildKit on.
func engineEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "COMPOSE_") || k == "DOCKER_CONFIG" || k == "DOCKER_BUILDKIT" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "DOCKER_BUILDKIT=1")
}

// Docker runs the docker CLI and returns its combined output.
func (e *Engine) Docker(ctx context.Context, args ...string) (string, error) {
	return e.run(ctx, nil, "", args...)
}

func (e *Engine) run(ctx context.Context, extraEnv []string, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, e.docker, args...)
	cmd.Env = append(append([]string(nil), e.env...), extraEnv...)
	cmd.Dir = dir
	cmd.WaitDelay = 5 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		err = fmt.Errorf("docker %s: %w", strings.Join(args, " "), err)
	}
	return out.String(), err
}

// versionAtLeast compares dotted versions ("2.40.3" >= "2.24.0").
func versionAtLeast(have, want string) bool {
	h, w := strings.Split(have, "."), strings.Split(want, ".")
	for i := range w {
		if i >= len(h) {
			return false
		}
		hn, herr := strconv.Atoi(strings.TrimFunc(h[i], func(r rune) bool { return r < '0' || r > '9' }))
		wn, _ := strconv.Atoi(w[i])
		if herr != nil {
			return false
		}
		if hn != wn {
			return hn > wn
		}
	}
	return true
}

// errNotFound is returned for a service without a container.
var errNotFound = errors.New("no container")
