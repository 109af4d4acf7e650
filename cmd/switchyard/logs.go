package main

import (
	"log"
	"log/slog"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"
	"google.golang.org/grpc/grpclog"

	"github.com/switchyard/switchyard/internal/proclog"
)

// processLogEvery is the most often one kind of library line (the same
// OpenTelemetry export failure, say) is logged; the lines held back in
// between are counted on the next one.
const processLogEvery = time.Minute

// routeProcessLogs sends what libraries log on their own (Go's standard
// logger, OpenTelemetry's error handler and internal logger, gRPC's
// logger) into logger's handler, rate-limited per kind, so that stderr
// holds only serve's format (-log-format json: JSON lines only). It
// returns a function that logs the lines still held back, for exit.
//
// These are process-wide settings because the libraries offer nothing
// else: the OpenTelemetry SDK reports export failures only through
// otel.Handle, gRPC logs only through grpclog's logger, and other code
// prints through the standard logger. So serve sets them exactly once,
// here, before any component starts, and only when it logs to the
// process's own standard error (the binary): an in-process caller with
// its own writer, such as a test, leaves the process's loggers alone.
func routeProcessLogs(logger *slog.Logger) (flush func()) {
	// One limiter per library: a kind is counted within its source.
	var limiters []*proclog.Limiter
	limited := func(component string) slog.Handler {
		l := proclog.NewLimiter(logger.Handler().WithAttrs([]slog.Attr{slog.String("component", component)}), processLogEvery)
		limiters = append(limiters, l)
		return l
	}
	log.SetFlags(0) // the handler stamps the time
	log.SetPrefix("")
	log.SetOutput(slog.NewLogLogger(limited("stdlog"), slog.LevelWarn).Writer())
	otelHandler := limited("opentelemetry")
	otelLog := slog.New(otelHandler)
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { otelLog.Error("OpenTelemetry error", "err", err) }))
	otel.SetLogger(logr.FromSlogHandler(otelHandler))
	grpclog.SetLoggerV2(proclog.GRPCLogger(limited("grpc")))
	return func() {
		for _, l := range limiters {
			l.Flush()
		}
	}
}
