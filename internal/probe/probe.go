// Package probe is the HTTP health probe the container images run on
// themselves (`switchyard probe URL`, `vllm-sim -probe URL`): the images
// have no shell and no HTTP client, so a container engine's health check
// runs the program's own binary, which asks the program's health endpoint.
package probe

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
)

// DefaultTimeout bounds one probe when the caller sets none.
const DefaultTimeout = 2 * time.Second

// Options configure Check.
type Options struct {
	// Timeout bounds the whole request (DefaultTimeout when zero).
	Timeout time.Duration
	// Insecure skips the verification of an https URL's certificate (a
	// server probed on loopback presents a certificate that names its
	// host, not 127.0.0.1).
	Insecure bool
}

// Check sends GET target and returns nil when the answer is 2xx; otherwise
// an error that says what came back.
func Check(ctx context.Context, target string, o Options) error {
	u, err := url.Parse(target)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("probe: %q is not an http(s) URL", target)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	tr := &http.Transport{Proxy: nil, DisableKeepAlives: true}
	if o.Insecure {
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // opted in: loopback probe of a named certificate
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return fmt.Errorf("probe %s: %w", target, err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return fmt.Errorf("probe %s: %w", target, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("probe %s: %s %q", target, resp.Status, body)
	}
	return nil
}

// Failed is a probe that got no 2xx answer. A binary's -probe flag exits
// with status 1 for it, where a command-line error exits with 2.
type Failed struct{ Err error }

func (f Failed) Error() string { return f.Err.Error() }
func (f Failed) Unwrap() error { return f.Err }

// Flag is a binary's -probe flag: Check of target with the default options,
// its failure wrapped as Failed.
func Flag(ctx context.Context, target string) error {
	if err := Check(ctx, target, Options{}); err != nil {
		return Failed{err}
	}
	return nil
}
