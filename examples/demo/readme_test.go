package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// A command of the README's walkthrough and the output it shows.
type walkStep struct {
	line int      // README line of the command
	cmd  string   // the command, continuation lines joined
	want []string // the lines shown after it; "…" stands for any text
}

// walkthrough reads the README's console blocks: "$ " starts a command
// (a trailing backslash continues it on the next line), and the lines
// after it are its output as the README shows it.
func walkthrough(t *testing.T, readme string) []walkStep {
	t.Helper()
	var steps []walkStep
	for _, b := range testutil.MarkdownCodeBlocks(t, readme) {
		if b.Lang != "console" {
			continue
		}
		cont := false
		for i, line := range strings.Split(strings.TrimSuffix(b.Text, "\n"), "\n") {
			switch {
			case cont:
				s := &steps[len(steps)-1]
				s.cmd += " " + strings.TrimSpace(strings.TrimSuffix(line, "\\"))
			case strings.HasPrefix(line, "$ "):
				steps = append(steps, walkStep{line: b.Line + i, cmd: strings.TrimSuffix(line[2:], "\\")})
			default:
				if len(steps) == 0 {
					t.Fatalf("README.md:%d: output before any command", b.Line+i)
				}
				s := &steps[len(steps)-1]
				s.want = append(s.want, line)
			}
			cont = strings.HasSuffix(line, "\\")
		}
	}
	return steps
}

// outputPattern turns a line of shown output into a regular expression
// for one whole line of the real output: "…" matches any text.
func outputPattern(line string) *regexp.Regexp {
	parts := strings.Split(line, "…")
	for i, p := range parts {
		parts[i] = regexp.QuoteMeta(p)
	}
	return regexp.MustCompile(`(?m)^` + strings.Join(parts, ".*") + `$`)
}

// The README's walkthrough works as written: every command of its console
// blocks, run in order against a running demo (`make run` is the demo
// itself), prints what the README shows. The demo's ports are shifted to
// free ones, in the commands and in the output alike.
func TestReadmeWalkthrough(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, switchyard and three simulators")
	}
	root := testutil.RepoRoot(t)
	steps := walkthrough(t, filepath.Join(root, "README.md"))
	if len(steps) < 6 || steps[0].cmd != "make run" {
		t.Fatalf("README.md's walkthrough should start with `make run` and have several commands; found %+v", steps)
	}
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatalf("the walkthrough's commands need curl: %v", err)
	}

	off := freeOffset(t)
	ports := map[string]string{}
	for _, p := range demoPorts(1) {
		ports[strconv.Itoa(p)] = strconv.Itoa(p + off)
	}
	portRE := regexp.MustCompile(`\b\d{4,5}\b`)
	shift := func(s string) string {
		return portRE.ReplaceAllStringFunc(s, func(p string) string {
			if q, ok := ports[p]; ok {
				return q
			}
			return p
		})
	}
	switchyard := testutil.Binary(t, "switchyard")

	demo := testutil.Start(t, "demo", demoBinary(t), demoArgs(t, off)...)
	testutil.Eventually(t, 60*time.Second, "demo up", func() error {
		if demo.Exited() {
			t.Fatalf("demo exited early:\n%s", demo.Output())
		}
		if !strings.Contains(demo.Output(), "Press Ctrl-C") {
			return fmt.Errorf("not up yet")
		}
		return nil
	})

	for _, s := range steps {
		where := fmt.Sprintf("README.md:%d: %s", s.line, s.cmd)
		if s.cmd == "make run" {
			if missing := unmatched(s.want, demo.Output(), shift); len(missing) > 0 {
				t.Errorf("%s\nprints no line like %q; it printed:\n%s", where, missing, demo.Output())
			}
			continue
		}
		cmd := shift(s.cmd)
		if rest, ok := strings.CutPrefix(cmd, "bin/switchyard "); ok {
			cmd = switchyard + " " + rest
		}
		// A reader takes seconds between commands; the test does not.
		// What a read shows may lag the request before it (a decision
		// record is kept when the request's stream ends, just after the
		// client has its answer), so reads are repeated for a while;
		// requests that send a body run once.
		within := time.Duration(0)
		if !strings.Contains(cmd, " -d ") {
			within = 10 * time.Second
		}
		err := testutil.Poll(context.Background(), within, func() error {
			out, err := runShell(root, cmd)
			if err != nil {
				return fmt.Errorf("%v; it printed:\n%s", err, out)
			}
			if missing := unmatched(s.want, out, shift); len(missing) > 0 {
				return fmt.Errorf("prints no line like %q; it printed:\n%s", missing, out)
			}
			return nil
		})
		if err != nil {
			t.Errorf("%s\n(run as %s): %v", where, cmd, err)
		}
	}
}

// runShell runs a walkthrough command with sh in dir and returns its
// output, carriage returns removed.
func runShell(dir, cmd string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := exec.CommandContext(ctx, "sh", "-c", cmd)
	c.Dir = dir
	c.Env = append(c.Environ(), "NO_PROXY=127.0.0.1", "no_proxy=127.0.0.1")
	b, err := c.CombinedOutput()
	return strings.ReplaceAll(string(b), "\r", ""), err
}

// unmatched returns the lines of shown output (ports shifted) that no
// line of out matches.
func unmatched(want []string, out string, shift func(string) string) []string {
	var missing []string
	for _, w := range want {
		if strings.TrimSpace(w) == "…" {
			continue
		}
		if !outputPattern(shift(w)).MatchString(out) {
			missing = append(missing, shift(w))
		}
	}
	return missing
}
