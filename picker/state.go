package picker

import (
	"sync"

	"github.com/switchyard/switchyard/picker/sched"
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
	// headerOnlyPool receives requests without a model (GET /v1/models):
	// routing.default_pool, else the only pool, else the first by name.
	headerOnlyPool *poolView
}

type poolView struct {
	name      string
	nameBytes []byte // header value, shared read-only
	eps       []*sched.Endpoint
	byAddr    map[string]*sched.Endpoint
	profile   *sched.Profile
}

type modelView struct {
	model *registry.Model
	pool  *poolView
	// targets and cumulative weights for the weighted rewrite choice.
	targets []string
	cum     []int
}

// loadKey identifies an endpoint's counters across rebuilds.
type loadKey struct{ pool, addr string }

// loads owns every endpoint's counters; only rebuilds touch the map.
type loads struct {
	mu sync.Mutex
	m  map[loadKey]*sched.Load
}

func buildSnapshot(st *registry.State, ls *loads, profile func(*registry.Pool) *sched.Profile) *snapshot {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.m == nil {
		ls.m = map[loadKey]*sched.Load{}
	}
	seen := make(map[loadKey]bool, len(ls.m))
	snap := &snapshot{
		version: st.Version,
		pools:   make(map[string]*poolView, len(st.Pools)),
		models:  make(map[string]*modelView, len(st.Models)),
	}
	for _, name := range st.PoolNames() {
		p := st.Pools[name]
		pv := &poolView{name: name, nameBytes: []byte(name), byAddr: make(map[string]*sched.Endpoint, len(p.Endpoints)), profile: profile(p)}
		for _, e := range p.Endpoints {
			k := loadKey{name, e.Address}
			l := ls.m[k]
			if l == nil {
				l = new(sched.Load)
				ls.m[k] = l
			}
			seen[k] = true
			ep := &sched.Endpoint{Pool: name, Address: e.Address, Models: e.Models, Draining: e.Draining, Load: l}
			pv.eps = append(pv.eps, ep)
			pv.byAddr[e.Address] = ep
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
		snap.models[name] = mv
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

// target picks the upstream model name by weight; r is in [0, total).
func (mv *modelView) target(r func(int) int) string {
	if len(mv.targets) == 0 {
		return mv.model.Name
	}
	if len(mv.targets) == 1 {
		return mv.targets[0]
	}
	x := r(mv.cum[len(mv.cum)-1])
	for i, c := range mv.cum {
		if x < c {
			return mv.targets[i]
		}
	}
	return mv.targets[len(mv.targets)-1]
}
