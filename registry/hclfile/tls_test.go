package hclfile

import (
	"reflect"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/sched"
)

const tlsListener = "listener \"l\" {\n  address = \"127.0.0.1:8080\"\n}\n"

func TestTLSBlock(t *testing.T) {
	t.Parallel()
	src := tlsListener + `
tls {
  cert_file        = "/etc/switchyard/tls/cert.pem"
  key_file         = "/etc/switchyard/tls/key.pem"
  client_ca_file   = "/etc/switchyard/tls/ca.pem"
  allowed_sans     = ["envoy.edge", "spiffe://example/envoy"]
  envoy_dir        = "/srv/envoy-tls"
  admin_token_file = "/etc/switchyard/admin.token"
  admin_tls        = true
}
`
	cfg, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if len(diags) > 0 {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	want := &TLS{CertFile: "/etc/switchyard/tls/cert.pem", KeyFile: "/etc/switchyard/tls/key.pem", ClientCAFile: "/etc/switchyard/tls/ca.pem",
		AllowedSANs: []string{"envoy.edge", "spiffe://example/envoy"}, EnvoyDir: "/srv/envoy-tls",
		AdminTokenFile: "/etc/switchyard/admin.token", AdminTLS: true}
	if !reflect.DeepEqual(cfg.TLS, want) {
		t.Fatalf("TLS = %+v, want %+v", cfg.TLS, want)
	}
}

func TestTLSBlockErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ desc, body, want string }{
		{"incomplete files", `cert_file = "c.pem"`, "c.hcl:5:1: error: Incomplete TLS files"},
		{"files and consul", "cert_file = \"c\"\nkey_file = \"k\"\nclient_ca_file = \"a\"\nconsul_service = \"sy\"", "Conflicting TLS sources"},
		{"sans without certificate", `allowed_sans = ["a"]`, "No TLS certificate"},
		{"unknown attribute", `cert = "c.pem"`, "Unsupported argument"},
		{"wrong type", `admin_tls = "yes"`, "Incorrect value type"},
	} {
		t.Run(c.desc, func(t *testing.T) {
			src := tlsListener + "\ntls {\n" + c.body + "\n}\n"
			_, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
			if !diags.HasErrors() || !strings.Contains(FormatDiagnostics(diags), c.want) {
				t.Fatalf("want %q, got:\n%s", c.want, FormatDiagnostics(diags))
			}
		})
	}
	_, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(tlsListener + "tls {}\n")}, {Name: "b.hcl", Src: []byte("tls {}\n")}}, sched.Rules)
	if !strings.Contains(FormatDiagnostics(diags), "Duplicate tls") {
		t.Fatalf("two tls blocks accepted:\n%s", FormatDiagnostics(diags))
	}
}
