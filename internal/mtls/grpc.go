package mtls

import (
	"context"
	"net"

	"google.golang.org/grpc/credentials"
)

// GRPCCredentials returns server transport credentials for the gRPC server
// named server ("xds", "extproc"; the label of its rejections): TLS 1.2+,
// ALPN h2, a client certificate required and checked by VerifyClient. A
// failed handshake is passed to Rejected before gRPC closes the connection.
func (s *Server) GRPCCredentials(server string) credentials.TransportCredentials {
	return &observed{TransportCredentials: credentials.NewTLS(s.Config(true, "h2")), s: s, server: server}
}

// observed wraps gRPC's TLS credentials to see failed server handshakes,
// which gRPC itself only reports to its own logger.
type observed struct {
	credentials.TransportCredentials
	s      *Server
	server string
}

func (o *observed) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, info, err := o.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		o.s.Rejected(o.server, conn.RemoteAddr(), err)
	}
	return c, info, err
}

func (o *observed) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return o.TransportCredentials.ClientHandshake(ctx, authority, conn)
}

func (o *observed) Clone() credentials.TransportCredentials {
	return &observed{TransportCredentials: o.TransportCredentials.Clone(), s: o.s, server: o.server}
}
