package kvevents

import (
	"context"
	"net"
	"sort"
	"strconv"
	"sync"

	"github.com/switchyard/switchyard/registry"
)

// TargetsFromState lists the event streams of every endpoint whose pool
// (or itself) declares KV events, draining endpoints left out, sorted by
// pool and address.
func TargetsFromState(st *registry.State) []Target {
	if st == nil {
		return nil
	}
	var out []Target
	for _, name := range st.PoolNames() {
		p := st.Pools[name]
		for _, ep := range p.Endpoints {
			kv := ep.EffectiveKVEvents(p)
			if kv == nil || ep.Draining {
				continue
			}
			host, _, err := net.SplitHostPort(ep.Address)
			if err != nil {
				continue // Validate refuses such addresses
			}
			t := Target{Pool: name, Address: ep.Address, Topic: kv.Topic,
				Endpoint: "tcp://" + net.JoinHostPort(host, strconv.Itoa(kv.Port))}
			if kv.ReplayPort != 0 {
				t.Replay = "tcp://" + net.JoinHostPort(host, strconv.Itoa(kv.ReplayPort))
			}
			out = append(out, t)
		}
	}
	return out
}

// Manager runs one subscriber per event stream and keeps each pool's
// Index. Sync it with the registry's targets on every state.
type Manager struct {
	opts   Options
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	stopped bool
	pools   map[string]*Index
	subs    map[subKey]*running
	wg      sync.WaitGroup
}

type subKey struct{ pool, addr string }

type running struct {
	sub    *subscriber
	cancel context.CancelFunc
	done   chan struct{}
}

// NewManager returns a Manager with no streams; they stop when ctx ends
// or Stop is called.
func NewManager(ctx context.Context, opts Options) *Manager {
	opts.setDefaults()
	m := &Manager{opts: opts, pools: map[string]*Index{}, subs: map[subKey]*running{}}
	m.ctx, m.cancel = context.WithCancel(ctx)
	return m
}

// Sync makes the followed streams equal to targets: new ones start,
// missing ones stop (their servers leave their Index), changed ones
// restart with an empty view. A pool left without streams loses its
// Index.
func (m *Manager) Sync(targets []Target) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stopped {
		return
	}
	want := make(map[subKey]Target, len(targets))
	for _, t := range targets {
		want[subKey{t.Pool, t.Address}] = t
	}
	for k, r := range m.subs {
		if t, ok := want[k]; ok && t == r.sub.t {
			continue
		}
		r.cancel()
		<-r.done
		delete(m.subs, k)
		if x := m.pools[k.pool]; x != nil {
			x.Remove(k.addr)
		}
	}
	for k, t := range want {
		if m.subs[k] != nil {
			continue
		}
		x := m.pools[k.pool]
		if x == nil {
			x = NewIndex()
			m.pools[k.pool] = x
		}
		srv := x.Server(k.addr)
		if srv == nil {
			m.opts.Logger.Warn("KV events: too many servers in the pool; the estimating index serves this one", "pool", k.pool, "endpoint", k.addr, "max", MaxServers)
			continue
		}
		srv.SetState(Connecting)
		ctx, cancel := context.WithCancel(m.ctx)
		r := &running{sub: newSubscriber(t, srv, &m.opts), cancel: cancel, done: make(chan struct{})}
		m.subs[k] = r
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			defer close(r.done)
			r.sub.run(ctx)
		}()
	}
	for name := range m.pools {
		used := false
		for k := range m.subs {
			used = used || k.pool == name
		}
		if !used {
			delete(m.pools, name)
		}
	}
}

// Index returns the pool's Index, or nil when none of its servers
// publishes events.
func (m *Manager) Index(pool string) *Index {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pools[pool]
}

// Status returns every stream's status, sorted by pool and address.
func (m *Manager) Status() []Status {
	m.mu.Lock()
	subs := make([]*subscriber, 0, len(m.subs))
	for _, r := range m.subs {
		subs = append(subs, r.sub)
	}
	m.mu.Unlock()
	out := make([]Status, 0, len(subs))
	for _, s := range subs {
		st := *s.status.Load()
		st.State = s.srv.State()
		st.Server = s.srv.Stats()
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Pool != out[j].Pool {
			return out[i].Pool < out[j].Pool
		}
		return out[i].Address < out[j].Address
	})
	return out
}

// Stop ends every stream and waits for them.
func (m *Manager) Stop() {
	m.mu.Lock()
	m.stopped = true
	m.cancel()
	m.mu.Unlock()
	m.wg.Wait()
}
