// Package consul owns Consul service discovery: Source, the registry.Source
// that turns the healthy instances of Consul services into the endpoints of
// pools whose configuration says `consul { service = ... }`
// (registry.Pool.Consul).
//
// # How it works
//
// The source is told what to watch (Wants: the pools whose configuration
// has a consul block, and the service switchyard replicas register as);
// serve derives Wants from the configuration at start and hands every
// reloaded configuration's Wants to Apply, as Prometheus applies its
// configuration to its discoverers: the source never reads the registry it
// feeds. For every distinct registry.ConsulSelector it runs one watcher
// doing Consul blocking queries
// on /v1/health/service/<service> (tag, datacenter and passing-only filter
// from the selector), so a registration, deregistration or health change
// reaches the registry as soon as Consul answers, typically well under a
// second. Selectors that appear or disappear on reload start or stop
// watchers. Each change is sent as the source's full contribution:
// Update.Endpoints, pool name -> endpoints, with Endpoint.Source "consul".
//
// When Consul cannot be reached the source keeps its last members in force
// (it sends Update{Err}, never an empty update), retries with jittered
// exponential back-off (100 ms doubling to 5 s), and resumes blocking
// queries once Consul answers again. Status reports each watcher's sync
// state. A blocking-query index that goes backwards (a Consul cluster
// rebuilt or restarted in dev mode) resets the watcher to a full read.
//
// # Service-meta convention
//
// A model server registers itself as a Consul service (see
// examples/consul/vllm-llama.json) with:
//
//	address  an IP literal (the node address is used when empty); hostnames
//	         are left out with a warning, since Envoy and the picker name
//	         endpoints by "ip:port"
//	port     the OpenAI-compatible HTTP port
//	meta.models        comma-separated model names and LoRA adapters served
//	                   ("meta-llama/Llama-3.1-8B-Instruct,sql-lora")
//	meta.engine        vllm | sglang | trtllm-serve | triton-tensorrt-llm;
//	                   optional, but when set it must equal the pool's
//	                   engine or the instance is left out with a warning
//	meta.metrics_path  optional; overrides the pool's metrics path
//	meta.role          optional: prefill, decode or both (the default); used
//	                   only by pools with a disaggregation block. An unknown
//	                   value leaves the instance out with a warning
//	meta.kv_events_port, meta.kv_events_replay_port, meta.kv_events_topic
//	                   optional; the instance publishes KV-cache events
//	                   (vLLM --kv-events-config), overriding the pool's
//	                   kv_events block
//	check    an HTTP check on /health with a short interval (1s); a
//	         critical check takes the instance out (no
//	         deregister_critical_service_after for agent definition files:
//	         Consul would reap the service and never re-register it)
//
// # Health
//
// An instance's checks are aggregated: passing and warning instances are
// members; an instance in maintenance mode (`consul maint -enable
// -service ID`) is kept but Draining (no new requests, removed from EDS);
// a critical instance (and, with passing_only, a warning one) is sent
// marked Critical, and the registry leaves it out unless its discovery
// guard holds it: when one answer would take more than a share of a
// pool's ready endpoints out at once (a restarted agent re-registers its
// services with critical checks until they first pass), they stay for a
// grace period while their metrics scrapes succeed (registry.Guard).
// Queries never filter on passing, so a failing instance is told apart
// from a deregistered one; deregistration is never delayed. Without
// passing_only the rules match Consul DNS.
//
// # Configuration
//
// The Consul agent address, ACL token and TLS settings come from the
// standard environment variables (CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN,
// CONSUL_HTTP_TOKEN_FILE, CONSUL_HTTP_SSL, CONSUL_CACERT, CONSUL_CAPATH,
// CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, CONSUL_TLS_SERVER_NAME,
// CONSUL_HTTP_SSL_VERIFY); non-empty Options fields override them
// (switchyard serve fills them from the configuration's top-level consul
// block).
//
// Prefer one Consul service per pool to one service with a tag per pool:
// blocking queries are per service, so with a shared service every
// registration wakes every pool's watcher.
package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/registry"
)

// SourceName is the Endpoint.Source of every endpoint this package makes,
// and the name to register the source under.
const SourceName = "consul"

// Defaults for Options.
const (
	DefaultWaitTime   = 30 * time.Second
	DefaultMinBackoff = 100 * time.Millisecond
	DefaultMaxBackoff = 5 * time.Second
	// DefaultMinInterval is the shortest time between the starts of two
	// queries of one watcher, so a query that keeps returning at once
	// (unchanged or zero index) cannot become a busy loop.
	DefaultMinInterval = 50 * time.Millisecond
	// DefaultRebuildSettle: see Options.RebuildSettle.
	DefaultRebuildSettle = 30 * time.Second
)

// firstResultWait is how long a contribution waits for new watchers'
// first answers before it is sent without them.
const firstResultWait = time.Second

// TLSOptions overrides the TLS settings of the Consul HTTP client.
type TLSOptions struct {
	// ServerName is the name to verify the agent's certificate against.
	ServerName string
	// CAFile and CAPath locate the CA certificate(s) to trust.
	CAFile, CAPath string
	// CertFile and KeyFile are the client certificate and key.
	CertFile, KeyFile string
	// InsecureSkipVerify disables certificate verification.
	InsecureSkipVerify bool
}

// Options configures a Source. The zero value uses the Consul environment
// variables and the defaults.
type Options struct {
	// Address of the Consul HTTP API: "host:port", "http://host:port",
	// "https://host:port" or "unix:///path". Default: CONSUL_HTTP_ADDR,
	// else 127.0.0.1:8500.
	Address string
	// Token is the ACL token, or TokenFile a file holding it. Default:
	// CONSUL_HTTP_TOKEN, CONSUL_HTTP_TOKEN_FILE.
	Token, TokenFile string
	// TLS overrides the CONSUL_CACERT... settings field by field.
	TLS TLSOptions
	// AllowStale lets any Consul server answer, not only the leader.
	AllowStale bool
	// WaitTime is the longest a blocking query waits (DefaultWaitTime).
	WaitTime time.Duration
	// MinBackoff and MaxBackoff bound the retry delay after a failed query.
	MinBackoff, MaxBackoff time.Duration
	// MinInterval is the shortest time between two queries of one watcher.
	MinInterval time.Duration
	// RebuildSettle is how long instances that Consul stopped listing in
	// its first answer after an outage or a blocking-index reset (a
	// restarted agent or cluster, still re-registering its services) are
	// reported failing (Critical) rather than deregistered, so the
	// registry's discovery guard may hold them (DefaultRebuildSettle;
	// negative: never).
	RebuildSettle time.Duration
	// InitialIndexes are the blocking-query indexes a previous run reached
	// (from Indexes, persisted by the store together with the state). A
	// watcher whose selector has one contributes, until Consul first
	// answers, the Source "consul" endpoints the view's initial state lists
	// for its pools (and, for the replicas' service, its Source "consul"
	// replicas), so a restored state stays in force even when Consul is
	// unreachable at start. The first query is still a full read: after a
	// restart Consul's index may be lower than the persisted one, and a
	// query blocking on it would hang until WaitTime.
	InitialIndexes map[registry.ConsulSelector]uint64
	// Wants is what to watch from the start (WantsFrom the configuration
	// serve loaded); Apply replaces it.
	Wants Wants
	// Restored is the state a previous run persisted (the store's); with
	// InitialIndexes it supplies each watcher's members until Consul first
	// answers.
	Restored *registry.State
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// NewClient returns a Consul API client for the agent opts name (Address,
// Token, TokenFile, TLS; each set field wins over its CONSUL_HTTP_*
// variable). Other users of the same agent (Connect certificates) share
// these settings.
func NewClient(opts Options) (*api.Client, error) {
	cfg := api.DefaultConfig()
	if opts.Address != "" {
		cfg.Address = opts.Address
	}
	switch {
	case opts.Token != "":
		cfg.Token, cfg.TokenFile = opts.Token, ""
	case opts.TokenFile != "":
		cfg.Token, cfg.TokenFile = "", opts.TokenFile
	}
	t := opts.TLS
	for dst, src := range map[*string]string{
		&cfg.TLSConfig.Address: t.ServerName, &cfg.TLSConfig.CAFile: t.CAFile, &cfg.TLSConfig.CAPath: t.CAPath,
		&cfg.TLSConfig.CertFile: t.CertFile, &cfg.TLSConfig.KeyFile: t.KeyFile,
	} {
		if src != "" {
			*dst = src
		}
	}
	if t.InsecureSkipVerify {
		cfg.TLSConfig.InsecureSkipVerify = true
	}
	if t != (TLSOptions{}) && !strings.Contains(cfg.Address, "://") {
		cfg.Scheme = "https"
	}
	client, err := api.NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("consul: client for %s: %w", cfg.Address, err)
	}
	return client, nil
}

// fetchFunc runs one health query: the instances of sel, and the index to
// block on next.
type fetchFunc func(ctx context.Context, sel registry.ConsulSelector, waitIndex uint64) ([]*api.ServiceEntry, uint64, error)

// Wants is what the Source watches: the pools that take members from
// Consul, and the Consul service switchyard replicas register as ("" for
// none).
type Wants struct {
	Pools    map[string]PoolWant
	Replicas string
}

// PoolWant is what one pool asks of Consul.
type PoolWant struct {
	Selector registry.ConsulSelector
	Engine   registry.Engine // the pool's engine (meta.engine must match)
}

// WantsFrom derives Wants from a configuration: every pool with a consul
// block, and the replicas block's consul_service.
func WantsFrom(s *registry.State) Wants {
	w := Wants{Pools: map[string]PoolWant{}}
	if s == nil {
		return w
	}
	for name, p := range s.Pools {
		if p.Consul != nil {
			eng := p.Engine
			if eng == "" {
				eng = registry.EngineVLLM
			}
			w.Pools[name] = PoolWant{Selector: *p.Consul, Engine: eng}
		}
	}
	if rd := s.ReplicaDiscovery; rd != nil {
		w.Replicas = rd.ConsulService
	}
	return w
}

// replicaSelector is the query of the replicas' service: passing
// instances only (a replica whose /readyz fails is not one).
func replicaSelector(service string) registry.ConsulSelector {
	return registry.ConsulSelector{Service: service, PassingOnly: true}
}

// Source is the Consul registry.Source. Create it with New; Run it once.
type Source struct {
	opts Options
	log  *slog.Logger
	// fetch is the Consul query; tests replace it.
	fetch fetchFunc

	wake chan struct{} // 1-buffered: a watcher has news

	mu       sync.Mutex
	watchers map[registry.ConsulSelector]*watcher
	wants    Wants
	wantsGen uint64 // bumped by Apply
}

// Apply replaces what the source watches (a reloaded configuration):
// watchers for selectors no longer wanted stop, new ones start.
func (s *Source) Apply(w Wants) {
	s.mu.Lock()
	s.wants = w
	s.wantsGen++
	s.mu.Unlock()
	s.notify()
}

var _ registry.Source = (*Source)(nil)

// New returns a Source watching opts.Wants (until Apply changes them) and
// querying Consul as opts say. It fails only on unusable client settings
// (for example unreadable TLS files); an unreachable Consul is a runtime
// condition Run retries.
func New(opts Options) (*Source, error) {
	client, err := NewClient(opts)
	if err != nil {
		return nil, err
	}
	s := newSource(opts, nil)
	health := client.Health()
	s.fetch = func(ctx context.Context, sel registry.ConsulSelector, waitIndex uint64) ([]*api.ServiceEntry, uint64, error) {
		// A blocking query answers within WaitTime plus Consul's jitter
		// (WaitTime/16); the extra margin bounds a black-holed connection.
		ctx, cancel := context.WithTimeout(ctx, s.opts.WaitTime+s.opts.WaitTime/16+5*time.Second)
		defer cancel()
		q := (&api.QueryOptions{
			Datacenter: sel.Datacenter,
			AllowStale: s.opts.AllowStale,
			WaitIndex:  waitIndex,
			WaitTime:   s.opts.WaitTime,
		}).WithContext(ctx)
		// Every instance, passing or not: convert applies passing_only
		// itself, so a failing instance is told apart from one that was
		// deregistered (the registry's discovery guard needs the
		// difference).
		entries, meta, err := health.Service(sel.Service, sel.Tag, false, q)
		if err != nil {
			return nil, 0, err
		}
		return entries, meta.LastIndex, nil
	}
	return s, nil
}

// newSource builds a Source around fetch with defaults filled in.
func newSource(opts Options, fetch fetchFunc) *Source {
	if opts.WaitTime <= 0 {
		opts.WaitTime = DefaultWaitTime
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = DefaultMinBackoff
	}
	if opts.MaxBackoff < opts.MinBackoff {
		opts.MaxBackoff = max(DefaultMaxBackoff, opts.MinBackoff)
	}
	if opts.MinInterval <= 0 {
		opts.MinInterval = DefaultMinInterval
	}
	if opts.RebuildSettle == 0 {
		opts.RebuildSettle = DefaultRebuildSettle
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Source{
		opts:     opts,
		wants:    opts.Wants,
		log:      opts.Logger.With("source", SourceName),
		fetch:    fetch,
		wake:     make(chan struct{}, 1),
		watchers: map[registry.ConsulSelector]*watcher{},
	}
}

// SelectorStatus is the sync state of one selector's watcher.
type SelectorStatus struct {
	Selector registry.ConsulSelector
	// Pools are the pools using the selector, sorted.
	Pools []string
	// Up is true when the latest query succeeded.
	Up bool
	// Index is the blocking-query index reached (0 before the first answer).
	Index uint64
	// Instances is how many instances the latest answer listed.
	Instances int
	// LastSuccess is when Consul last answered (zero if never).
	LastSuccess time.Time
	// LastError is the latest query's error (nil when Up).
	LastError error
	// Restored is true while the watcher still serves the endpoints restored
	// from the initial state, before Consul's first answer.
	Restored bool
}

// Status returns the sync state of every watcher, sorted by service, tag,
// datacenter.
func (s *Source) Status() []SelectorStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]SelectorStatus, 0, len(s.watchers))
	for sel, w := range s.watchers {
		out = append(out, SelectorStatus{
			Selector: sel, Pools: slices.Clone(w.pools), Up: w.up, Index: w.index,
			Instances: len(w.entries), LastSuccess: w.lastSuccess, LastError: w.lastErr,
			Restored: w.seed != nil && !w.answered,
		})
	}
	sort.Slice(out, func(i, j int) bool { return selectorLess(out[i].Selector, out[j].Selector) })
	return out
}

// Indexes returns the blocking-query index each running watcher has
// reached, for the store to persist and pass back as
// Options.InitialIndexes. Watchers without an answer yet are left out.
func (s *Source) Indexes() map[registry.ConsulSelector]uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[registry.ConsulSelector]uint64{}
	for sel, w := range s.watchers {
		if w.index > 0 {
			out[sel] = w.index
		}
	}
	return out
}

func selectorLess(a, b registry.ConsulSelector) bool {
	if a.Service != b.Service {
		return a.Service < b.Service
	}
	if a.Tag != b.Tag {
		return a.Tag < b.Tag
	}
	if a.Datacenter != b.Datacenter {
		return a.Datacenter < b.Datacenter
	}
	return !a.PassingOnly && b.PassingOnly
}

// Run implements registry.Source.
func (s *Source) Run(ctx context.Context, up chan<- registry.Update) {
	var wg sync.WaitGroup
	defer func() {
		s.mu.Lock()
		for _, w := range s.watchers {
			w.cancel()
		}
		s.mu.Unlock()
		wg.Wait()
	}()

	send := func(u registry.Update) bool {
		select {
		case up <- u:
			return true
		case <-ctx.Done():
			return false
		}
	}

	var (
		gen      uint64 = 1<<64 - 1 // no wants reconciled yet
		wants    Wants
		sent     bool
		lastSent registry.Update
		lastErr  string // the error the Manager holds for us ("" none)
		lastWarn []string
		first    = time.NewTimer(time.Hour)
		firstDue bool // the first-answer timer has fired
	)
	first.Stop()
	defer first.Stop()

	for {
		s.mu.Lock()
		cur, curGen := s.wants, s.wantsGen
		s.mu.Unlock()
		if curGen != gen {
			gen, wants = curGen, cur
			if s.reconcile(ctx, &wg, wants) {
				firstDue = false
				first.Reset(firstResultWait)
			}
		}

		if firstDue || !s.awaitingFirst() {
			u, warnings := s.build(wants)
			if !slices.Equal(warnings, lastWarn) {
				for _, w := range warnings {
					s.log.Warn("consul instance not used", "reason", w)
				}
				lastWarn = warnings
			}
			downErr := s.downError()
			if !sent || lastErr != "" && downErr == nil || !reflect.DeepEqual(u, lastSent) {
				if !send(u) {
					return
				}
				sent, lastSent, lastErr = true, u, ""
			}
			if downErr != nil && downErr.Error() != lastErr {
				if !send(registry.Update{Source: SourceName, Err: downErr}) {
					return
				}
				lastErr = downErr.Error()
			}
		}

		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-first.C:
			firstDue = true
		}
	}
}

// reconcile starts watchers for new selectors, stops the ones nothing
// wants any more and records which pools (and whether the replicas) use
// each. It reports whether it started a watcher.
func (s *Source) reconcile(ctx context.Context, wg *sync.WaitGroup, wants Wants) bool {
	bySel := map[registry.ConsulSelector][]string{}
	for name, pw := range wants.Pools {
		bySel[pw.Selector] = append(bySel[pw.Selector], name)
	}
	var replicas registry.ConsulSelector
	if wants.Replicas != "" {
		replicas = replicaSelector(wants.Replicas)
		if _, ok := bySel[replicas]; !ok {
			bySel[replicas] = nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	started := false
	for sel, w := range s.watchers {
		if _, ok := bySel[sel]; !ok {
			w.cancel()
			delete(s.watchers, sel)
			s.log.Info("consul watch stopped", "service", sel.Service, "tag", sel.Tag, "datacenter", sel.Datacenter)
		}
	}
	for sel, names := range bySel {
		sort.Strings(names)
		isReplicas := wants.Replicas != "" && sel == replicas
		if w, ok := s.watchers[sel]; ok {
			w.pools, w.replicas = names, isReplicas
			continue
		}
		wctx, cancel := context.WithCancel(ctx)
		w := &watcher{sel: sel, pools: names, replicas: isReplicas, cancel: cancel}
		if idx, ok := s.opts.InitialIndexes[sel]; ok && idx > 0 && s.opts.Restored != nil {
			w.initialIndex = idx
			w.seed = restored(s.opts.Restored, names)
			if isReplicas {
				w.seedReplicas = restoredReplicas(s.opts.Restored)
			}
		}
		s.watchers[sel] = w
		started = true
		s.log.Info("consul watch started", "service", sel.Service, "tag", sel.Tag, "datacenter", sel.Datacenter,
			"passing_only", sel.PassingOnly, "pools", names, "replicas", isReplicas, "initial_index", w.initialIndex)
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.watch(wctx, w)
		}()
	}
	return started
}

// restored returns the Source "consul" endpoints st lists for pools.
func restored(st *registry.State, pools []string) map[string][]registry.Endpoint {
	out := map[string][]registry.Endpoint{}
	for _, name := range pools {
		p, ok := st.Pools[name]
		if !ok {
			continue
		}
		for _, ep := range p.Endpoints {
			if ep.Source == SourceName {
				ep.Models = slices.Clone(ep.Models)
				out[name] = append(out[name], ep)
			}
		}
	}
	return out
}

// restoredReplicas returns the Source "consul" replicas st lists.
func restoredReplicas(st *registry.State) []registry.Replica {
	var out []registry.Replica
	for _, r := range st.Replicas {
		if r.Source == SourceName {
			out = append(out, r)
		}
	}
	return out
}

// awaitingFirst reports whether a watcher has neither answered nor failed
// yet (and has no restored endpoints to stand in).
func (s *Source) awaitingFirst() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, w := range s.watchers {
		if !w.answered && w.attempts == 0 && w.seed == nil {
			return true
		}
	}
	return false
}

// build makes the contribution: every Consul pool's endpoints, and the
// replicas registered in Consul.
func (s *Source) build(wants Wants) (registry.Update, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	u := registry.Update{Source: SourceName, Endpoints: map[string][]registry.Endpoint{}}
	var warnings []string
	for _, name := range sortedNames(wants.Pools) {
		pw := wants.Pools[name]
		w, ok := s.watchers[pw.Selector]
		if !ok {
			continue
		}
		if !w.answered {
			if eps := w.seed[name]; len(eps) > 0 {
				u.Endpoints[name] = eps
			}
			continue
		}
		eps, warn := convert(w.current(time.Now()), pw.Selector, pw.Engine)
		for _, m := range warn {
			warnings = append(warnings, fmt.Sprintf("pool %q: %s", name, m))
		}
		if len(eps) > 0 {
			u.Endpoints[name] = eps
		}
	}
	if wants.Replicas != "" {
		switch w, ok := s.watchers[replicaSelector(wants.Replicas)]; {
		case ok && w.answered:
			reps, warn := convertReplicas(w.entries)
			u.Replicas = reps
			warnings = append(warnings, warn...)
		case ok:
			u.Replicas = slices.Clone(w.seedReplicas)
		}
	}
	return u, warnings
}

// downError joins the errors of the watchers whose latest query failed.
func (s *Source) downError() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	sels := make([]registry.ConsulSelector, 0, len(s.watchers))
	for sel, w := range s.watchers {
		if w.lastErr != nil {
			sels = append(sels, sel)
		}
	}
	sort.Slice(sels, func(i, j int) bool { return selectorLess(sels[i], sels[j]) })
	for _, sel := range sels {
		errs = append(errs, fmt.Errorf("consul service %q: %w", describe(sel), s.watchers[sel].lastErr))
	}
	return errors.Join(errs...)
}

// describe spells a selector for messages: "vllm" or "llama-8b.vllm@dc1".
func describe(sel registry.ConsulSelector) string {
	d := sel.Service
	if sel.Tag != "" {
		d = sel.Tag + "." + d
	}
	if sel.Datacenter != "" {
		d += "@" + sel.Datacenter
	}
	return d
}

func sortedNames(m map[string]PoolWant) []string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
