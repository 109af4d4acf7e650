package composetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// projectLabel is the label Compose puts on everything a project creates.
const projectLabel = "com.docker.compose.project"

// Options describe a project.
type Options struct {
	// Files are the compose files, in order. The first one's directory is
	// the project directory, against which relative paths resolve.
	Files []string
	// Override, when not empty, is the text of one more compose file,
	// applied last (addresses, ports and mounts a test moves).
	Override string
	// Env are variables for the files' interpolation.
	Env map[string]string
	// Profiles are enabled for every command.
	Profiles []string
	// NamePrefix starts the project name (default "syt"); a random suffix
	// makes it unique, so concurrent tests never share containers,
	// networks or volumes.
	NamePrefix string
}

// Project is one compose project a test runs.
type Project struct {
	// Name is the project name (docker compose -p).
	Name string
	// Dir is the project directory.
	Dir string

	e    *Engine
	args []string
	env  []string
}

// NewProject prepares a project; nothing runs until the test calls Up or
// Compose. When the test ends, the project is taken down with its
// volumes and the images it built, its logs are printed if the test
// failed, and anything left behind fails the test.
func (e *Engine) NewProject(t testing.TB, o Options) *Project {
	t.Helper()
	if len(o.Files) == 0 {
		t.Fatal("composetest: no compose file")
	}
	prefix := o.NamePrefix
	if prefix == "" {
		prefix = "syt"
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	p := &Project{Name: prefix + hex.EncodeToString(b[:]), Dir: filepath.Dir(o.Files[0]), e: e}
	p.args = []string{"compose", "-p", p.Name, "--project-directory", p.Dir}
	for _, f := range o.Files {
		p.args = append(p.args, "-f", f)
	}
	if o.Override != "" {
		f := filepath.Join(t.TempDir(), "override.yaml")
		if err := os.WriteFile(f, []byte(o.Override), 0o644); err != nil {
			t.Fatal(err)
		}
		p.args = append(p.args, "-f", f)
	}
	for _, pr := range o.Profiles {
		p.args = append(p.args, "--profile", pr)
	}
	keys := make([]string, 0, len(o.Env))
	for k := range o.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		p.env = append(p.env, k+"="+o.Env[k])
	}
	t.Cleanup(func() { p.cleanup(t) })
	return p
}

// Compose runs `docker compose` on the project with args.
func (p *Project) Compose(ctx context.Context, args ...string) (string, error) {
	return p.e.run(ctx, p.env, p.Dir, append(append([]string(nil), p.args...), args...)...)
}

// Must runs `docker compose` with args, bounded by within, and fails the
// test on an error.
func (p *Project) Must(t testing.TB, within time.Duration, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	out, err := p.Compose(ctx, args...)
	if err != nil {
		t.Fatalf("%v\n%s", err, tail(out, 4000))
	}
	return out
}

// Up runs `docker compose up -d --wait` with args (e.g. --build): it
// returns once every started service is running and, when it has a health
// check, healthy.
func (p *Project) Up(t testing.TB, within time.Duration, args ...string) string {
	t.Helper()
	all := append([]string{"up", "-d", "--wait", "--wait-timeout", strconv.Itoa(int(within.Seconds()))}, args...)
	return p.Must(t, within+time.Minute, all...)
}

// Docker runs the docker CLI (not compose) with the project's engine.
func (p *Project) Docker(ctx context.Context, args ...string) (string, error) {
	return p.e.Docker(ctx, args...)
}

// ContainerID returns the ID of the service's container (running or not),
// or "" when it has none.
func (p *Project) ContainerID(t testing.TB, service string) string {
	t.Helper()
	out := p.Must(t, 30*time.Second, "ps", "-a", "-q", service)
	ids := strings.Fields(out)
	if len(ids) == 0 {
		return ""
	}
	return ids[0]
}

// State is what the engine reports about a service's container.
type State struct {
	ID           string
	Status       string // running, exited, restarting, ...
	Running      bool
	Pid          int    // on the host; 0 when not running
	Health       string // healthy, unhealthy, starting; "" without a check
	RestartCount int    // restarts by the restart policy
	StartedAt    time.Time
	FinishedAt   time.Time
	// IPs by network name (as Docker names it: project_network).
	IPs map[string]string
}

// Inspect returns the state of the service's container.
func (p *Project) Inspect(t testing.TB, service string) State {
	t.Helper()
	st, err := p.inspect(service, p.ContainerID(t, service))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (p *Project) inspect(service, id string) (State, error) {
	if id == "" {
		return State{}, fmt.Errorf("%s: %w", service, errNotFound)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := p.e.Docker(ctx, "inspect", "--type", "container", id)
	if err != nil {
		return State{}, fmt.Errorf("%v: %s", err, out)
	}
	var raw []struct {
		ID           string `json:"Id"`
		RestartCount int
		State        struct {
			Status     string
			Running    bool
			Pid        int
			StartedAt  time.Time
			FinishedAt time.Time
			Health     *struct{ Status string }
		}
		NetworkSettings struct {
			Networks map[string]struct{ IPAddress string }
		}
	}
	if err := json.Unmarshal([]byte(out), &raw); err != nil || len(raw) != 1 {
		return State{}, fmt.Errorf("docker inspect %s: %v: %s", id, err, tail(out, 500))
	}
	r := raw[0]
	st := State{ID: r.ID, Status: r.State.Status, Running: r.State.Running, Pid: r.State.Pid,
		RestartCount: r.RestartCount, StartedAt: r.State.StartedAt, FinishedAt: r.State.FinishedAt,
		IPs: map[string]string{}}
	if r.State.Health != nil {
		st.Health = r.State.Health.Status
	}
	for name, n := range r.NetworkSettings.Networks {
		st.IPs[name] = n.IPAddress
	}
	return st, nil
}

// WaitHealthy waits until each service's container runs and, if it has a
// health check, is healthy.
func (p *Project) WaitHealthy(t testing.TB, within time.Duration, services ...string) {
	t.Helper()
	testutil.Eventually(t, within, "healthy: "+strings.Join(services, ", "), func() error {
		for _, s := range services {
			st, err := p.inspect(s, p.ContainerID(t, s))
			if err != nil {
				return err
			}
			if !st.Running || (st.Health != "" && st.Health != "healthy") {
				return fmt.Errorf("%s is %s (health %q)", s, st.Status, st.Health)
			}
		}
		return nil
	})
}

// Kill sends signal (e.g. "KILL") to the service's container through the
// engine: `docker kill` counts as a manual stop, so the restart policy
// does not bring it back.
func (p *Project) Kill(t testing.TB, service, signal string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := p.e.Docker(ctx, "kill", "-s", signal, p.ContainerID(t, service)); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
}

// Exec runs cmd in the service's running container (`docker compose exec
// -T`) and returns its combined output.
func (p *Project) Exec(ctx context.Context, service string, cmd ...string) (string, error) {
	return p.Compose(ctx, append([]string{"exec", "-T", service}, cmd...)...)
}

// Logs returns the services' logs (all services when none is named).
func (p *Project) Logs(t testing.TB, services ...string) string {
	t.Helper()
	return p.Must(t, time.Minute, append([]string{"logs", "--no-color", "--no-log-prefix"}, services...)...)
}

// Event is one container event of the project.
type Event struct {
	Service string
	Action  string
	Time    time.Time
}

// Events returns the project's container events with the given action
// (e.g. "die") between since and until, oldest first.
func (p *Project) Events(t testing.TB, action string, since, until time.Time) []Event {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := p.e.Docker(ctx, "events", "--since", strconv.FormatInt(since.Unix(), 10),
		"--until", strconv.FormatInt(until.Unix()+1, 10),
		"--filter", "type=container", "--filter", "event="+action,
		"--filter", "label="+projectLabel+"="+p.Name, "--format", "{{json .}}")
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var events []Event
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "" {
			continue
		}
		var ev struct {
			Action   string
			TimeNano int64 `json:"timeNano"`
			Actor    struct{ Attributes map[string]string }
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("docker events: %v: %s", err, line)
		}
		events = append(events, Event{Service: ev.Actor.Attributes["com.docker.compose.service"], Action: ev.Action, Time: time.Unix(0, ev.TimeNano)})
	}
	sort.Slice(events, func(i, j int) bool { return events[i].Time.Before(events[j].Time) })
	return events
}

// cleanup takes the project down (containers, networks, volumes, images
// it built) and fails the test if anything with its label remains.
func (p *Project) cleanup(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if t.Failed() {
		if out, err := p.Compose(ctx, "logs", "--no-color", "--timestamps", "--tail", "150"); err == nil {
			t.Logf("--- logs of project %s ---\n%s", p.Name, out)
		}
	}
	if out, err := p.Compose(ctx, "down", "--volumes", "--remove-orphans", "--rmi", "local", "--timeout", "20"); err != nil {
		t.Errorf("taking project %s down: %v\n%s", p.Name, err, tail(out, 2000))
	}
	var left []string
	for _, kind := range [][]string{
		{"ps", "-a", "-q"}, {"network", "ls", "-q"}, {"volume", "ls", "-q"}, {"image", "ls", "-q"},
	} {
		out, err := p.e.Docker(ctx, append(kind, "--filter", "label="+projectLabel+"="+p.Name)...)
		if err != nil {
			t.Errorf("listing what project %s left: %v: %s", p.Name, err, out)
			continue
		}
		if ids := strings.Fields(out); len(ids) > 0 {
			left = append(left, fmt.Sprintf("%s: %v", kind[0], ids))
		}
	}
	if len(left) > 0 {
		t.Errorf("project %s left %s behind", p.Name, strings.Join(left, "; "))
	}
}

// tail returns the end of s, at most n bytes.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// IsNotFound reports whether err says a service has no container.
func IsNotFound(err error) bool { return errors.Is(err, errNotFound) }
