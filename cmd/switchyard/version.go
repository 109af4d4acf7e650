package main

import (
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version overrides the version read from the build info; release builds
// set it with -ldflags "-X main.version=v1.2.3".
var version = ""

// versionString returns the ldflags version, else the module version from
// the build info, else "devel" plus the VCS revision when known.
func versionString() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	v := "devel"
	var rev, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "-dirty"
			}
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		v += "+" + rev + dirty
	}
	return v
}

func versionCmd(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: switchyard version\n\nPrints the switchyard version and the Go version it was built with.")
	}
	if code, done := parseFlags(fs, args); done {
		return code
	}
	fmt.Fprintf(stdout, "switchyard %s (%s %s/%s)\n", versionString(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return 0
}

// parseFlags parses args into fs. done is true when the command must stop
// with code: 0 after -h, 2 after a bad flag or stray arguments.
func parseFlags(fs *flag.FlagSet, args []string) (code int, done bool) {
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0, true
		}
		return 2, true
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected arguments: %q\n", fs.Name(), fs.Args())
		fs.Usage()
		return 2, true
	}
	return 0, false
}
