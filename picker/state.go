package picker

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/switchyard/switchyard/picker/admission"
	"github.com/switchyard/switchyard/picker/metrics"
	pdpick "github.com/switchyard/switchyard/picker/pd"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/registry"
)

// snapshot is the immutable routing view handlers read through an
// atomic.Pointer; it is rebuilt on every registry state.
type snapshot struct {
	version uint64
	pools   map[string]*poolView
	models  map[string]*modelView
	// unknownPool receives requests for models nobody declared
	// (routing.default_pool); nil means 404.
	unknownPool *poolView
	// headerOnlyPool receives requests without a model (GET /health; GET
	// /v1/models is answered by the picker itself):
	// routing.default_pool, else the only pool, else the first by name.
	headerOnlyPool *poolView
	// tenants authenticates requests (nil: no tenants, no checks).
	tenants *tenant.Table
	// chain is the server's optional stages: every request's until its
	// pool is known (chain.go).
	chain chain
}

type poolView struct {
	name      string
	nameBytes []byte // header value, shared read-only
	eps       []*sched.Endpoint
	ready     []*sched.Endpoint // eps not draining
	byAddr    map[string]*sched.Endpoint
	profile   *sched.Profile
	state     *poolState
	// What the profile (and the P/D stage) needs from the request.
	usesPrefix bool
	// profileLearns: the profile records picks in the prefix index.
	profileLearns bool
	// pd is the pool's disaggregation policy (nil: the pool has no
	// disaggregation block; pd.go).
	pd *pdPool
	// predictor is the profile's TTFT scorer (nil: none): picks account
	// their prefill work and first tokens teach the endpoints' models.
	predictor     *sched.TTFTScorer
	usesSession   bool
	sessionHeader string
	// admission is the pool's admission block (zero: the defaults).
	admission registry.Admission
	// upstreamKey is the API key sent to the pool's servers ("" none).
	upstreamKey string
	// tables are what decision records share (insight.go).
	tables recordTables
	// chain is the optional stages of the pool's requests: the server's
	// and the pool's own (chain.go).
	chain chain
}

// poolState is a pool's scheduling memory that survives rebuilds: the
// prefix-cache index, the session table, the hashing scheme and the
// round-robin position.
type poolState struct {
	index    *prefix.Index
	sessions *sched.Sessions
	hasher   atomic.Pointer[poolHasher]
	rr       atomic.Uint64
	// Blocks of routed prompts, and how many of them the chosen endpoint
	// was believed to hold (the prefix index's hit ratio).
	promptBlocks, matchedBlocks atomic.Int64
	// queue is the pool's admission queue (nil before the picker runs);
	// stopQueue ends its dispatcher when the pool goes away.
	queue     atomic.Pointer[admission.Queue]
	stopQueue context.CancelFunc
	// pdDecisions counts the P/D stage's decisions, by
	// pdpick.Reason.Index.
	pdDecisions [len(pdpick.Reasons) + 1]atomic.Int64
}

// poolHasher is a Hasher with the KV block size it was built for.
type poolHasher struct {
	h           prefix.Hasher
	blockTokens int
}

// maxHashBlocks caps the blocks hashed per prompt (the first 4096 tokens
// with 16-token blocks): hashing, matching and recording cost grow with
// it, and the first 4k tokens tell cached prefixes apart in practice.
const maxHashBlocks = prefix.DefaultMaxBlocks

func newPoolState() *poolState {
	ps := &poolState{
		index:    prefix.NewIndex(prefix.Config{}),
		sessions: sched.NewSessions(0, 0),
	}
	ps.setBlockTokens(prefix.DefaultBlockTokens)
	return ps
}

func (ps *poolState) setBlockTokens(n int) {
	ps.hasher.Store(&poolHasher{h: prefix.NewHasher(prefix.HashConfig{BlockTokens: n, MaxBlocks: maxHashBlocks}), blockTokens: n})
}

// learnBlockSize switches the pool's hashing to the block size a server
// reports (vLLM cache_config_info); hashes made with the old size simply
// stop matching and age out of the index.
func (ps *poolState) learnBlockSize(e *sched.Endpoint) {
	s := e.Snapshot()
	if s == nil || s.BlockSize <= 0 {
		return
	}
	if cur := ps.hasher.Load(); cur.blockTokens != s.BlockSize {
		ps.setBlockTokens(s.BlockSize)
	}
}

type modelView struct {
	model *registry.Model
	pool  *poolView
	// targets and cumulative weights for the weighted rewrite choice.
	targets []string
	cum     []int
	// counters[i] counts requests sent to targets[i] (counters[0] the
	// model itself when it has no targets); running its in-flight requests.
	counters []*objectiveCounters
	running  *atomic.Int64
}

// loadKey identifies an endpoint's counters across rebuilds.
type loadKey struct{ pool, addr string }

// loads owns every endpoint's counters and every pool's scheduling state;
// only rebuilds touch the maps.
type loads struct {
	mu    sync.Mutex
	m     map[loadKey]*sched.Load
	pools map[string]*poolState
	// Per-model counters, kept while the model exists.
	objectives map[objKey]*objectiveCounters
	running    map[string]*atomic.Int64
}

// get returns the counters of an endpoint, or nil.
func (ls *loads) get(pool, addr string) *sched.Load {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.m[loadKey{pool, addr}]
}

// buildDeps carries what buildSnapshot needs besides the state.
type buildDeps struct {
	// profile overrides the per-pool profile (tests); nil builds it from
	// the pool's scheduling block.
	profile     func(*registry.Pool) *sched.Profile
	maxInFlight int64
	// handle returns an endpoint's metrics source, or nil.
	handle func(metrics.Key) sched.MetricsSource
	// onBadProfile reports a pool whose scheduling block does not build.
	onBadProfile func(pool string, err error)
}

func buildSnapshot(st *registry.State, ls *loads, d buildDeps) *snapshot {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.m == nil {
		ls.m = map[loadKey]*sched.Load{}
		ls.pools = map[string]*poolState{}
		ls.objectives = map[objKey]*objectiveCounters{}
		ls.running = map[string]*atomic.Int64{}
	}
	seen := make(map[loadKey]bool, len(ls.m))
	snap := &snapshot{
		version: st.Version,
		pools:   make(map[string]*poolView, len(st.Pools)),
		models:  make(map[string]*modelView, len(st.Models)),
	}
	for _, name := range st.PoolNames() {
		p := st.Pools[name]
		ps := ls.pools[name]
		if ps == nil {
			ps = newPoolState()
			ls.pools[name] = ps
		}
		pv := &poolView{name: name, nameBytes: []byte(name), byAddr: make(map[string]*sched.Endpoint, len(p.Endpoints)), state: ps,
			upstreamKey: p.UpstreamAPIKey}
		if p.Disaggregation != nil {
			pv.pd = newPDPool(st, p)
		}
		pv.profile = poolProfile(p, ps, d)
		pv.profileLearns = pv.profile.Uses(sched.ScorerPrefix) || pv.profile.Uses(sched.ScorerTTFT)
		// The P/D stage decides by the prompt's blocks cached on the
		// servers: a disaggregated pool hashes every prompt.
		pv.usesPrefix = pv.profileLearns || pv.pd != nil
		pv.predictor = pv.profile.Predictor()
		pv.usesSession = pv.profile.Uses(sched.ScorerSession)
		pv.sessionHeader = sched.DefaultSessionHeader
		if p.Scheduling != nil && p.Scheduling.SessionHeader != "" {
			pv.sessionHeader = p.Scheduling.SessionHeader
		}
		if p.Admission != nil {
			pv.admission = *p.Admission
		}
		live := make(map[string]bool, len(p.Endpoints))
		for _, e := range p.Endpoints {
			k := loadKey{name, e.Address}
			l := ls.m[k]
			if l == nil {
				l = new(sched.Load)
				ls.m[k] = l
			}
			seen[k] = true
			live[e.Address] = true
			ep := &sched.Endpoint{Pool: name, Address: e.Address, Models: e.Models, Draining: e.Draining, Load: l}
			if pv.pd != nil {
				ep.Role = e.Role
			}
			if d.handle != nil && !e.Draining {
				ep.Metrics = d.handle(metrics.Key{Pool: name, Address: e.Address})
			}
			pv.eps = append(pv.eps, ep)
			// Ready: may take a client's request now (a prefill server
			// never does, so it neither gives a pool room nor saturates it).
			if !ep.Draining && ep.Role.Decodes() {
				pv.ready = append(pv.ready, ep)
			}
			pv.byAddr[e.Address] = ep
		}
		// Forget prefix history of endpoints that left the pool.
		for _, a := range ps.index.Endpoints() {
			if !live[a] {
				ps.index.Remove(a)
			}
		}
		snap.pools[name] = pv
	}
	// Counters of endpoints that left the state are dropped; streams still
	// holding one keep decrementing their own pointer.
	for k := range ls.m {
		if !seen[k] {
			delete(ls.m, k)
		}
	}
	for name := range ls.pools {
		if _, ok := st.Pools[name]; !ok {
			delete(ls.pools, name)
		}
	}
	liveObj := make(map[objKey]bool, len(st.Models))
	for name, m := range st.Models {
		mv := &modelView{model: m, pool: snap.pools[m.Pool]}
		total := 0
		for _, t := range m.Targets {
			if t.Weight <= 0 {
				continue
			}
			total += t.Weight
			mv.targets = append(mv.targets, t.Name)
			mv.cum = append(mv.cum, total)
		}
		mv.running = ls.running[name]
		if mv.running == nil {
			mv.running = new(atomic.Int64)
			ls.running[name] = mv.running
		}
		keys := []objKey{{model: name}}
		if len(mv.targets) > 0 {
			keys = keys[:0]
			for _, t := range mv.targets {
				keys = append(keys, objKey{model: name, target: t})
			}
		}
		for _, k := range keys {
			c := ls.objectives[k]
			if c == nil {
				c = new(objectiveCounters)
				ls.objectives[k] = c
			}
			liveObj[k] = true
			mv.counters = append(mv.counters, c)
		}
		snap.models[name] = mv
	}
	for k := range ls.objectives {
		if !liveObj[k] {
			delete(ls.objectives, k)
		}
	}
	for m := range ls.running {
		if _, ok := st.Models[m]; !ok {
			delete(ls.running, m)
		}
	}
	if dp := st.Routing.DefaultPool; dp != "" {
		snap.unknownPool = snap.pools[dp]
		snap.headerOnlyPool = snap.pools[dp]
	}
	if snap.headerOnlyPool == nil {
		if names := st.PoolNames(); len(names) > 0 {
			snap.headerOnlyPool = snap.pools[names[0]]
		}
	}
	return snap
}

// poolProfile is pool p's scheduling profile; a disaggregated pool's has
// the role filter first, so that its requests go to decode servers only.
func poolProfile(p *registry.Pool, ps *poolState, d buildDeps) *sched.Profile {
	var prof *sched.Profile
	if d.profile != nil {
		prof = d.profile(p)
	} else {
		deps := sched.Deps{Prefix: ps.index, Sessions: ps.sessions, RoundRobin: &ps.rr, MaxInFlightPerEndpoint: d.maxInFlight}
		var err error
		if prof, err = sched.BuildProfile(p.Scheduling, deps); err != nil {
			if d.onBadProfile != nil {
				d.onBadProfile(p.Name, err)
			}
			prof, _ = sched.BuildProfile(nil, deps)
		}
	}
	if p.Disaggregation != nil {
		cp := *prof
		cp.Filters = append([]sched.Filter{sched.RoleFilter{}}, prof.Filters...)
		prof = &cp
	}
	return prof
}

// target picks the upstream model name by weight (r(n) is in [0, n)) and
// returns it with its counters.
func (mv *modelView) target(r func(int) int) (string, *objectiveCounters) {
	if len(mv.targets) == 0 {
		return mv.model.Name, mv.counters[0]
	}
	if len(mv.targets) == 1 {
		return mv.targets[0], mv.counters[0]
	}
	x := r(mv.cum[len(mv.cum)-1])
	for i, c := range mv.cum {
		if x < c {
			return mv.targets[i], mv.counters[i]
		}
	}
	last := len(mv.targets) - 1
	return mv.targets[last], mv.counters[last]
}
