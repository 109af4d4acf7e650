package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"
)

// stopGrace bounds how long a server drains open streams on shutdown: an
// ext_proc stream lives as long as its HTTP request, and a long LLM stream
// must not hold the process hostage.
const stopGrace = 10 * time.Second

// grpcComponent serves srv on addr until ctx ends, then stops gracefully
// (forcefully after grace). The listener is opened when the component
// starts, so a busy port stops serve at once with a clear error.
func grpcComponent(addr string, srv *grpc.Server, grace time.Duration) func(context.Context) error {
	return func(ctx context.Context) error {
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", addr, err)
		}
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(lis) }()
		select {
		case err := <-errc:
			return fmt.Errorf("serve %s: %w", addr, err)
		case <-ctx.Done():
		}
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(grace):
			srv.Stop()
		}
		return nil
	}
}

// httpComponent serves h on addr until ctx ends, then shuts down gracefully.
func httpComponent(addr string, h http.Handler) func(context.Context) error {
	return httpsComponent(addr, h, nil, nil)
}

// httpsComponent is httpComponent over TLS when tlsCfg is set; failed
// handshakes are logged through logger.
func httpsComponent(addr string, h http.Handler, tlsCfg *tls.Config, logger *slog.Logger) func(context.Context) error {
	return func(ctx context.Context) error {
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", addr, err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		if tlsCfg != nil {
			lis = tls.NewListener(lis, tlsCfg)
			srv.ErrorLog = slog.NewLogLogger(logger.With("component", "admin").Handler(), slog.LevelWarn)
		}
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(lis) }()
		select {
		case err := <-errc:
			return fmt.Errorf("serve %s: %w", addr, err)
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.Background(), stopGrace)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("shutdown %s: %w", addr, err)
		}
		return nil
	}
}
