package mtls

import (
	"fmt"
	"net"
	"strings"
)

// Loopback reports whether the listen address addr ("host:port") binds
// loopback interfaces only. An empty or unspecified host (":9002",
// "0.0.0.0:9002", "[::]:9002") binds every interface and is not loopback.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// CheckPlaintext decides whether a server named name may listen on addr
// without TLS. Loopback is always allowed; any other address only with
// allow, and then warning is a message to log.
func CheckPlaintext(name, addr string, allow bool) (warning string, err error) {
	if Loopback(addr) {
		return "", nil
	}
	if !allow {
		return "", fmt.Errorf("%s listens on %s, not a loopback address, without TLS: anyone who can reach it could use it; configure TLS (-tls-cert, -tls-key, -tls-client-ca, or -tls-consul-service) or, knowing the risk, pass -allow-plaintext", name, addr)
	}
	return fmt.Sprintf("%s listens on %s in plaintext (-allow-plaintext): any host that reaches it can connect", name, addr), nil
}
