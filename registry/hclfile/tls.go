package hclfile

import (
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

// tlsBlank is the detail of an empty attribute in the tls block.
const tlsBlank = "The tls block's %s is empty; leave it out instead."

var tlsBody = newBody([]attr[*TLS]{
	strAttr("cert_file", func(t *TLS, v string) { t.CertFile = v }, notBlank(tlsBlank)),
	strAttr("key_file", func(t *TLS, v string) { t.KeyFile = v }, notBlank(tlsBlank)),
	strAttr("client_ca_file", func(t *TLS, v string) { t.ClientCAFile = v }, notBlank(tlsBlank)),
	listAttr("allowed_sans", func(t *TLS, v []string) { t.AllowedSANs = v }),
	strAttr("consul_service", func(t *TLS, v string) { t.ConsulService = v }, notBlank(tlsBlank)),
	strAttr("envoy_dir", func(t *TLS, v string) { t.EnvoyDir = v }, notBlank(tlsBlank)),
	boolAttr("allow_plaintext", func(t *TLS, v bool) { t.AllowPlaintext = v }),
	strAttr("admin_token_file", func(t *TLS, v string) { t.AdminTokenFile = v }, notBlank(tlsBlank)),
	boolAttr("admin_tls", func(t *TLS, v bool) { t.AdminTLS = v }),
})

func (d *decoder) tlsBlock(b *hcl.Block) {
	const kind = "tls"
	if !d.declare(kind, "", b) {
		return
	}
	obj := loc{kind: kind}
	t := &TLS{}
	d.tls = t
	attrs := decodeBody(d, b.Body, tlsBody, obj.at(""), t).Attributes
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
