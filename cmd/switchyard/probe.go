package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/switchyard/switchyard/internal/probe"
)

// probeCmd asks an HTTP health endpoint (serve's /readyz or /healthz) and
// exits 0 on a 2xx answer, 1 otherwise: the container health check of an
// image that has no shell or HTTP client.
func probeCmd(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	timeout := fs.Duration("timeout", probe.DefaultTimeout, "give up after this long")
	insecure := fs.Bool("insecure", false, "do not verify an https URL's certificate (a loopback probe of -admin-tls)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: switchyard probe [-timeout D] [-insecure] URL\n\nExits 0 when GET URL answers 2xx, 1 otherwise (e.g. http://127.0.0.1:9090/readyz).")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return 2
	}
	if err := probe.Check(ctx, fs.Arg(0), probe.Options{Timeout: *timeout, Insecure: *insecure}); err != nil {
		fmt.Fprintln(stderr, "switchyard:", err)
		return 1
	}
	return 0
}
