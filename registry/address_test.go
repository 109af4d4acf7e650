package registry

import (
	"errors"
	"strings"
	"testing"
)

func TestCanonicalAddress(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc     string
		in       string
		endpoint bool
		want     string
		err      string
	}{
		{desc: "ipv4", in: "127.0.0.1:8001", endpoint: true, want: "127.0.0.1:8001"},
		{desc: "ipv6 compressed", in: "[0:0:0:0:0:0:0:1]:8002", endpoint: true, want: "[::1]:8002"},
		{desc: "ipv6 upper case", in: "[FD00::A]:80", endpoint: true, want: "[fd00::a]:80"},
		{desc: "v4-mapped becomes v4", in: "[::ffff:10.0.0.1]:80", endpoint: true, want: "10.0.0.1:80"},
		{desc: "leading zero port", in: "10.0.0.1:080", endpoint: true, want: "10.0.0.1:80"},
		{desc: "listener may bind any", in: "0.0.0.0:8080", want: "0.0.0.0:8080"},
		{desc: "endpoint may not be any", in: "0.0.0.0:8080", endpoint: true, err: "unspecified address"},
		{desc: "endpoint may not be v6 any", in: "[::]:8080", endpoint: true, err: "unspecified address"},
		{desc: "hostname", in: "localhost:8080", err: `"localhost" is not an IP address`},
		{desc: "no port", in: "10.0.0.1", err: "want ip:port"},
		{desc: "port zero", in: "10.0.0.1:0", err: `port "0" is not in 1-65535`},
		{desc: "port too big", in: "10.0.0.1:65536", err: `port "65536" is not in 1-65535`},
		{desc: "port not a number", in: "10.0.0.1:http", err: `port "http" is not in 1-65535`},
		{desc: "bare ipv6", in: "::1:80", err: "want ip:port"},
		{desc: "zone", in: "[fe80::1%eth0]:80", err: "zones are not supported"},
		{desc: "empty host", in: ":80", err: "missing IP address"},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			got, err := CanonicalAddress(tc.in, tc.endpoint)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !errors.Is(err, ErrBadAddress) {
					t.Fatalf("CanonicalAddress(%q) = %q, %v; want error containing %q", tc.in, got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("CanonicalAddress(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
			}
		})
	}
}
