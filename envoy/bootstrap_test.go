package envoy

import (
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/certgen"
	"github.com/switchyard/switchyard/internal/testutil"
)

func TestBootstrapRendersParams(t *testing.T) {
	out, err := Bootstrap(Params{NodeID: "edge-7", XDSHost: "10.0.0.9", XDSPort: 18123, AdminPort: 19001})
	if err != nil {
		t.Fatal(err)
	}
	if missing := testutil.ContainsAll(out,
		"id: edge-7 # @node_id",
		"address: 10.0.0.9 # @xds_host",
		"port_value: 18123 # @xds_port",
		"port_value: 19001 # @admin_port",
		"address: 127.0.0.1 # @admin_host", // untouched default
	); len(missing) > 0 {
		t.Fatalf("rendered bootstrap lacks %q:\n%s", missing, out)
	}
	if strings.Contains(out, "port_value: 18000") {
		t.Fatalf("default xDS port survived rendering:\n%s", out)
	}
}

// Several xDS servers (replicas) become one health-checked endpoint each.
func TestBootstrapListsSeveralXDSServers(t *testing.T) {
	out, err := Bootstrap(Params{XDSServers: []string{"10.0.0.5:18000", "10.0.0.6:18001", "[2001:db8::7]:18002"}})
	if err != nil {
		t.Fatal(err)
	}
	if missing := testutil.ContainsAll(out,
		"address: 10.0.0.5 # @xds_host", "port_value: 18000 # @xds_port",
		"address: 10.0.0.6 # @xds_host", "port_value: 18001 # @xds_port",
		"address: 2001:db8::7 # @xds_host", "port_value: 18002 # @xds_port",
		"service_name: envoy.service.discovery.v3.AggregatedDiscoveryService",
	); len(missing) > 0 {
		t.Fatalf("rendered bootstrap lacks %q:\n%s", missing, out)
	}
	if n := strings.Count(out, "- endpoint:"); n != 3 {
		t.Fatalf("%d endpoints, want 3:\n%s", n, out)
	}
	if _, err := Bootstrap(Params{XDSServers: []string{"10.0.0.5"}}); err == nil {
		t.Fatal("a server without a port was accepted")
	}
	if _, err := Bootstrap(Params{XDSServers: []string{"10.0.0.5:18000"}, XDSPort: 18000}); err == nil {
		t.Fatal("XDSServers and XDSPort together were accepted")
	}
}

func TestBootstrapRejectsBadPort(t *testing.T) {
	if _, err := Bootstrap(Params{XDSPort: 70000}); err == nil {
		t.Fatal("port 70000 accepted")
	}
}

func TestBootstrapQuotesOddValues(t *testing.T) {
	out, err := Bootstrap(Params{NodeID: "a b#c"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `id: "a b#c" # @node_id`) {
		t.Fatalf("node id not quoted:\n%s", out)
	}
}

// TestBootstrapValidatesInEnvoy checks both the shipped file and a rendered
// one with Envoy's own config validation.
func TestBootstrapValidatesInEnvoy(t *testing.T) {
	envoy := testutil.EnvoyPath(t)
	dir := t.TempDir()
	rendered, err := Bootstrap(Params{NodeID: "validate", XDSPort: 18999, AdminPort: 19999})
	if err != nil {
		t.Fatal(err)
	}
	replicas, err := Bootstrap(Params{NodeID: "validate", XDSServers: []string{"10.0.0.5:18000", "10.0.0.6:18000"}, AdminPort: 19998})
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"shipped.yaml": Template(), "rendered.yaml": rendered, "replicas.yaml": replicas} {
		path := testutil.WriteFile(t, dir, name, content)
		cmd := exec.Command(envoy, "--mode", "validate", "-c", path, "-l", "warning", "--use-dynamic-base-id")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("envoy --mode validate %s: %v\n%s", filepath.Base(path), err, b)
		}
	}
}

var update = flag.Bool("update", false, "rewrite bootstrap-mtls.yaml from bootstrap.yaml and tls_socket.yaml")

// TestShippedMTLSBootstrapIsCurrent keeps bootstrap-mtls.yaml equal to
// what Bootstrap renders for DefaultTLSDir, so the two shipped files
// cannot drift apart.
func TestShippedMTLSBootstrapIsCurrent(t *testing.T) {
	want, err := Bootstrap(Params{TLSDir: DefaultTLSDir})
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.WriteFile("bootstrap-mtls.yaml", []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile("bootstrap-mtls.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatal("bootstrap-mtls.yaml is stale: go test ./envoy -run TestShippedMTLSBootstrapIsCurrent -update")
	}
	for _, s := range []string{"transport_socket:", "path: /etc/envoy/switchyard-tls/cert-sds.yaml # @tls_cert_sds", "name: switchyard-ca"} {
		if !strings.Contains(want, s) {
			t.Fatalf("mTLS bootstrap lacks %q", s)
		}
	}
}

// TestMTLSBootstrapValidatesInEnvoy renders the mTLS bootstrap for a
// directory written by Layout.Write and has Envoy validate it.
func TestMTLSBootstrapValidatesInEnvoy(t *testing.T) {
	envoy := testutil.EnvoyPath(t)
	ca, err := certgen.NewCA("ca", certgen.Validity{})
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Issue(certgen.LeafOptions{CommonName: "envoy", Client: true})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	l := TLSLayout(filepath.Join(dir, "tls"))
	if err := l.Write(leaf.CertPEM, leaf.KeyPEM, ca.CertPEM, []string{"switchyard", "127.0.0.1", "spiffe://dc1/svc/switchyard"}); err != nil {
		t.Fatal(err)
	}
	_, caSDS := l.SDSFiles([]string{"switchyard", "127.0.0.1", "spiffe://dc1/svc/switchyard"})
	for _, s := range []string{"san_type: DNS", "san_type: IP_ADDRESS", "san_type: URI"} {
		if !strings.Contains(caSDS, s) {
			t.Fatalf("ca-sds.yaml lacks %q:\n%s", s, caSDS)
		}
	}
	rendered, err := Bootstrap(Params{NodeID: "validate", TLSDir: l.Dir, XDSSNI: "sy.internal", AdminPort: testutil.FreePort(t)})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rendered, "sni: sy.internal # @xds_sni") || !strings.Contains(rendered, l.CASDS) {
		t.Fatalf("TLS parameters not rendered:\n%s", rendered)
	}
	path := testutil.WriteFile(t, dir, "envoy.yaml", rendered)
	cmd := exec.Command(envoy, "--mode", "validate", "-c", path, "-l", "warning", "--use-dynamic-base-id")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("envoy --mode validate: %v\n%s", err, b)
	}
}

func TestBootstrapADSAPIType(t *testing.T) {
	out, err := Bootstrap(Params{ADSAPIType: APITypeDelta})
	if err != nil {
		t.Fatal(err)
	}
	if missing := testutil.ContainsAll(out, "api_type: DELTA_GRPC # @ads_api_type"); len(missing) > 0 {
		t.Fatalf("rendered bootstrap lacks %q:\n%s", missing, out)
	}
	if _, err := Bootstrap(Params{ADSAPIType: "REST"}); err == nil {
		t.Fatal("an unknown ADS API type was accepted")
	}
}
