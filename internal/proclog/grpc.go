package proclog

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/grpclog"
)

// GRPCLogger returns a grpclog.LoggerV2 that writes through h. gRPC's
// default logger prints only its errors, as plain text on standard
// error; this one logs them at slog's error level, and its warnings and
// informational lines at debug level, so -log-level debug shows them.
// Verbose lines (V(1) and up) are dropped. Fatal logs, then exits the
// process with status 1, as gRPC requires of a logger.
func GRPCLogger(h slog.Handler) grpclog.LoggerV2 {
	return grpcLogger{h: h}
}

type grpcLogger struct{ h slog.Handler }

var _ grpclog.LoggerV2 = grpcLogger{}

func (g grpcLogger) log(level slog.Level, msg string) {
	ctx := context.Background()
	if !g.h.Enabled(ctx, level) {
		return
	}
	_ = g.h.Handle(ctx, slog.NewRecord(time.Now(), level, strings.TrimSuffix(msg, "\n"), 0))
}

func (g grpcLogger) Info(args ...any)   { g.log(slog.LevelDebug, fmt.Sprint(args...)) }
func (g grpcLogger) Infoln(args ...any) { g.log(slog.LevelDebug, fmt.Sprintln(args...)) }
func (g grpcLogger) Infof(format string, args ...any) {
	g.log(slog.LevelDebug, fmt.Sprintf(format, args...))
}

func (g grpcLogger) Warning(args ...any)   { g.log(slog.LevelDebug, fmt.Sprint(args...)) }
func (g grpcLogger) Warningln(args ...any) { g.log(slog.LevelDebug, fmt.Sprintln(args...)) }
func (g grpcLogger) Warningf(format string, args ...any) {
	g.log(slog.LevelDebug, fmt.Sprintf(format, args...))
}

func (g grpcLogger) Error(args ...any)   { g.log(slog.LevelError, fmt.Sprint(args...)) }
func (g grpcLogger) Errorln(args ...any) { g.log(slog.LevelError, fmt.Sprintln(args...)) }
func (g grpcLogger) Errorf(format string, args ...any) {
	g.log(slog.LevelError, fmt.Sprintf(format, args...))
}

func (g grpcLogger) Fatal(args ...any) {
	g.log(slog.LevelError, fmt.Sprint(args...))
	os.Exit(1)
}

func (g grpcLogger) Fatalln(args ...any) {
	g.log(slog.LevelError, fmt.Sprintln(args...))
	os.Exit(1)
}

func (g grpcLogger) Fatalf(format string, args ...any) {
	g.log(slog.LevelError, fmt.Sprintf(format, args...))
	os.Exit(1)
}

// V reports whether verbosity level l is logged: only the default, 0.
func (g grpcLogger) V(l int) bool { return l <= 0 }
