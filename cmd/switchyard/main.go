// Command switchyard is the xDS control plane and endpoint picker for plain
// Envoy fleets serving LLMs.
//
//	switchyard serve    -config PATH [flags]   run the control plane
//	switchyard validate -config PATH           check configuration files
//	switchyard version                         print the version
//	switchyard key new | hash                  create a tenant API key, hash one
//	switchyard probe URL                       health-check an HTTP endpoint
//
// main only parses the command line and wires packages together; every
// behaviour lives in the packages it calls.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first signal, restore the default behaviour so that a
		// second Ctrl-C kills a shutdown that hangs.
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const usage = `switchyard: xDS control plane and endpoint picker for Envoy fleets serving LLMs.

Usage:
  switchyard serve    -config PATH [flags]   run the control plane and picker
  switchyard validate -config PATH           check configuration files and exit
  switchyard version                         print the version and exit
  switchyard key new | hash                  create a tenant API key and its hash
  switchyard probe URL                       exit 0 if GET URL answers 2xx (container health checks)

Run "switchyard COMMAND -h" for the flags of a command.

Exit status: 0 on success, 1 on failure (a bad configuration, a store or
address serve cannot use), 2 for a command-line error.
`

// run executes one command and returns the process exit code: 0 on
// success, 1 on failure, 2 on a usage error.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "serve":
		return serveCmd(ctx, args[1:], stdout, stderr)
	case "validate":
		return validateCmd(args[1:], stdout, stderr)
	case "version":
		return versionCmd(args[1:], stdout, stderr)
	case "key":
		return keyCmd(args[1:], os.Stdin, stdout, stderr)
	case "probe":
		return probeCmd(ctx, args[1:], stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "switchyard: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}
