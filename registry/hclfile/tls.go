package hclfile

import (
	"fmt"
	"strings"

	"github.com/hashicorp/hcl/v2"
)

// TLS is the top-level tls block: transport security of switchyard's own
// servers (mutual TLS for ADS and ext_proc, the admin server's
// credentials). Like the consul block it is read once, at start, and is
// not part of the registry state; the certificate files it names are
// re-read while running. serve's -tls-* flags override its fields.
type TLS struct {
	CertFile, KeyFile, ClientCAFile string
	AllowedSANs                     []string
	ConsulService                   string // Consul Connect instead of files
	EnvoyDir                        string // certificate directory on Envoy hosts
	AllowPlaintext                  bool
	AdminTokenFile                  string
	AdminTLS                        bool
}

var tlsSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "cert_file"},
		{Name: "key_file"},
		{Name: "client_ca_file"},
		{Name: "allowed_sans"},
		{Name: "consul_service"},
		{Name: "envoy_dir"},
		{Name: "allow_plaintext"},
		{Name: "admin_token_file"},
		{Name: "admin_tls"},
	},
}

func (d *decoder) tlsBlock(b *hcl.Block) {
	const kind = "tls"
	if !d.declare(kind, "", b) {
		return
	}
	obj := loc{kind: kind}
	t := &TLS{}
	d.tls = t
	content, diags := b.Body.Content(tlsSchema)
	d.diags = append(d.diags, diags...)
	attrs := content.Attributes
	for name, dst := range map[string]*string{
		"cert_file": &t.CertFile, "key_file": &t.KeyFile, "client_ca_file": &t.ClientCAFile,
		"consul_service": &t.ConsulService, "envoy_dir": &t.EnvoyDir, "admin_token_file": &t.AdminTokenFile,
	} {
		a, ok := attrs[name]
		if !ok {
			continue
		}
		if v, ok := d.str(obj.with(name), a.Expr); ok {
			if strings.TrimSpace(v) == "" {
				d.errorAt(obj.with(name), a.Expr.Range(), "Empty "+name, fmt.Sprintf("The tls block's %s is empty; leave it out instead.", name))
				continue
			}
			*dst = v
		}
	}
	for name, dst := range map[string]*bool{"allow_plaintext": &t.AllowPlaintext, "admin_tls": &t.AdminTLS} {
		if a, ok := attrs[name]; ok {
			if v, ok := d.boolean(obj.with(name), a.Expr); ok {
				*dst = v
			}
		}
	}
	if a, ok := attrs["allowed_sans"]; ok {
		elems, diags := hcl.ExprList(a.Expr)
		if d.add(obj.with("allowed_sans"), diags) {
			for _, e := range elems {
				if s, ok := d.str(obj.with("allowed_sans"), e); ok {
					t.AllowedSANs = append(t.AllowedSANs, s)
				}
			}
		}
	}
	files := 0
	for _, f := range []string{t.CertFile, t.KeyFile, t.ClientCAFile} {
		if f != "" {
			files++
		}
	}
	switch {
	case files != 0 && files != 3:
		d.errorAt(obj, b.DefRange, "Incomplete TLS files", "Set cert_file, key_file and client_ca_file together.")
	case files == 3 && t.ConsulService != "":
		d.errorAt(obj.with("consul_service"), attrs["consul_service"].Expr.Range(), "Conflicting TLS sources",
			"Take the certificate from files (cert_file, key_file, client_ca_file) or from Consul Connect (consul_service), not both.")
	case files == 0 && t.ConsulService == "" && (len(t.AllowedSANs) > 0 || t.AdminTLS):
		d.errorAt(obj, b.DefRange, "No TLS certificate", "allowed_sans and admin_tls need cert_file, key_file and client_ca_file, or consul_service.")
	}
}
