package cli

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/probe"
)

func TestExitCode(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{nil, 0},
		{flag.ErrHelp, 0},
		{probe.Failed{Err: errors.New("503")}, 1},
		{fmt.Errorf("run: %w", probe.Failed{Err: errors.New("refused")}), 1},
		{errors.New("-port: bad"), 2},
	} {
		if got := ExitCode(c.err); got != c.want {
			t.Errorf("ExitCode(%v) = %d, want %d", c.err, got, c.want)
		}
	}
}

func TestLogger(t *testing.T) {
	var b bytes.Buffer
	log, err := Logger(&b, "warn")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown")
	if out := b.String(); strings.Contains(out, "hidden") || !strings.Contains(out, "shown") {
		t.Fatalf("warn logger wrote %q", out)
	}
	if _, err := Logger(&b, "loud"); err == nil || !strings.Contains(err.Error(), "-log-level") {
		t.Fatalf("Logger(loud) error %v, want one naming -log-level", err)
	}
}
