// Package envoy owns what an Envoy host needs to use switchyard: the
// bootstrap configuration that points a plain Envoy at switchyard's ADS
// server, and, for mutual TLS, the layout of its certificate directory and
// the file-based SDS resources in it (tls.go). The YAML files are runnable
// as they are; Bootstrap renders them with other addresses for tests, the
// demo and cmd/switchyard.
package envoy

import (
	_ "embed"
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
)

//go:embed bootstrap.yaml
var bootstrapYAML string

// tlsSocketYAML is the ADS cluster's mutual-TLS transport socket, put in
// place of the @xds_transport_socket line when Params.TLSDir is set.
//
//go:embed tls_socket.yaml
var tlsSocketYAML string

const socketMarker = "# @xds_transport_socket"

// Template returns the bootstrap file exactly as shipped.
func Template() string { return bootstrapYAML }

// Params are the values Bootstrap fills in. Zero values keep the file's
// defaults.
type Params struct {
	NodeID      string // default "envoy-1"
	NodeCluster string // default "switchyard"
	XDSHost     string // IP or DNS name of switchyard's xDS server (default 127.0.0.1)
	XDSPort     int    // default 18000
	// XDSServers, when set, lists several xDS servers ("host:port", one
	// per switchyard replica) instead of XDSHost and XDSPort.
	XDSServers []string
	AdminHost  string // default 127.0.0.1
	AdminPort  int    // default 9901
	// TLSDir, when set, connects to switchyard with mutual TLS using the
	// certificate directory at this path on the Envoy host (see TLSLayout;
	// DefaultTLSDir is what bootstrap-mtls.yaml uses).
	TLSDir string
	// XDSSNI is the server name sent to switchyard with TLS (default
	// "switchyard").
	XDSSNI string
	// ADSAPIType is the ADS protocol variant: APITypeSotW or APITypeDelta
	// (default: the file's).
	ADSAPIType string
}

// The ADS protocol variants (ads_config.api_type).
const (
	// APITypeSotW is state-of-the-world xDS: each response carries every
	// resource of its type.
	APITypeSotW = "GRPC"
	// APITypeDelta is incremental xDS: responses carry only the resources
	// that changed, and the names of those removed.
	APITypeDelta = "DELTA_GRPC"
)

var marker = regexp.MustCompile(`^(\s*[a-z_]+:\s*)(\S+)(\s*# @([a-z_]+))\s*$`)

// Bootstrap renders the bootstrap with p applied. Every parameter the file
// marks must exist, so a renamed marker fails loudly instead of silently
// keeping a default.
func Bootstrap(p Params) (string, error) {
	values := map[string]string{}
	set := func(key, v string) {
		if v != "" {
			values[key] = v
		}
	}
	port := func(n int) string {
		if n == 0 {
			return ""
		}
		return strconv.Itoa(n)
	}
	set("node_id", p.NodeID)
	set("node_cluster", p.NodeCluster)
	set("xds_host", p.XDSHost)
	set("xds_port", port(p.XDSPort))
	set("admin_host", p.AdminHost)
	set("admin_port", port(p.AdminPort))
	set("xds_sni", p.XDSSNI)
	switch p.ADSAPIType {
	case "", APITypeSotW, APITypeDelta:
		set("ads_api_type", p.ADSAPIType)
	default:
		return "", fmt.Errorf("envoy bootstrap: ADS API type %q is neither %s nor %s", p.ADSAPIType, APITypeSotW, APITypeDelta)
	}
	tmpl := bootstrapYAML
	if p.TLSDir != "" {
		l := TLSLayout(p.TLSDir)
		set("tls_dir", l.Dir)
		set("tls_cert_sds", l.CertSDS)
		set("tls_ca_sds", l.CASDS)
		i := strings.Index(tmpl, socketMarker)
		if i < 0 {
			return "", fmt.Errorf("envoy bootstrap: no %q line in bootstrap.yaml", socketMarker)
		}
		start := strings.LastIndex(tmpl[:i], "\n") + 1
		end := i + strings.Index(tmpl[i:], "\n") + 1
		tmpl = tmpl[:start] + tlsSocketYAML + tmpl[end:]
	}
	for _, n := range []int{p.XDSPort, p.AdminPort} {
		if n < 0 || n > 65535 {
			return "", fmt.Errorf("envoy bootstrap: port %d out of range", n)
		}
	}

	if len(p.XDSServers) > 0 {
		if p.XDSHost != "" || p.XDSPort != 0 {
			return "", fmt.Errorf("envoy bootstrap: set XDSServers or XDSHost/XDSPort, not both")
		}
		var err error
		if tmpl, err = withServers(tmpl, p.XDSServers); err != nil {
			return "", err
		}
	}
	seen := map[string]bool{}
	lines := strings.Split(tmpl, "\n")
	for i, line := range lines {
		m := marker.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		seen[m[4]] = true
		if v, ok := values[m[4]]; ok {
			lines[i] = m[1] + quote(v) + m[3]
		}
	}
	for k := range values {
		if !seen[k] {
			return "", fmt.Errorf("envoy bootstrap: no %q parameter in bootstrap.yaml", k)
		}
	}
	return strings.Join(lines, "\n"), nil
}

// quote returns v as a YAML scalar, quoting anything that is not a plain
// name, address or number.
func quote(v string) string {
	if regexp.MustCompile(`^[A-Za-z0-9._:/-]+$`).MatchString(v) && !strings.HasPrefix(v, ":") {
		return v
	}
	return strconv.Quote(v)
}

// withServers replaces the ADS cluster's one endpoint (the lines from
// "- endpoint:" through the @xds_port line) with one per server.
func withServers(tmpl string, servers []string) (string, error) {
	lines := strings.Split(tmpl, "\n")
	start, end := -1, -1
	for i, l := range lines {
		if strings.Contains(l, "# @xds_host") {
			for j := i; j >= 0; j-- {
				if strings.TrimSpace(lines[j]) == "- endpoint:" {
					start = j
					break
				}
			}
		}
		if strings.Contains(l, "# @xds_port") {
			end = i
		}
	}
	if start < 0 || end < start {
		return "", fmt.Errorf("envoy bootstrap: no xDS endpoint block in bootstrap.yaml")
	}
	block := lines[start : end+1]
	var out []string
	for _, srv := range servers {
		host, port, err := net.SplitHostPort(srv)
		if err != nil {
			return "", fmt.Errorf("envoy bootstrap: xDS server %q: %w", srv, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
			return "", fmt.Errorf("envoy bootstrap: xDS server %q: port out of range", srv)
		}
		for _, l := range block {
			if m := marker.FindStringSubmatch(l); m != nil {
				switch m[4] {
				case "xds_host":
					l = m[1] + quote(host) + m[3]
				case "xds_port":
					l = m[1] + port + m[3]
				}
			}
			out = append(out, l)
		}
	}
	return strings.Join(append(append(lines[:start:start], out...), lines[end+1:]...), "\n"), nil
}
