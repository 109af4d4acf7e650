package registry

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// ErrBadAddress is wrapped by every address validation error.
var ErrBadAddress = errors.New("bad address")

// CanonicalAddress checks that s is a literal "ip:port" ("[v6]:port" for
// IPv6) and returns its canonical spelling: IPv4-mapped IPv6 addresses become
// IPv4, IPv6 is compressed and lower-cased. Hostnames, zones, port 0 and
// ports above 65535 are rejected. When endpoint is true the unspecified
// addresses (0.0.0.0, ::) are rejected too, since nothing can be dialled
// there; listeners may bind them.
func CanonicalAddress(s string, endpoint bool) (string, error) {
	host, portStr, err := net.SplitHostPort(s)
	if err != nil {
		return "", fmt.Errorf("%w %q: want ip:port or [ipv6]:port", ErrBadAddress, s)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		if host == "" {
			return "", fmt.Errorf("%w %q: missing IP address", ErrBadAddress, s)
		}
		return "", fmt.Errorf("%w %q: %q is not an IP address (hostnames are not supported; use an IP literal)", ErrBadAddress, s, host)
	}
	if ip.Zone() != "" {
		return "", fmt.Errorf("%w %q: IPv6 zones are not supported", ErrBadAddress, s)
	}
	if ip.Is6() && !strings.HasPrefix(s, "[") {
		return "", fmt.Errorf("%w %q: IPv6 addresses must be written [ip]:port", ErrBadAddress, s)
	}
	port, err := strconv.ParseUint(portStr, 10, 32)
	if err != nil || port == 0 || port > 65535 {
		return "", fmt.Errorf("%w %q: port %q is not in 1-65535", ErrBadAddress, s, portStr)
	}
	ip = ip.Unmap()
	if endpoint && ip.IsUnspecified() {
		return "", fmt.Errorf("%w %q: %s is the unspecified address; endpoints need a reachable IP", ErrBadAddress, s, ip)
	}
	return netip.AddrPortFrom(ip, uint16(port)).String(), nil
}
