// Package cli owns the command-line plumbing that switchyard's helper
// binaries (vllm-sim, pd-sidecar) share: how a run's error becomes the
// process's exit status, and the logger their -log-level flag selects.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/switchyard/switchyard/internal/probe"
)

// Main runs run on the program's arguments and ends the process with
// ExitCode of its error, printed after name on stderr.
func Main(name string, run func(args []string) error) {
	err := run(os.Args[1:])
	if code := ExitCode(err); code != 0 {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(code)
	}
}

// ExitCode is the exit status for a run's error: 0 for none or for
// flag.ErrHelp (-h asked for the usage, which was printed), 1 for a
// -probe that got no 2xx answer (probe.Failed), 2 for anything else (a
// bad command line, a failure to serve).
func ExitCode(err error) int {
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, new(probe.Failed)):
		return 1
	default:
		return 2
	}
}

// Logger returns a text logger to w at level, a -log-level value (debug,
// info, warn or error).
func Logger(w io.Writer, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("-log-level: %w", err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}
