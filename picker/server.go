// Package picker owns the Endpoint Picker: an Envoy ext_proc gRPC server
// that reads each inference request (headers and body), chooses a model
// server endpoint (plus fallbacks) in the request's pool, and tells Envoy
// through the x-gateway-destination-endpoint header and envoy.lb dynamic
// metadata. It also rewrites model names in both directions, answers
// 400/404/413/429/503 locally, and keeps per-endpoint in-flight counters.
//
// Request parsing lives in picker/openai, scheduling in picker/sched. A
// request's path is a fixed sequence of stages, each in its own file,
// with the optional ones (tracing, decision records, tenants, replica
// sharing, TTFT accounting) in a chain built with each snapshot: see
// request.go, chain.go and README.md. stream.go adapts Envoy's protocol.
package picker

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/switchyard/switchyard/internal/contract"
	pdwire "github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/kvevents"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/picker/tracing"
	"github.com/switchyard/switchyard/registry"
)

// Health service names the picker serves.
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
	HealthExtProc   = contract.PickerHealthService
)

// Options tunes the picker. The zero value is usable.
type Options struct {
	// MaxBodyBytes caps a buffered request body (default 32 MiB); larger
	// requests get 413.
	MaxBodyBytes int
	// MaxEndpoints is primary plus fallbacks in the destination list
	// (default 3).
	MaxEndpoints int
	// MaxInFlightPerEndpoint is an extra saturation guard: a pool whose
	// every endpoint has this many requests in flight through the picker
	// is saturated even if its scraped metrics say otherwise (default 256;
	// negative disables it).
	MaxInFlightPerEndpoint int64
	// Saturation, if set, is checked in addition to each pool profile's
	// rule (scraped queue/KV thresholds plus the in-flight guard).
	Saturation sched.Saturation
	// Profile overrides every pool's scheduling profile (tests); nil
	// builds each pool's from its scheduling block (sched.BuildProfile).
	Profile func(*registry.Pool) *sched.Profile
	// DisableMetrics turns model-server metrics scraping off: scheduling
	// then relies on the picker's own in-flight counts.
	DisableMetrics bool
	// Metrics tunes the scraper (interval default, timeouts, failure
	// threshold); OnTransition and Logger are set by the picker.
	Metrics metrics.Options
	// Health is the rule deciding which endpoints with failing scrapes
	// Envoy stops routing to (EndpointHealth); zero fields are defaults.
	Health HealthPolicy
	// RequestBodyMode and ResponseBodyMode are assumed when Envoy does not
	// send protocol_config (default FULL_DUPLEX_STREAMED).
	RequestBodyMode  extprocfilterv3.ProcessingMode_BodySendMode
	ResponseBodyMode extprocfilterv3.ProcessingMode_BodySendMode
	// StreamChunkBytes bounds each streamed body response (default 64 KiB).
	StreamChunkBytes int
	// Usage, if set, receives the usage of every request of a tenant.
	Usage tenant.Recorder
	// Tracer traces requests (nil: none); Decisions records them (nil:
	// none).
	Tracer    *tracing.Tracer
	Decisions *decisions.Recorder
	// KVEvents tunes the subscribers to the KV-cache events of servers
	// whose pool (or endpoint) declares them (see KVEvents).
	KVEvents kvevents.Options
	// PDSigner, when set, signs the prefill server the P/D stage names
	// (x-switchyard-prefiller-sig), for sidecars that require it.
	PDSigner *pdwire.Signer
}

func (o Options) withDefaults() Options {
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = 32 << 20
	}
	if o.MaxEndpoints <= 0 {
		o.MaxEndpoints = 3
	}
	if o.MaxInFlightPerEndpoint == 0 {
		o.MaxInFlightPerEndpoint = 256
	}
	if o.RequestBodyMode == extprocfilterv3.ProcessingMode_NONE {
		o.RequestBodyMode = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if o.ResponseBodyMode == extprocfilterv3.ProcessingMode_NONE {
		o.ResponseBodyMode = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if o.StreamChunkBytes <= 0 {
		o.StreamChunkBytes = 64 << 10
	}
	return o
}

// Server is the ext_proc Endpoint Picker. Create it with New.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	view   registry.View
	opts   Options
	log    *slog.Logger
	debug  bool
	health *health.Server

	// started is the "created" time of every model GET /v1/models lists
	// (OpenAI's field; clients do not rely on it).
	started time.Time

	snap  atomic.Pointer[snapshot]
	loads loads
	// epLatency holds each endpoint's router-measured latency
	// (loadKey -> *latencyHists; see latency.go).
	epLatency sync.Map
	scratch   sync.Pool
	streams   sync.Pool // *stream, see newStream
	stats     counters
	warm      warmCache

	active   atomic.Int64 // open ext_proc streams
	draining atomic.Bool
	// held keeps readiness NOT_SERVING (HoldReadiness) until released.
	held atomic.Bool
	// readyMu orders readiness updates (apply, Drain, ReleaseReadiness).
	readyMu sync.Mutex

	// mesh shares picks with the other replicas (nil: one switchyard).
	mesh *peers.Mesh
	// peerWork holds the prefill work of the other replicas' picks.
	peerWork peerWork
	// tenants keeps the tenants' budgets across states.
	tenants *tenant.Set

	// runCtx is Run's context (nil before Run): admission queues'
	// dispatchers run under it, counted by queues.
	runCtx context.Context
	queues sync.WaitGroup

	// Metrics scraping: the manager exists while Run runs.
	mgr *metrics.Manager
	eh  *EndpointHealth
	// sharing is the manager while it shares scrapes with the other
	// replicas (nil otherwise); ownersMu orders updateOwners.
	sharing  atomic.Pointer[metrics.Manager]
	ownersMu sync.Mutex
	// kv follows the servers' KV-cache events while Run runs (nil
	// otherwise).
	kv atomic.Pointer[kvevents.Manager]

	// stages are the optional stages every snapshot's chains are built
	// from (chain.go).
	stages []stageDef
}

// counters are process-wide request outcomes.
type counters struct {
	requests       atomic.Int64
	picked         atomic.Int64
	rewritten      atomic.Int64
	fallbackServed atomic.Int64
	// responseBodies counts response body messages received: zero for
	// requests whose response body the picker turned off.
	responseBodies atomic.Int64
	// peerPicks counts picks other replicas shared; peerReadings the
	// scrape readings they shared that were published.
	peerPicks    atomic.Int64
	peerReadings atomic.Int64
	// queued counts requests that waited in an admission queue.
	queued   atomic.Int64
	rejected [len(rejectCodes)]atomic.Int64 // by rejectIndex
	decision histogram                      // time to pick (or reject)
}

// New returns a picker reading pool state from view. The current state is
// loaded immediately; call Run to follow later states.
func New(view registry.View, opts Options, logger *slog.Logger) *Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		view:    view,
		opts:    opts.withDefaults(),
		log:     logger,
		debug:   logger.Enabled(context.Background(), slog.LevelDebug),
		health:  health.NewServer(),
		eh:      newEndpointHealth(opts.Health),
		started: time.Now(),
		tenants: tenant.NewSet(),
		stages:  stages(),
	}
	s.scratch.New = func() any { return new(sched.Scratch) }
	s.streams.New = func() any { return new(stream) }
	s.health.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	st, _ := view.Current()
	s.apply(st)
	return s
}

// Register adds the ext_proc service and the gRPC health service to g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
	healthpb.RegisterHealthServer(g, s.health)
}

// GRPCServerOptions returns the grpc.Server options the picker needs: in
// BUFFERED mode Envoy sends a whole body in one message, so the receive
// limit must exceed MaxBodyBytes (gRPC's default is 4 MiB). The flow-control
// windows are what Envoy may send before the picker acknowledges: gRPC-Go's
// 64 KiB defaults (with BDP estimation ramping up slowly) made 200 KiB
// prompts on 200 concurrent streams queue behind window updates, so a
// stream gets 1 MiB and the connection Envoy multiplexes them on 32 MiB.
// The codec is protobuf with buffers that are not zeroed on reuse (see
// codec); the server it configures should serve the picker alone.
func (s *Server) GRPCServerOptions() []grpc.ServerOption {
	limit := s.opts.MaxBodyBytes + 1<<20
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(limit), grpc.MaxSendMsgSize(limit),
		grpc.InitialWindowSize(1 << 20), grpc.InitialConnWindowSize(32 << 20),
		grpc.ForceServerCodecV2(newCodec()),
	}
}

// Health returns the gRPC health server (for callers that register it
// themselves or want to watch it).
func (s *Server) Health() *health.Server { return s.health }

// EndpointHealth reports endpoints whose metrics scrapes are failing; it
// is the registry's health input (register it as a source).
func (s *Server) EndpointHealth() *EndpointHealth { return s.eh }

// Run follows registry states until ctx ends, scraping every endpoint's
// metrics and rebuilding the routing snapshot on each state. On return
// every health service reports NOT_SERVING and scraping has stopped.
func (s *Server) Run(ctx context.Context) error {
	if !s.opts.DisableMetrics {
		mo := s.opts.Metrics
		mo.Logger = s.log.With("component", "metrics")
		mo.OnTransition = s.eh.observe
		mo.OnScrape = func(snap *metrics.Snapshot) {
			if l := s.loads.get(snap.Pool, snap.Address); l != nil {
				l.MarkScrape(snap)
			}
		}
		mo.Demand = func(k metrics.Key) metrics.Demand {
			if l := s.loads.get(k.Pool, k.Address); l != nil {
				return l
			}
			return nil
		}
		shared := s.mesh != nil && s.mesh.SharesReadings()
		if shared {
			// Each endpoint is read by one replica: pass this one's
			// readings on.
			if own := mo.OnReading; own != nil {
				mo.OnReading = func(k metrics.Key, r metrics.Reading) { own(k, r); s.shareReading(k, r) }
			} else {
				mo.OnReading = s.shareReading
			}
		}
		s.mgr = metrics.NewManager(ctx, mo)
		defer func() {
			s.mgr.Stop()
			s.mgr = nil
		}()
		if shared {
			done := make(chan struct{})
			mgr := s.mgr
			s.sharing.Store(mgr)
			go func() {
				defer close(done)
				s.shareScrapes(ctx, mgr)
			}()
			defer func() { <-done }()
		}
	}
	kv := kvevents.NewManager(ctx, s.kvOptions(), kvevents.TokenizerOptions{Busy: s.kvBusy})
	s.kv.Store(kv)
	defer func() {
		kv.Stop()
		s.kv.Store(nil)
	}()
	s.runCtx = ctx
	// The queues' dispatchers end with ctx, rejecting what still waits.
	defer s.queues.Wait()
	var last *registry.State
	for {
		st, changed := s.view.Current()
		if st != last {
			s.apply(st)
			last = st
		}
		select {
		case <-changed:
		case <-ctx.Done():
			s.health.Shutdown()
			return nil
		}
	}
}

func (s *Server) apply(st *registry.State) {
	if st == nil {
		st = registry.Empty()
	}
	d := buildDeps{
		profile:     s.opts.Profile,
		maxInFlight: max(s.opts.MaxInFlightPerEndpoint, 0),
		onBadProfile: func(pool string, err error) {
			s.log.Error("pool scheduling rejected; using the default profile", "pool", pool, "err", err)
		},
	}
	if s.mgr != nil {
		targets := metrics.TargetsFromState(st)
		if s.sharing.Load() != nil {
			s.updateOwners()
		} else {
			// Every replica scrapes every endpoint: they share its
			// budget.
			s.mgr.SetScrapers(len(st.Replicas))
		}
		if err := s.mgr.Sync(targets); err != nil {
			s.log.Warn("metrics targets", "err", err)
		}
		s.eh.setTargets(targets)
		mgr := s.mgr
		d.handle = func(k metrics.Key) sched.MetricsSource {
			if h := mgr.Handle(k); h != nil {
				return h
			}
			return nil
		}
	}
	if kv := s.kv.Load(); kv != nil {
		kv.Sync(kvevents.TargetsFromState(st))
	}
	snap := buildSnapshot(st, &s.loads, d)
	old := s.snap.Load()
	snap.tenants = s.tenants.Build(st, len(st.Replicas))
	s.buildChains(snap)
	s.snap.Store(snap)
	s.syncQueues(st, snap, old)
	s.updateReadiness()
	s.log.Debug("picker state applied", "version", st.Version, "pools", len(snap.pools), "models", len(snap.models))
}

// updateReadiness sets the readiness health services: SERVING once the
// routing snapshot has pools, unless held or draining. Readiness never
// goes back once served: a later empty state keeps the picker answering
// (with 503s) rather than failing Envoy's health checks. A draining
// picker stays NOT_SERVING.
func (s *Server) updateReadiness() {
	s.readyMu.Lock()
	defer s.readyMu.Unlock()
	ready := healthpb.HealthCheckResponse_NOT_SERVING
	if len(s.snap.Load().pools) > 0 && !s.held.Load() {
		ready = healthpb.HealthCheckResponse_SERVING
	}
	if !s.draining.Load() && (ready == healthpb.HealthCheckResponse_SERVING || !s.ready()) {
		s.setReadiness(ready)
	}
}

func (s *Server) setReadiness(st healthpb.HealthCheckResponse_ServingStatus) {
	for _, svc := range []string{HealthReadiness, HealthExtProc, ""} {
		s.health.SetServingStatus(svc, st)
	}
}

// HoldReadiness keeps the readiness health services NOT_SERVING, whatever
// the state, until ReleaseReadiness: a replica that restarts must not take
// Envoy's streams before it serves what it should (internal/ready). Call
// it before Run.
func (s *Server) HoldReadiness() {
	s.readyMu.Lock()
	defer s.readyMu.Unlock()
	s.held.Store(true)
	s.setReadiness(healthpb.HealthCheckResponse_NOT_SERVING)
}

// ReleaseReadiness ends HoldReadiness: readiness follows the state again
// (a draining picker stays NOT_SERVING).
func (s *Server) ReleaseReadiness() {
	s.held.Store(false)
	s.updateReadiness()
}

// Drain reports the picker NOT_SERVING on every health service, so Envoy
// stops opening streams to it (its health checks see it at once), while
// the streams already open go on. A replica drains before it stops.
func (s *Server) Drain() {
	s.readyMu.Lock()
	defer s.readyMu.Unlock()
	s.draining.Store(true)
	s.setReadiness(healthpb.HealthCheckResponse_NOT_SERVING)
}

// ActiveStreams returns the ext_proc streams open now (one per request in
// flight through this picker).
func (s *Server) ActiveStreams() int64 { return s.active.Load() }

func (s *Server) ready() bool {
	r, err := s.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: HealthReadiness})
	return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
}

// Process implements the ext_proc service: one stream per HTTP request,
// Recv -> handle -> Send until Envoy closes the stream.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	s.active.Add(1)
	defer s.active.Add(-1)
	ctx := srv.Context()
	st := s.newStream(ctx)
	defer s.freeStream(st)
	defer st.finish()
	defer st.release()
	for {
		req, err := srv.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			if ctx.Err() != nil || status.Code(err) == codes.Canceled {
				return status.Error(codes.Canceled, "stream cancelled")
			}
			return status.Errorf(codes.Unknown, "receive: %v", err)
		}
		done, err := st.handle(req, srv.Send)
		if err != nil {
			return err
		}
		if done {
			return nil
		}
	}
}

// EndpointStats is one endpoint's live counters.
type EndpointStats struct {
	Pool             string
	Address          string
	Draining         bool
	InFlightRequests int64
	InFlightTokens   int64
	Picked           int64
	Served           int64
	// Models is the endpoint's declared models list (nil: none declared).
	Models []string
	// Metrics is the latest scraped snapshot (nil if not scraped).
	Metrics *metrics.Snapshot
	// PrefillRequests and PrefillTokens are the requests in flight before
	// their first token and their predicted prefill work (profiles that
	// predict TTFT); TTFT is the endpoint's learned TTFT model.
	PrefillRequests, PrefillTokens int64
	TTFT                           sched.TTFTModel
}

// Stats is a point-in-time view for status pages and metrics.
type Stats struct {
	Version        uint64
	Requests       int64
	Picked         int64
	Rewritten      int64
	FallbackServed int64
	// ResponseBodies counts response body messages Envoy sent: only
	// requests whose response the picker rewrites send any.
	ResponseBodies int64
	// PeerPicks counts picks the other replicas shared with this one.
	PeerPicks int64
	// PeerReadings counts the scrape readings other replicas shared that
	// this one published (-share-scrapes).
	PeerReadings int64
	// Rejected counts local replies by HTTP status.
	Rejected  map[int]int64
	Endpoints []EndpointStats // sorted by pool, address
}

// Stats returns the current counters.
func (s *Server) Stats() Stats {
	snap := s.snap.Load()
	out := Stats{
		Version:        snap.version,
		Requests:       s.stats.requests.Load(),
		Picked:         s.stats.picked.Load(),
		Rewritten:      s.stats.rewritten.Load(),
		FallbackServed: s.stats.fallbackServed.Load(),
		ResponseBodies: s.stats.responseBodies.Load(),
		PeerPicks:      s.stats.peerPicks.Load(),
		PeerReadings:   s.stats.peerReadings.Load(),
		Rejected:       map[int]int64{},
	}
	for i, code := range rejectCodes {
		if n := s.stats.rejected[i].Load(); n > 0 {
			out.Rejected[code] = n
		}
	}
	now := time.Now()
	for _, pv := range snap.pools {
		for _, e := range pv.eps {
			out.Endpoints = append(out.Endpoints, EndpointStats{
				PrefillRequests: e.Load.PrefillRequests.Load(), PrefillTokens: e.Load.PrefillTokens.Load(),
				TTFT: e.TTFTModel(now),
				Pool: e.Pool, Address: e.Address, Draining: e.Draining,
				InFlightRequests: e.Load.InFlightRequests.Load(),
				InFlightTokens:   e.Load.InFlightTokens.Load(),
				Picked:           e.Load.Picked.Load(),
				Served:           e.Load.Served.Load(),
				Models:           e.Models,
				Metrics:          e.Snapshot(),
			})
		}
	}
	sort.Slice(out.Endpoints, func(i, j int) bool {
		a, b := out.Endpoints[i], out.Endpoints[j]
		if a.Pool != b.Pool {
			return a.Pool < b.Pool
		}
		return a.Address < b.Address
	})
	return out
}

func randN(n int) int { return rand.IntN(n) }
