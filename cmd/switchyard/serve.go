package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/adminauth"
	"github.com/switchyard/switchyard/internal/drain"
	"github.com/switchyard/switchyard/internal/mtls"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/persist"
	"github.com/switchyard/switchyard/internal/ready"
	adminstatus "github.com/switchyard/switchyard/internal/status"
	tenantusage "github.com/switchyard/switchyard/internal/usage"
	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/registry/hclfile"
	"github.com/switchyard/switchyard/store"
	"github.com/switchyard/switchyard/xds"
	"github.com/switchyard/switchyard/xds/ir"
)

// healthSourceName is the registry source name of the picker's endpoint
// health.
const healthSourceName = "health"

// shutdownGrace is how long serve waits for components to stop after the
// shutdown signal before giving up on them.
const shutdownGrace = 15 * time.Second

// serveFlags are the serve command's settings.
type serveFlags struct {
	config           string
	extprocAddr      string
	extprocAdvertise string
	pickerMaxStreams uint
	xdsAddr          string
	xdsAdvertise     string
	adminAdvertise   string
	replicaID        string
	shareScrapes     bool
	drainDelay       time.Duration
	drainTimeout     time.Duration
	storePath        string
	adminAddr        string
	debugAddr        string
	logLevel         string
	logFormat        string
	pdSigningKeyFile string
	tls              tlsFlags
	obs              obsFlags
}

func (f *serveFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.config, "config", "", "configuration `path`: an HCL file, or a directory whose *.hcl files are merged (required); re-read on change and on SIGHUP")
	fs.StringVar(&f.extprocAddr, "extproc-addr", "127.0.0.1:9002", "`address` of the picker's ext_proc gRPC server that Envoy calls for every request")
	fs.StringVar(&f.extprocAdvertise, "extproc-advertise", "", "`address` (ip:port) Envoy uses to reach the picker; default -extproc-addr, with 127.0.0.1 for an unspecified host such as 0.0.0.0")
	fs.UintVar(&f.pickerMaxStreams, "picker-max-streams", ir.DefaultPickerMaxStreams, "concurrent ext_proc `streams` each Envoy may open to the picker (its picker cluster's circuit breakers); every request in flight holds one until its response ends, and a request past the limit fails (fail_closed) or bypasses the picker (fail_open)")
	fs.StringVar(&f.xdsAddr, "xds-addr", "127.0.0.1:18000", "`address` of the xDS (ADS) gRPC server Envoy fetches its configuration from")
	fs.StringVar(&f.xdsAdvertise, "xds-advertise", "", "`address` (ip:port) Envoys and operators reach the xDS server at, published with this replica's Consul registration; default -xds-addr, with 127.0.0.1 for an unspecified host")
	fs.StringVar(&f.adminAdvertise, "admin-advertise", "", "`address` (ip:port) the admin server is reached at from other hosts, published with this replica's Consul registration (the status page lists every replica); default -admin-addr, with 127.0.0.1 for an unspecified host")
	fs.DurationVar(&f.drainDelay, "drain-delay", time.Second, "on SIGTERM, how long switchyard keeps serving while it reports itself not ready (gRPC health, /readyz, Consul), so Envoys and the other replicas stop sending to it before its streams are waited for")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, after -drain-delay, the longest switchyard waits for the requests in flight through its picker to finish before it stops")
	fs.StringVar(&f.replicaID, "replica-id", "", "`name` of this replica among the switchyard replicas of the configuration's replicas block (its Consul service ID); default <hostname>-<picker port>")
	fs.BoolVar(&f.shareScrapes, "share-scrapes", true, "with a replicas block, read each model server's metrics from one replica only (rendezvous order over the replicas that share) and pass the readings on over the replica mesh, so engines are scraped as often with many replicas as with one; with -share-scrapes=false this replica reads every server itself")
	fs.StringVar(&f.storePath, "store", "", "bbolt `file` that persists pool state and the picker's memory so a restart is warm (even with Consul down); empty disables persistence")
	fs.StringVar(&f.adminAddr, "admin-addr", "127.0.0.1:9090", "`address` of the admin HTTP server (status page, /metrics, health)")
	fs.StringVar(&f.debugAddr, "debug-addr", "", "`address` (loopback) of an HTTP server with Go's profiles at /debug/pprof/ (CPU, heap, goroutines; unauthenticated); empty: none")
	fs.StringVar(&f.logLevel, "log-level", "info", "log `level`: debug, info, warn or error")
	fs.StringVar(&f.logFormat, "log-format", "text", "log `format`: text or json")
	fs.StringVar(&f.pdSigningKeyFile, "pd-signing-key-file", "", "`file` holding the key (at least 16 bytes) that signs the prefill server the picker names to a disaggregated pool's pd-sidecars (x-switchyard-prefiller-sig); give the sidecars the same file as -signing-key-file")
	f.tls.register(fs)
	f.obs.register(fs)
}

func serveCmd(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f serveFlags
	f.register(fs)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `Usage: switchyard serve -config PATH [flags]

Runs the control plane: loads the configuration, serves Envoy its listeners,
clusters and endpoints over xDS, and picks an endpoint for every request
over ext_proc. Configuration changes (file edits, SIGHUP) are applied
without restarting; a bad change is logged and the last good configuration
stays in force. SIGINT or SIGTERM shut down gracefully.

Exit status: 0 after a graceful shutdown; 1 when it cannot start (a bad
configuration, a store it cannot open, TLS files, a busy address) or a
component fails while running; 2 for a command-line error (an unknown or
missing flag, a bad flag value).

Flags:
`)
		fs.PrintDefaults()
	}
	if code, done := parseFlags(fs, args); done {
		return code
	}
	if f.config == "" {
		fmt.Fprintln(stderr, "serve: -config is required")
		fs.Usage()
		return 2
	}
	logger, err := newLogger(stderr, f.logLevel, f.logFormat)
	if err != nil {
		fmt.Fprintf(stderr, "serve: %v\n", err)
		return 2
	}
	if stderr == os.Stderr {
		defer routeProcessLogs(logger)()
	}
	if _, err := advertiseAddr(f.extprocAddr, f.extprocAdvertise); err != nil {
		fmt.Fprintf(stderr, "serve: %v\n", err)
		return 2
	}

	// Refuse to start on a bad configuration: print it like validate does.
	cfg, diags := hclfile.Load(f.config, sched.Rules)
	if diags.HasErrors() {
		writeDiagnostics(stderr, cfg.Files, diags)
		return 1
	}
	logger.Info("configuration loaded", "path", f.config, "summary", cfg.State.Summary())

	a, err := newApp(f, cfg, logger)
	if err != nil {
		fmt.Fprintf(stderr, "serve: %v\n", err)
		return 1
	}
	if err := a.run(ctx); err != nil {
		logger.Error("serve failed", "err", err)
		return 1
	}
	logger.Info("shut down")
	return 0
}

// app is one running switchyard: the registry and everything that consumes
// it. Consumers read a.view and never talk to the sources.
type app struct {
	flags   serveFlags
	log     *slog.Logger
	pub     *registry.Publisher
	view    registry.View
	manager *registry.Manager
	files   *hclfile.Source
	picker  *picker.Server
	xds     *xds.Server
	consul  *consul.Source
	// store, and what persists state and the picker's memory in it, are
	// nil without -store.
	store  store.Store
	states *persist.StateSaver
	warm   *persist.Warm
	// tls serves ADS and ext_proc certificates; nil without TLS.
	tls     *mtls.Server
	connect mtls.ConnectAgent // Consul agent with -tls-consul-service
	// drain takes the process out of service on shutdown.
	drain *drain.Drainer
	// replicaID names this process among the replicas; registration, when
	// set, is its Consul registration (replicas { consul_service }).
	replicaID    string
	pickerAddr   string // the picker address Envoys and replicas dial
	registration *consul.Registration
	// peerOpts configure, and mesh is, the pick sharing with the other
	// replicas (nil without a replicas block).
	peerOpts *peers.Options
	// replicaStatus reads the other replicas' reports (which Envoys each
	// serves) for the status page; nil for one switchyard.
	replicaStatus *adminstatus.Peers
	mesh          *peers.Mesh
	consulClient  *api.Client
	adminAuth     adminauth.Options
	// usage counts the tenants' usage (internal/usage).
	usage *tenantusage.Ledger
	// obs is tracing and decision records; history the status page's
	// charts.
	obs     *observability
	history *adminstatus.History
	// ready decides when this process reports itself ready (/readyz,
	// the picker's and ADS's gRPC health).
	ready *ready.Gate
}

// newApp builds every component. With -store, the state persisted by the
// previous run is published before any source answers, so the picker and
// Envoys serve the last known members at once, even with Consul down.
func newApp(f serveFlags, cfg *hclfile.Config, logger *slog.Logger) (*app, error) {
	advertise, err := advertiseAddr(f.extprocAddr, f.extprocAdvertise)
	if err != nil {
		return nil, err
	}
	a := &app{flags: f, log: logger}
	if err := a.setupTLS(context.Background(), cfg); err != nil {
		return nil, err
	}
	if err := a.replicaSetup(cfg, advertise); err != nil {
		return nil, err
	}
	obs, err := observabilityFrom(f.obs, cfg.Tracing, versionString(), a.replicaID)
	if err != nil {
		return nil, err
	}
	a.obs = obs
	var (
		initial  *registry.State
		snap     *store.Snapshot
		restored uint64 // the persisted state's version (0: none)
		mgrOpts  = []registry.ManagerOption{registry.WithLogger(logger)}
	)
	if f.storePath != "" {
		st, loaded, err := persist.Open(f.storePath, logger)
		if err != nil {
			return nil, err
		}
		a.store, snap = st, loaded
		if initial = snap.State(); initial != nil {
			// What Consul is asked stays the configuration's: it, not the
			// snapshot, says which pools want Consul members now.
			logger.Info("serving the persisted state until sources answer", "version", initial.Version, "summary", initial.Summary())
			// Tenants and upstream keys are not persisted: take them from
			// the configuration just loaded, never serve without them.
			initial = initial.WithConfigOnly(cfg.State)
		}
		restored = snap.StateVersion
		mgrOpts = append(mgrOpts, registry.WithInitialVersion(snap.StateVersion))
	} else {
		logger.Info("persistence disabled (no -store): a restart starts cold")
	}
	a.pub = registry.NewPublisher(initial)
	a.view = a.pub
	a.manager = registry.NewManager(a.pub, append(mgrOpts, registry.WithSchedulingRules(sched.Rules))...)
	if a.consul, err = newConsulSource(cfg, initial, persist.ConsulIndexes(snap), logger); err != nil {
		a.close()
		return nil, err
	}
	// Every reloaded configuration tells the Consul source what to watch.
	a.files = hclfile.NewSource(f.config, hclfile.WithLogger(logger), hclfile.WithSchedulingRules(sched.Rules),
		hclfile.WithOnLoad(func(c *hclfile.Config) { a.consul.Apply(consul.WantsFrom(c.State)) }))
	// Registration order is source priority; names are distinct, so
	// AddSource cannot fail on a fresh manager.
	_ = a.manager.AddSource(hclfile.SourceName, a.files)
	_ = a.manager.AddSource(consul.SourceName, a.consul)
	a.usage = tenantusage.New(a.store, logger.With("component", "usage"))
	signer, err := pdSigner(f.pdSigningKeyFile)
	if err != nil {
		a.close()
		return nil, err
	}
	a.picker = picker.New(a.pub, picker.Options{Usage: a.usage, Tracer: obs.tracer, Decisions: obs.decisions, PDSigner: signer},
		logger.With("component", "picker"))
	a.history = adminstatus.NewHistory(a.picker, 0, 0)
	// The picker's scrape results are the registry's health input: xDS
	// and the discovery guard read endpoint health from published states.
	_ = a.manager.AddSource(healthSourceName, a.picker.EndpointHealth())
	if a.peerOpts != nil {
		a.replicaStatus = adminstatus.NewPeers(a.view, a.pickerAddr, replicaStatusInterval, a.adminClient())
		a.mesh = peers.New(a.picker, *a.peerOpts)
		a.picker.UsePeers(a.mesh)
	}
	if a.store != nil {
		// The picker starts on the persisted state, so the prefix index,
		// sessions and health of its endpoints can be restored now.
		storeLog := logger.With("component", "store")
		a.warm = persist.NewWarm(a.store, a.picker, persist.WarmOptions{Logger: storeLog})
		a.warm.Restore(snap, time.Now())
		a.states = persist.NewStateSaver(a.store, a.pub, a.consul.Indexes, storeLog)
	}
	a.xds = xds.NewServer(a.pub, xds.Options{
		Translation: ir.Options{PickerAddr: advertise, PickerTLS: a.pickerTLS(), PickerMaxStreams: uint32(min(f.pickerMaxStreams, 1<<32-1)),
			Tracing: obs.envoy},
	}, logger)
	a.setupReadiness(restored, logger)
	// On shutdown, the picker's and ADS's gRPC health and /readyz report
	// not ready (the Consul registration ends too: registerReplica).
	a.drain = drain.New(drain.Options{Delay: f.drainDelay, Timeout: f.drainTimeout, Logger: logger}, a.picker.ActiveStreams)
	a.drain.OnDrain(a.picker.Drain)
	a.drain.OnDrain(func() { a.xds.SetServing(false) })
	return a, nil
}

// newConsulSource builds the Consul source watching what cfg asks for (its
// pools' consul blocks, the replicas block); it opens no connection until
// something is wanted. restored is the persisted state, whose Consul
// members stand in until Consul first answers, and indexes the persisted
// blocking-query indexes. The configuration's top-level consul block, read
// once at start, overrides the CONSUL_HTTP_* environment.
func newConsulSource(cfg *hclfile.Config, restored *registry.State, indexes map[registry.ConsulSelector]uint64, logger *slog.Logger) (*consul.Source, error) {
	opts := consulOptions(cfg)
	opts.Wants = consul.WantsFrom(cfg.State)
	opts.Restored = restored
	opts.InitialIndexes = indexes
	opts.Logger = logger.With("component", "consul")
	cs, err := consul.New(opts)
	if err != nil {
		return nil, fmt.Errorf("consul: %w", err)
	}
	return cs, nil
}

// close releases what newApp opened (the store's final flush).
func (a *app) close() {
	if a.store != nil {
		if err := a.store.Close(); err != nil {
			a.log.Error("store close", "err", err)
		}
	}
}

// advertiseAddr returns the picker address Envoy should dial: the explicit
// -extproc-advertise, else -extproc-addr with an unspecified host replaced
// by loopback.
func advertiseAddr(listen, advertise string) (string, error) {
	return advertised("extproc", listen, advertise)
}

// advertised returns the address others reach the server whose flags are
// -<name>-addr (listen) and -<name>-advertise at: the advertised one, else
// the listen address with an unspecified host replaced by loopback.
func advertised(name, listen, advertise string) (string, error) {
	if advertise != "" {
		if _, err := registry.CanonicalAddress(advertise, false); err != nil {
			return "", fmt.Errorf("-%s-advertise: %w", name, err)
		}
		return advertise, nil
	}
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "", fmt.Errorf("-%s-addr %q: %w", name, listen, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port), nil
}

// component is one long-running part of serve. run must return when ctx is
// cancelled (nil is then a clean stop); any return before that, error or
// not, shuts the whole process down.
type component struct {
	name string
	run  func(ctx context.Context) error
}

// components lists what serve runs. New servers (picker, xDS, admin) are
// added here; each gets a.view to follow registry states and the address
// from a.flags.
func (a *app) components() []component {
	extproc := grpc.NewServer(append(a.picker.GRPCServerOptions(), a.grpcCreds("extproc")...)...)
	a.picker.Register(extproc)
	if a.mesh != nil {
		a.mesh.Register(extproc)
	}
	ads := grpc.NewServer(append(xds.GRPCServerOptions(), a.grpcCreds("xds")...)...)
	a.xds.Register(ads)
	comps := []component{
		{"registry", a.manager.Run},
		{"ready", a.ready.Run},
		{"sighup", a.reloadOnSIGHUP},
		{"picker", a.picker.Run},
		{"xds", a.xds.Run},
		// The picker's requests were waited for while draining; what is
		// left are the other replicas' pick streams, which never end on
		// their own: a short grace.
		{"extproc-server", grpcComponent(a.flags.extprocAddr, extproc, time.Second)},
		{"xds-server", grpcComponent(a.flags.xdsAddr, ads, stopGrace)},
		{"admin-server", httpsComponent(a.flags.adminAddr, adminauth.Wrap(a.adminHandler(), a.adminAuth), a.adminTLSConfig(), a.log)},
	}
	if a.flags.debugAddr != "" {
		comps = append(comps, component{"debug-server", httpsComponent(a.flags.debugAddr, debugHandler(), nil, a.log)})
	}
	if a.tls != nil {
		comps = append(comps, component{"tls-reload", a.watchTLS})
	}
	if a.registration != nil {
		comps = append(comps, component{"replica-registration", a.registerReplica})
	}
	if a.mesh != nil {
		comps = append(comps, component{"peers", a.sharePicks})
	}
	if a.replicaStatus != nil {
		comps = append(comps, component{"replica-status", func(ctx context.Context) error { a.replicaStatus.Run(ctx); return nil }})
	}
	if a.store != nil {
		comps = append(comps, component{"persist", a.states.Run}, component{"persist-warm", a.warm.Run})
	}
	comps = append(comps, component{"status-history", a.history.Run})
	if a.obs.tracer != nil {
		comps = append(comps, component{"tracing", a.runTracing})
	}
	if a.obs.file != "" {
		comps = append(comps, component{"decisions-file", a.runDecisionsFile})
	}
	return comps
}

// run runs every component until ctx is cancelled (then drains first) or
// one of them stops.
func (a *app) run(ctx context.Context) error {
	defer a.close()
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- runComponents(runCtx, a.log, a.components()) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	if stopped, err := a.drain.Run(errc); stopped {
		return err
	}
	cancel()
	return <-errc
}

func runComponents(ctx context.Context, logger *slog.Logger, comps []component) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, c := range comps {
		g.Go(func() error {
			err := c.run(gctx)
			if gctx.Err() == nil {
				if err == nil {
					err = errors.New("stopped unexpectedly")
				}
				return fmt.Errorf("%s: %w", c.name, err)
			}
			if err != nil && !errors.Is(err, context.Canceled) {
				logger.Warn("component stopped with error", "component", c.name, "err", err)
			}
			return nil
		})
	}
	done := make(chan error, 1)
	go func() { done <- g.Wait() }()
	select {
	case err := <-done:
		return err
	case <-gctx.Done():
	}
	logger.Info("shutting down")
	select {
	case err := <-done:
		return err
	case <-time.After(shutdownGrace):
		return fmt.Errorf("components did not stop within %v", shutdownGrace)
	}
}

// reloadOnSIGHUP re-reads the configuration on every SIGHUP.
func (a *app) reloadOnSIGHUP(ctx context.Context) error {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGHUP)
	defer signal.Stop(ch)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ch:
			a.log.Info("SIGHUP: reloading configuration")
			a.manager.Reload()
		}
	}
}

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("bad -log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("bad -log-format %q: want text or json", format)
	}
}

// pdSigner reads the P/D signing key file (nil without one): its content,
// trimmed of surrounding white space, as pd-sidecar reads it.
func pdSigner(path string) (*pd.Signer, error) {
	if path == "" {
		return nil, nil
	}
	key, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("-pd-signing-key-file: %w", err)
	}
	s, err := pd.NewSigner([]byte(strings.TrimSpace(string(key))))
	if err != nil {
		return nil, fmt.Errorf("-pd-signing-key-file %s: %w", path, err)
	}
	return s, nil
}
