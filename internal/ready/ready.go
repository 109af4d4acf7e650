// Package ready decides when a switchyard reports itself ready: on its
// /readyz (which Consul checks), on the picker's readiness health services
// (which Envoy's picker cluster checks) and on the ADS health service
// (which Envoy's xDS cluster checks). Ready means serving what it should
// serve: an xDS snapshot translated from what its sources say now (not
// only the state a previous run persisted), and, when other replicas
// serve the same configuration, the same ClusterLoadAssignment versions
// as every one of them that is ready (xDS versions are content
// addresses: equal versions, equal endpoints and pickers). A replica that
// is alone, or whose peers do not answer, is ready on its own snapshot.
// Readiness is decided once, at start: a later change of what the others
// serve (a configuration change reaching replicas a few milliseconds
// apart) never takes a ready replica out. A bound keeps a replica that
// cannot agree (its peers run another configuration) from waiting
// forever; it is then ready with a warning saying what differs.
package ready

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults for Options.
const (
	DefaultTimeout    = 10 * time.Second
	DefaultPoll       = 50 * time.Millisecond
	DefaultAskTimeout = 500 * time.Millisecond
)

// Peer is what another replica says it serves.
type Peer struct {
	// Ready is whether it reports itself ready; only ready peers are
	// compared with.
	Ready bool
	// Versions are its xDS versions by resource type.
	Versions map[string]string
}

// Options configure a Gate. Served is required.
type Options struct {
	// Served returns the xDS versions this process serves, by resource
	// type (empty: no snapshot yet), and whether they were translated from
	// a state its sources produced in this run (false: the persisted
	// state, served until they answer).
	Served func() (versions map[string]string, fromSources bool)
	// Peers returns the picker addresses of the other replicas (none:
	// one switchyard).
	Peers func() []string
	// Ask asks the replica at addr what it serves; an error (it is down,
	// or too old to answer) leaves it out of the comparison.
	Ask func(ctx context.Context, addr string) (Peer, error)
	// Compare names the resource types whose versions must equal every
	// ready peer's (default ClusterLoadAssignment: the endpoints and the
	// pickers; listeners, routes and clusters also follow the binary's
	// translation, which a rolling upgrade may change).
	Compare []string
	// Timeout bounds the wait, from Run: past it the process is ready as
	// soon as it serves any snapshot (DefaultTimeout).
	Timeout time.Duration
	// Poll is how often the conditions are looked at (DefaultPoll);
	// AskTimeout bounds one question to a peer (DefaultAskTimeout).
	Poll, AskTimeout time.Duration
	// Logger defaults to a discarding one.
	Logger *slog.Logger
}

// Gate is the readiness decision. Create it with New and Run it.
type Gate struct {
	opts   Options
	ready  atomic.Bool
	reason atomic.Pointer[string]

	mu    sync.Mutex
	hooks []func()
}

// New returns a Gate, not ready.
func New(o Options) *Gate {
	if len(o.Compare) == 0 {
		o.Compare = []string{"ClusterLoadAssignment"}
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Poll <= 0 {
		o.Poll = DefaultPoll
	}
	if o.AskTimeout <= 0 {
		o.AskTimeout = DefaultAskTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	g := &Gate{opts: o}
	g.setReason("starting")
	return g
}

// Ready reports whether the process is ready. Once true it stays true.
func (g *Gate) Ready() bool { return g.ready.Load() }

// Reason says why the process is not ready yet ("" once it is).
func (g *Gate) Reason() string {
	if g.Ready() {
		return ""
	}
	return *g.reason.Load()
}

func (g *Gate) setReason(r string) { g.reason.Store(&r) }

// OnReady registers fn to run once the process is ready (at once when it
// already is). Hooks must not block.
func (g *Gate) OnReady(fn func()) {
	g.mu.Lock()
	if !g.ready.Load() {
		g.hooks = append(g.hooks, fn)
		g.mu.Unlock()
		return
	}
	g.mu.Unlock()
	fn()
}

// Run looks at the conditions every Poll until they hold (or Timeout
// passed and a snapshot is served), then marks the process ready, runs
// the hooks and waits for ctx to end. It returns nil.
func (g *Gate) Run(ctx context.Context) error {
	start := time.Now()
	t := time.NewTicker(g.opts.Poll)
	defer t.Stop()
	for {
		ok, why := g.check(ctx, time.Since(start) >= g.opts.Timeout)
		if ok {
			if why != "" {
				g.opts.Logger.Warn("ready without agreeing with the other replicas", "after", g.opts.Timeout, "differences", why)
			}
			g.markReady(time.Since(start))
			break
		}
		g.setReason(why)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
	<-ctx.Done()
	return nil
}

func (g *Gate) markReady(after time.Duration) {
	g.mu.Lock()
	g.ready.Store(true)
	hooks := g.hooks
	g.hooks = nil
	g.mu.Unlock()
	g.opts.Logger.Info("ready", "after", after.Round(time.Millisecond))
	for _, fn := range hooks {
		fn()
	}
}

// check evaluates the conditions once. ok means ready; with late set,
// what still differs is returned with it, for the log.
func (g *Gate) check(ctx context.Context, late bool) (ok bool, why string) {
	versions, fromSources := g.opts.Served()
	switch {
	case len(versions) == 0:
		return false, "no xDS snapshot yet"
	case !fromSources && !late:
		return false, "serving the persisted state until the sources answer"
	}
	var peers []string
	if g.opts.Peers != nil {
		peers = g.opts.Peers()
	}
	if len(peers) == 0 || g.opts.Ask == nil {
		return true, ""
	}
	diffs := g.compare(ctx, peers, versions)
	if len(diffs) == 0 {
		return true, ""
	}
	why = strings.Join(diffs, "; ")
	if late {
		return true, why
	}
	return false, "serving other versions than ready replicas: " + why
}

// compare asks every peer at once and lists how the ready ones differ.
func (g *Gate) compare(ctx context.Context, peers []string, mine map[string]string) []string {
	actx, cancel := context.WithTimeout(ctx, g.opts.AskTimeout)
	defer cancel()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		diffs []string
	)
	for _, addr := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := g.opts.Ask(actx, addr)
			if err != nil || !p.Ready {
				return
			}
			for _, typ := range g.opts.Compare {
				if p.Versions[typ] != mine[typ] {
					mu.Lock()
					diffs = append(diffs, fmt.Sprintf("%s serves %s %s, this replica %s", addr, typ, p.Versions[typ], mine[typ]))
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	slices.Sort(diffs)
	return diffs
}
