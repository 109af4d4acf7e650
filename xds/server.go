// Package xds owns switchyard's xDS control plane: it follows the registry
// (whose state carries endpoint health too), translates every new state through
// xds/ir and xds/translator into Envoy resources, and serves them to Envoy
// over ADS from a go-control-plane snapshot cache. It tracks every
// connected Envoy node and counts ACKs and NACKs for status and metrics.
package xds

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoverygrpc "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
	"github.com/switchyard/switchyard/xds/translator"
)

// DefaultNodeKey is the snapshot key every Envoy node is served from.
const DefaultNodeKey = "switchyard"

// Options configure a Server. Zero values mean defaults.
type Options struct {
	// Translation holds the picker address, timeouts and per-listener
	// settings (see ir.Options for defaults).
	Translation ir.Options
}

// Server translates registry states into snapshots and serves them over
// ADS. Create it with NewServer, Register it on a gRPC server, and Run it.
type Server struct {
	view  registry.View
	opts  Options
	log   *slog.Logger
	cache cachev3.SnapshotCache
	// eds serves endpoints to state-of-the-world streams (only what
	// changed); the snapshot cache serves everything else, and endpoints
	// to incremental streams.
	eds     *sotwEndpoints
	xds     serverv3.Server
	ctx     context.Context
	cancel  context.CancelFunc
	tracker *tracker
	mu      sync.Mutex
	stats   Stats
	last    translator.Resources
	// lastVersions are the versions of last.
	lastVersions versions
	nodeKey      string
	health       *health.Server
	draining     bool
	// held keeps the health service NOT_SERVING (HoldServing).
	held bool
}

// Stats are the server's counters and current snapshot, for metrics and
// the status page.
type Stats struct {
	// Version names the snapshot being served ("" before the first one):
	// its per-type versions in one string (see Versions).
	Version string
	// Versions are the served version of each resource type, keyed by
	// short type name ("Cluster", "ClusterLoadAssignment", "Listener",
	// "RouteConfiguration"). They are content addresses: the same content
	// has the same version in every replica and after a restart.
	Versions map[string]string
	// RegistryVersion is the registry state version the last snapshot
	// attempt (successful or not) was built from.
	RegistryVersion uint64
	// ServedRegistryVersion is the latest registry state version whose
	// translation is what Version serves (0 before the first snapshot).
	ServedRegistryVersion uint64
	// Attempts counts translations attempted (one per registry or health
	// change).
	Attempts uint64
	// Snapshots counts snapshots set in the cache.
	Snapshots uint64
	// Unchanged counts translations that produced the resources already
	// being served (no new version was pushed).
	Unchanged uint64
	// Failures counts translations, validations or consistency checks that
	// failed; the previous snapshot kept being served.
	Failures uint64
	// LastError is the most recent failure ("" after a success).
	LastError string
	// ACKs and NACKs count Envoy's replies over every node and type.
	ACKs, NACKs uint64
	// Warnings are the last translation's non-fatal notes.
	Warnings []string
}

// NewServer returns a Server following view. logger may be nil.
func NewServer(view registry.View, opts Options, logger *slog.Logger) *Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", "xds")
	s := &Server{
		view:    view,
		opts:    opts,
		log:     logger,
		nodeKey: DefaultNodeKey,
		health:  health.NewServer(),
	}
	s.updateHealth(false)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.tracker = newTracker(logger, s.heldVersion)
	s.cache = cachev3.NewSnapshotCache(true, constantHash(s.nodeKey), cacheLogger{logger})
	s.eds = newSotwEndpoints()
	mux := &cachev3.MuxCache{
		Classify: func(r *cachev3.Request) string {
			if r.GetTypeUrl() == resource.EndpointType {
				return "eds"
			}
			return "snapshot"
		},
		ClassifyDelta: func(*cachev3.DeltaRequest) string { return "snapshot" },
		Caches:        map[string]cachev3.Cache{"snapshot": s.cache, "eds": s.eds},
	}
	s.xds = serverv3.NewServer(s.ctx, mux, s.tracker.callbacks())
	return s
}

// Register adds the ADS service to g. Envoy must use ADS (as
// envoy/bootstrap.yaml does): the snapshot cache runs in ADS mode.
func (s *Server) Register(g *grpc.Server) {
	discoverygrpc.RegisterAggregatedDiscoveryServiceServer(g, s.xds)
	healthpb.RegisterHealthServer(g, s.health)
}

// HealthService is the gRPC health service name Envoy's ADS cluster
// checks (envoy/bootstrap.yaml): SERVING once this server has a snapshot
// to serve, so an Envoy with several xDS servers (replicas) connects to
// one that has configuration, and NOT_SERVING when it stops.
const HealthService = "envoy.service.discovery.v3.AggregatedDiscoveryService"

// SetServing reports this server SERVING or NOT_SERVING on its gRPC health
// service (a replica draining before it stops), once it has a snapshot.
func (s *Server) SetServing(serving bool) {
	s.mu.Lock()
	s.draining = !serving
	s.mu.Unlock()
	s.refreshHealth()
}

// HoldServing keeps the health service NOT_SERVING, even with a snapshot,
// until ReleaseServing: a replica that restarts must not be chosen as an
// Envoy's ADS server before it serves what it should (internal/ready).
// Envoys that connect anyway are served the snapshot.
func (s *Server) HoldServing() {
	s.mu.Lock()
	s.held = true
	s.mu.Unlock()
	s.refreshHealth()
}

// ReleaseServing ends HoldServing.
func (s *Server) ReleaseServing() {
	s.mu.Lock()
	s.held = false
	s.mu.Unlock()
	s.refreshHealth()
}

// refreshHealth reports SERVING when there is a snapshot and nothing
// holds it back.
func (s *Server) refreshHealth() {
	s.mu.Lock()
	serving := s.stats.Version != "" && !s.draining && !s.held
	// Under mu, so that two refreshes cannot apply their answers out of
	// order.
	s.updateHealth(serving)
	s.mu.Unlock()
}

func (s *Server) updateHealth(serving bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if serving {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.health.SetServingStatus(HealthService, st)
	s.health.SetServingStatus("", st)
}

// Run translates the current registry state, pushes it, and repeats on
// every registry change (endpoint health included) until ctx ends. States with Version 0
// (nothing published yet) are never served, so a restarting switchyard
// does not wipe the configuration its Envoys hold. It always returns nil
// after ctx ends; translation failures are logged and counted, never fatal.
// Call Run once: when it returns, the ADS streams are closed.
func (s *Server) Run(ctx context.Context) error {
	defer s.cancel()
	defer s.health.Shutdown()
	for {
		state, changed := s.view.Current()
		s.sync(ctx, state)
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

// Stats returns a copy of the server's counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	st := s.stats
	st.Warnings = append([]string(nil), s.stats.Warnings...)
	st.Versions = maps.Clone(s.stats.Versions)
	s.mu.Unlock()
	acks, nacks := s.tracker.totals()
	st.ACKs, st.NACKs = acks, nacks
	return st
}

// Nodes returns every Envoy node seen since start, sorted by ID.
func (s *Server) Nodes() []NodeStatus { return s.tracker.snapshot() }

// sync translates state and, if it differs from what is served, sets a new
// snapshot. On any failure the previous snapshot stays in place.
func (s *Server) sync(ctx context.Context, state *registry.State) {
	err := s.trySync(ctx, state)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats.RegistryVersion = state.Version
	s.stats.Attempts++
	if err != nil {
		s.stats.Failures++
		s.stats.LastError = err.Error()
		s.log.Error("xDS snapshot not updated; Envoy keeps the previous configuration",
			"registry_version", state.Version, "serving", s.stats.Version, "err", err)
	} else {
		s.stats.LastError = ""
	}
}

func (s *Server) trySync(ctx context.Context, state *registry.State) error {
	if state.Version == 0 {
		// Nothing published yet (e.g. right after a restart, before the
		// sources loaded). Serving the empty state would make connected
		// Envoys drop every listener; serving nothing lets them keep
		// their last configuration until real state arrives.
		s.log.Info("xDS waiting for the first registry state")
		return nil
	}
	cfg, err := ir.Build(state, s.opts.Translation)
	if err != nil {
		return fmt.Errorf("translate registry version %d: %w", state.Version, err)
	}
	res, err := translator.Translate(cfg)
	if err != nil {
		return fmt.Errorf("build Envoy resources for registry version %d: %w", state.Version, err)
	}
	s.mu.Lock()
	if !slices.Equal(s.stats.Warnings, cfg.Warnings) {
		for _, w := range cfg.Warnings {
			s.log.Warn("xDS translation", "registry_version", state.Version, "warning", w)
		}
	}
	s.stats.Warnings = cfg.Warnings
	unchanged := s.last != nil && equalResources(s.last, res)
	if unchanged {
		s.stats.Unchanged++
		s.stats.ServedRegistryVersion = state.Version
	}
	s.mu.Unlock()
	if unchanged {
		return nil
	}
	vs, err := resourceVersions(res)
	if err != nil {
		return fmt.Errorf("version resources: %w", err)
	}
	versions := vs.types
	version := summaryVersion(versions)
	// The per-resource versions incremental xDS compares are set here,
	// so the cache neither encodes every resource again to hash it nor
	// uses versions without the folding resourceVersions does.
	snap := &cachev3.Snapshot{VersionMap: make(map[string]map[string]string, len(vs.resources))}
	for typ, items := range res {
		snap.Resources[cachev3.GetResponseType(typ)] = cachev3.NewResources(versions[typ], items)
		snap.VersionMap[typ] = vs.resources[typ]
	}
	if err := snap.Consistent(); err != nil {
		return fmt.Errorf("snapshot %s inconsistent: %w", version, err)
	}
	if err := s.cache.SetSnapshot(ctx, s.nodeKey, snap); err != nil {
		return fmt.Errorf("set snapshot %s: %w", version, err)
	}
	// After the snapshot: on each stream, a new or changed cluster is
	// queued before the endpoints it needs.
	if err := s.eds.set(versions[resource.EndpointType], res[resource.EndpointType], vs.resources[resource.EndpointType]); err != nil {
		return fmt.Errorf("set endpoints %s: %w", version, err)
	}
	short := make(map[string]string, len(versions))
	for typ, v := range versions {
		short[shortType(typ)] = v
	}
	s.mu.Lock()
	s.last = res
	s.lastVersions = vs
	s.stats.Version, s.stats.Versions = version, short
	s.stats.ServedRegistryVersion = state.Version
	s.stats.Snapshots++
	s.mu.Unlock()
	s.refreshHealth()
	s.tracker.recheck()
	s.log.Info("xDS snapshot set", "version", version, "registry_version", state.Version,
		"listeners", len(res[resource.ListenerType]), "clusters", len(res[resource.ClusterType]),
		"endpoints", countEndpoints(cfg))
	return nil
}

// heldVersion returns the served version of typeURL when held, an
// incremental-xDS Envoy's initial_resource_versions, is what is served:
// every resource it names (and, for the wildcard types, every served one)
// at its served version, and every name it subscribes to among them.
func (s *Server) heldVersion(typeURL string, held map[string]string, names []string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	served := s.lastVersions.resources[typeURL]
	if served == nil {
		return ""
	}
	for name, v := range held {
		if served[name] != v {
			return ""
		}
	}
	switch typeURL {
	case resource.ClusterType, resource.ListenerType:
		if len(held) != len(served) {
			return ""
		}
	}
	for _, n := range names {
		if _, ok := held[n]; !ok {
			return ""
		}
	}
	return s.lastVersions.types[typeURL]
}

func countEndpoints(cfg *ir.Config) int {
	n := 0
	for _, p := range cfg.Pools {
		n += len(p.Endpoints)
	}
	return n
}

func equalResources(a, b translator.Resources) bool {
	if len(a) != len(b) {
		return false
	}
	for typ, la := range a {
		lb, ok := b[typ]
		if !ok || len(la) != len(lb) {
			return false
		}
		for i := range la {
			if !proto.Equal(la[i], lb[i]) {
				return false
			}
		}
	}
	return true
}

// constantHash serves every node from one snapshot key.
type constantHash string

func (h constantHash) ID(*corev3.Node) string { return string(h) }

// cacheLogger adapts slog to go-control-plane's logger at debug level
// (warnings and errors keep their level).
type cacheLogger struct{ l *slog.Logger }

func (c cacheLogger) Debugf(f string, a ...any) { c.l.Debug(fmt.Sprintf(f, a...)) }
func (c cacheLogger) Infof(f string, a ...any)  { c.l.Debug(fmt.Sprintf(f, a...)) }
func (c cacheLogger) Warnf(f string, a ...any)  { c.l.Warn(fmt.Sprintf(f, a...)) }
func (c cacheLogger) Errorf(f string, a ...any) { c.l.Error(fmt.Sprintf(f, a...)) }

// shortType turns a type URL into its message name ("Cluster").
func shortType(typeURL string) string {
	if i := strings.LastIndexByte(typeURL, '.'); i >= 0 {
		return typeURL[i+1:]
	}
	return typeURL
}

// sortNodes orders node statuses by ID.
func sortNodes(ns []NodeStatus) {
	sort.Slice(ns, func(i, j int) bool { return ns[i].ID < ns[j].ID })
}
