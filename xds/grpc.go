package xds

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// GRPCServerOptions returns the options the gRPC server hosting ADS should
// use. envoy/bootstrap.yaml makes Envoy ping every 2 s (less 15% jitter),
// so that it notices within about 4 s an xDS server whose host vanished
// and moves its ADS stream (an idle stream sends nothing else that could
// time out); gRPC-Go's default keepalive policy (pings at most every 5
// minutes) would answer with GOAWAY "too_many_pings" and force needless
// reconnects, so pings are admitted down to one a second.
func GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             time.Second,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:    30 * time.Second,
			Timeout: 10 * time.Second,
		}),
		// Snapshots of large fleets can exceed the 4 MiB default.
		grpc.MaxRecvMsgSize(64 << 20),
		grpc.MaxConcurrentStreams(1 << 16),
	}
}
