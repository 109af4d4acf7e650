package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/adminauth"
	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/registry/hclfile"
	"github.com/switchyard/switchyard/xds/ir"
)

// tlsReloadInterval is how often certificate files are re-read.
const tlsReloadInterval = time.Second

// tlsFlags are serve's transport-security settings.
type tlsFlags struct {
	cert, key, clientCA string
	allowedSANs         string
	consulService       string
	envoyDir            string
	allowPlaintext      bool
	adminTokenFile      string
	adminTLS            bool
}

func (f *tlsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.cert, "tls-cert", "", "PEM `file` with switchyard's certificate (chain) for ADS and ext_proc; with -tls-key and -tls-client-ca turns on mutual TLS; re-read every second")
	fs.StringVar(&f.key, "tls-key", "", "PEM `file` with the private key of -tls-cert")
	fs.StringVar(&f.clientCA, "tls-client-ca", "", "PEM `file` with the CA(s) Envoy client certificates must chain to")
	fs.StringVar(&f.allowedSANs, "tls-allowed-san", "", "comma-separated `names`: admit only client certificates with one of these SANs (DNS, URI such as a SPIFFE ID, IP); default any certificate the CA signed")
	fs.StringVar(&f.consulService, "tls-consul-service", "", "take the certificate and client CA from Consul Connect instead of files: a leaf certificate for this `service` from the local agent, renewed by Consul")
	fs.StringVar(&f.envoyDir, "envoy-tls-dir", envoy.DefaultTLSDir, "`directory` on every Envoy host with its certificate and SDS files (envoy/README.md); used in the picker cluster switchyard pushes")
	fs.BoolVar(&f.allowPlaintext, "allow-plaintext", false, "allow ADS and ext_proc without TLS on non-loopback addresses (logged as a warning)")
	fs.StringVar(&f.adminTokenFile, "admin-token-file", "", "`file` with a bearer token that state-changing admin requests (POST /api/reload) must send; re-read on each such request")
	fs.BoolVar(&f.adminTLS, "admin-tls", false, "serve the admin address over HTTPS with the TLS certificate; a verified client certificate then authorises state-changing requests")
}

// merge fills unset flags from the HCL tls block (flags win) and
// checks that they make sense together.
func (f *tlsFlags) merge(block *hclfile.TLS) {
	if block == nil {
		return
	}
	for dst, src := range map[*string]string{
		&f.cert: block.CertFile, &f.key: block.KeyFile, &f.clientCA: block.ClientCAFile,
		&f.consulService: block.ConsulService, &f.adminTokenFile: block.AdminTokenFile,
	} {
		if *dst == "" {
			*dst = src
		}
	}
	if f.allowedSANs == "" {
		f.allowedSANs = strings.Join(block.AllowedSANs, ",")
	}
	if block.EnvoyDir != "" && f.envoyDir == envoy.DefaultTLSDir {
		f.envoyDir = block.EnvoyDir
	}
	f.allowPlaintext = f.allowPlaintext || block.AllowPlaintext
	f.adminTLS = f.adminTLS || block.AdminTLS
}

func (f *tlsFlags) files() mtls.Files {
	return mtls.Files{Cert: f.cert, Key: f.key, ClientCA: f.clientCA}
}

func (f *tlsFlags) enabled() bool { return f.cert != "" || f.consulService != "" }

func (f *tlsFlags) sans() []string {
	var out []string
	for _, s := range strings.Split(f.allowedSANs, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// setupTLS builds a.tls (nil without TLS) and applies the listening
// policy: plaintext ADS and ext_proc only on loopback unless
// -allow-plaintext; an admin server off loopback needs a token or client
// certificates for state changes.
func (a *app) setupTLS(ctx context.Context, cfg *hclfile.Config) error {
	f := &a.flags.tls
	f.merge(cfg.TLS)
	if err := f.files().Validate(); err != nil {
		return err
	}
	if f.cert != "" && f.consulService != "" {
		return errors.New("-tls-cert and -tls-consul-service are alternatives: set one")
	}
	if !f.enabled() {
		if f.allowedSANs != "" || f.adminTLS {
			return errors.New("-tls-allowed-san and -admin-tls need TLS (-tls-cert, -tls-key, -tls-client-ca or -tls-consul-service)")
		}
		for name, addr := range map[string]string{"ADS (-xds-addr)": a.flags.xdsAddr, "ext_proc (-extproc-addr)": a.flags.extprocAddr} {
			warn, err := mtls.CheckPlaintext(name, addr, f.allowPlaintext)
			if err != nil {
				return err
			}
			if warn != "" {
				a.log.Warn(warn)
			}
		}
	} else {
		a.tls = mtls.NewServer(mtls.Options{AllowedSANs: f.sans(), Logger: a.log.With("component", "tls")})
		if f.consulService != "" {
			client, err := consul.NewClient(consulOptions(cfg))
			if err != nil {
				return err
			}
			a.connect = client.Agent()
			lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if err := a.tls.LoadConsul(lctx, a.connect, f.consulService); err != nil {
				return err
			}
		} else if err := a.tls.LoadFiles(f.files()); err != nil {
			return err
		}
		a.log.Info("mutual TLS on ADS and ext_proc", "allowed_sans", f.allowedSANs, "envoy_tls_dir", f.envoyDir)
	}
	admin := adminauth.Options{TokenFile: f.adminTokenFile, ClientCerts: f.adminTLS,
		Loopback: mtls.Loopback(a.flags.adminAddr), Logger: a.log.With("component", "admin")}
	if !admin.Loopback && admin.TokenFile == "" && !admin.ClientCerts {
		a.log.Warn("the admin server is not on loopback and has no -admin-token-file or -admin-tls: its status, metrics and health are readable by anyone who reaches it, and state-changing requests are refused", "addr", a.flags.adminAddr)
	}
	a.adminAuth = admin
	return nil
}

// pickerTLS is the picker cluster's TLS for the translation, nil without
// TLS.
func (a *app) pickerTLS() *ir.PickerTLS {
	if a.tls == nil {
		return nil
	}
	l := envoy.TLSLayout(a.flags.tls.envoyDir)
	return &ir.PickerTLS{CertificateSDS: l.CertSDS, CertificateSecret: envoy.CertificateSecret,
		ValidationSDS: l.CASDS, ValidationSecret: envoy.ValidationSecret, WatchDir: l.Dir}
}

// adminTLSConfig is the admin server's TLS, nil for plain HTTP.
func (a *app) adminTLSConfig() *tls.Config {
	if a.tls == nil || !a.flags.tls.adminTLS {
		return nil
	}
	return a.tls.Config(false, "h2", "http/1.1")
}

// watchTLS keeps the certificate current: files re-read every second, or
// Consul's blocking queries.
func (a *app) watchTLS(ctx context.Context) error {
	if a.connect != nil {
		return a.tls.WatchConsul(ctx, a.connect, a.flags.tls.consulService)
	}
	return a.tls.WatchFiles(ctx, a.flags.tls.files(), tlsReloadInterval)
}

func consulOptions(cfg *hclfile.Config) consul.Options {
	var opts consul.Options
	if ag := cfg.Consul; ag != nil {
		opts.Address, opts.Token, opts.TokenFile = ag.Address, ag.Token, ag.TokenFile
		t := ag.TLS
		opts.TLS = consul.TLSOptions{ServerName: t.ServerName, CAFile: t.CAFile, CAPath: t.CAPath,
			CertFile: t.CertFile, KeyFile: t.KeyFile, InsecureSkipVerify: t.InsecureSkipVerify}
	}
	return opts
}

// grpcCreds returns the option giving the gRPC server named server mutual
// TLS, none without TLS.
func (a *app) grpcCreds(server string) []grpc.ServerOption {
	if a.tls == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.Creds(a.tls.GRPCCredentials(server))}
}
