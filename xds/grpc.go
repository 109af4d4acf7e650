package xds

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// GRPCServerOptions returns the options the gRPC server hosting ADS should
// use. envoy/bootstrap.yaml makes Envoy ping every 30 s; gRPC-Go's default
// keepalive policy (pings at most every 5 minutes) would answer an idle ADS
// connection with GOAWAY "too_many_pings" and force needless reconnects.
func GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             10 * time.Second,
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
