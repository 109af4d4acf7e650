// Command pd-sidecar runs beside one decode server of a disaggregated pool
// and performs the two steps of a disaggregated request (package
// internal/pd/sidecar): the prefill on the server the picker named in
// x-prefiller-host-port, then the decode on its own vLLM. It answers
// everything else by proxying to that vLLM, so the pool's endpoint for the
// decode server is the sidecar's address (metrics and /v1/models included).
//
// It contacts only prefill servers it trusts: a static list (-prefillers),
// the prefill-capable endpoints of a pool in switchyard's HCL
// configuration (-config, -pool; re-read every -config-refresh and on
// SIGHUP), including those Consul supplies when the pool has a consul block
// (watched as switchyard watches them), and/or any server whose name
// carries switchyard's signature (-signing-key-file). A request naming
// another server is decoded locally.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/internal/cli"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/pd/sidecar"
	healthprobe "github.com/switchyard/switchyard/internal/probe"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/registry/hclfile"
)

func main() { cli.Main("pd-sidecar", run) }

type options struct {
	probe               string
	listen, decoder     string
	prefillers          string
	config, pool        string
	configRefresh       time.Duration
	signingKeyFile      string
	allowAny            bool
	prefillTimeout      time.Duration
	logLevel            string
	maxSignatureAge     time.Duration
	shutdownGracePeriod time.Duration
}

func parseFlags(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("pd-sidecar", flag.ContinueOnError)
	fs.StringVar(&o.listen, "listen", "0.0.0.0:8000", "address the sidecar listens on: the decode endpoint's address in the pool")
	fs.StringVar(&o.decoder, "decoder", "http://127.0.0.1:8200", "base URL of the decode server (vLLM) beside the sidecar")
	fs.StringVar(&o.prefillers, "prefillers", "", "prefill servers (ip:port, comma-separated) the sidecar may contact")
	fs.StringVar(&o.config, "config", "", "switchyard's HCL configuration (file or directory): with -pool, the pool's prefill-capable endpoints may be contacted, Consul's included")
	fs.StringVar(&o.pool, "pool", "", "the pool whose prefill servers -config names")
	fs.DurationVar(&o.configRefresh, "config-refresh", 30*time.Second, "how often -config is re-read (also on SIGHUP)")
	fs.StringVar(&o.signingKeyFile, "signing-key-file", "", "file holding the key switchyard signs x-prefiller-host-port with; a valid signature is then required")
	fs.DurationVar(&o.maxSignatureAge, "max-signature-age", time.Minute, "how old a signature may be")
	fs.BoolVar(&o.allowAny, "allow-any-prefiller", false, "trust any prefill server a request names (llm-d's sidecar without SSRF protection); only on a network no client can reach")
	fs.DurationVar(&o.prefillTimeout, "prefill-timeout", time.Minute, "longest wait for a prefill; then the decode server prefills itself")
	fs.DurationVar(&o.shutdownGracePeriod, "shutdown-grace", 30*time.Second, "on SIGTERM, how long in-flight requests may finish")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&o.probe, "probe", "", "instead of serving, GET this `URL` (e.g. http://127.0.0.1:8000/health) and exit 0 on a 2xx answer, 1 otherwise: the container image's health check")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.probe != "" {
		return o, nil
	}
	if (o.config == "") != (o.pool == "") {
		return nil, errors.New("-config and -pool go together")
	}
	if o.prefillers == "" && o.config == "" && o.signingKeyFile == "" && !o.allowAny {
		return nil, errors.New("say which prefill servers may be contacted: -prefillers, -config with -pool, -signing-key-file, or -allow-any-prefiller")
	}
	if o.prefillTimeout <= 0 || o.configRefresh <= 0 {
		return nil, errors.New("-prefill-timeout and -config-refresh must be > 0")
	}
	return o, nil
}

// allowList is the set of prefill servers the sidecar may contact:
// -prefillers, plus the pool's prefill endpoints from the configuration
// and from Consul, each part replaced whole when its source changes.
type allowList struct {
	static []string

	mu             sync.Mutex
	config, consul []string
	cur            atomic.Pointer[map[string]bool]
}

func (a *allowList) set(fromConfig []string) {
	a.mu.Lock()
	a.config = fromConfig
	a.rebuild()
	a.mu.Unlock()
}

func (a *allowList) setConsul(fromConsul []string) {
	a.mu.Lock()
	a.consul = fromConsul
	a.rebuild()
	a.mu.Unlock()
}

// rebuild publishes the union; called with a.mu held.
func (a *allowList) rebuild() {
	m := make(map[string]bool, len(a.static)+len(a.config)+len(a.consul))
	for _, part := range [][]string{a.static, a.config, a.consul} {
		for _, hp := range part {
			m[hp] = true
		}
	}
	a.cur.Store(&m)
}

func (a *allowList) allowed(hp string) bool {
	canon, err := registry.CanonicalAddress(hp, true)
	if err != nil {
		return false
	}
	return (*a.cur.Load())[canon]
}

// poolPrefillers reads the configuration at path and returns the pool's
// endpoints that may prefill, and the configuration.
func poolPrefillers(path, pool string) ([]string, *hclfile.Config, error) {
	cfg, diags := hclfile.Load(path, nil)
	if diags.HasErrors() {
		return nil, nil, fmt.Errorf("%s: %s", path, hclfile.FormatDiagnostics(diags))
	}
	p, ok := cfg.State.Pools[pool]
	if !ok {
		return nil, nil, fmt.Errorf("%s: no pool %q", path, pool)
	}
	if p.Disaggregation == nil {
		return nil, nil, fmt.Errorf("%s: pool %q has no disaggregation block", path, pool)
	}
	return prefillers(p.Endpoints), cfg, nil
}

// prefillers returns the endpoints that may prefill (role prefill or
// both), leaving out draining and failing ones.
func prefillers(eps []registry.Endpoint) []string {
	var out []string
	for _, ep := range eps {
		if ep.Role.Prefills() && !ep.Draining && !ep.Critical {
			out = append(out, ep.Address)
		}
	}
	return out
}

// consulWants is what the sidecar asks Consul: the pool's members, when
// the configuration says they (also) come from Consul.
func consulWants(cfg *hclfile.Config, pool string) consul.Wants {
	w := consul.Wants{Pools: map[string]consul.PoolWant{}}
	if pw, ok := consul.WantsFrom(cfg.State).Pools[pool]; ok {
		w.Pools[pool] = pw
	}
	return w
}

// consulOptions are the agent settings of the configuration's consul block
// (the CONSUL_HTTP_* environment otherwise), as switchyard serve uses them.
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

// watchConsul keeps the pool's prefill servers from Consul in allow; an
// update that carries an error keeps the last list, as switchyard does.
func watchConsul(ctx context.Context, src *consul.Source, pool string, allow *allowList, log *slog.Logger) {
	up := make(chan registry.Update, 1)
	go src.Run(ctx, up)
	for {
		select {
		case <-ctx.Done():
			return
		case u := <-up:
			if u.Err != nil {
				log.Warn("Consul unreachable; keeping the last prefill servers", "err", u.Err)
				continue
			}
			hps := prefillers(u.Endpoints[pool])
			allow.setConsul(hps)
			log.Debug("prefill servers from Consul", "pool", pool, "prefillers", hps)
		}
	}
}

func run(args []string) error {
	o, err := parseFlags(args)
	if err != nil {
		return err // -h: flag.ErrHelp, an exit status of 0
	}
	if o.probe != "" {
		return healthprobe.Flag(context.Background(), o.probe)
	}
	log, err := cli.Logger(os.Stderr, o.logLevel)
	if err != nil {
		return err
	}
	dec, err := url.Parse(o.decoder)
	if err != nil || dec.Host == "" || (dec.Scheme != "http" && dec.Scheme != "https") {
		return fmt.Errorf("-decoder %q is not an http(s) URL", o.decoder)
	}

	cfg := sidecar.Config{Decoder: dec, AllowAny: o.allowAny, PrefillTimeout: o.prefillTimeout,
		MaxSignatureAge: o.maxSignatureAge, Log: log}
	allow := &allowList{}
	for _, hp := range pd.Prefillers(o.prefillers) {
		canon, err := registry.CanonicalAddress(hp, true)
		if err != nil {
			return fmt.Errorf("-prefillers: %w", err)
		}
		allow.static = append(allow.static, canon)
	}
	allow.set(nil)
	if o.prefillers != "" || o.config != "" {
		cfg.Allowed = allow.allowed
	}
	var consulSrc *consul.Source
	if o.config != "" {
		hps, loaded, err := poolPrefillers(o.config, o.pool)
		if err != nil {
			return err
		}
		allow.set(hps)
		log.Info("prefill servers from the configuration", "pool", o.pool, "prefillers", hps)
		if w := consulWants(loaded, o.pool); len(w.Pools) > 0 {
			opts := consulOptions(loaded)
			opts.Wants, opts.Logger = w, log.With("component", "consul")
			if consulSrc, err = consul.New(opts); err != nil {
				return fmt.Errorf("consul: %w", err)
			}
		}
	}
	if o.signingKeyFile != "" {
		key, err := os.ReadFile(o.signingKeyFile)
		if err != nil {
			return fmt.Errorf("-signing-key-file: %w", err)
		}
		if cfg.Signer, err = pd.NewSigner([]byte(strings.TrimSpace(string(key)))); err != nil {
			return fmt.Errorf("-signing-key-file: %w", err)
		}
	}
	h, err := sidecar.New(cfg)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if o.config != "" {
		go watchConfig(ctx, o, allow, consulSrc, log)
	}
	if consulSrc != nil {
		go watchConsul(ctx, consulSrc, o.pool, allow, log)
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("pd-sidecar listening", "addr", ln.Addr().String(), "decoder", dec.String(),
		"signed", cfg.Signer != nil, "allow_any", o.allowAny)
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down", "counters", fmt.Sprintf("%+v", h.Counters()))
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownGracePeriod)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}

// watchConfig re-reads the configuration's prefill servers every refresh
// and on SIGHUP; a configuration that does not load keeps the last list.
// A changed consul block is passed to src (when Consul is watched at all).
func watchConfig(ctx context.Context, o *options, allow *allowList, src *consul.Source, log *slog.Logger) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	t := time.NewTicker(o.configRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-hup:
		}
		hps, loaded, err := poolPrefillers(o.config, o.pool)
		if err != nil {
			log.Warn("configuration not re-read; keeping the last prefill servers", "err", err)
			continue
		}
		allow.set(hps)
		if src != nil {
			src.Apply(consulWants(loaded, o.pool))
		}
	}
}
