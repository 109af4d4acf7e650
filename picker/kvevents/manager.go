package kvevents

import (
	"context"
	"errors"
	"net"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"

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
			t := Target{Pool: name, Address: ep.Address, Topic: kv.Topic, APIKey: p.UpstreamAPIKey,
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
// Index and Tokenizer. Sync it with the registry's targets on every
// state; requests call Prepare.
type Manager struct {
	opts    Options
	tokOpts TokenizerOptions
	ctx     context.Context
	cancel  context.CancelFunc

	mu      sync.Mutex
	stopped bool
	subs    map[subKey]*running
	// pools is replaced, never changed, by Sync: requests read it with
	// one atomic load.
	pools atomic.Pointer[map[string]*poolEntry]
	wg    sync.WaitGroup
}

type poolEntry struct {
	index *Index
	tok   *Tokenizer
	key   string // the API key tok was made with
}

type subKey struct{ pool, addr string }

type running struct {
	sub    *subscriber
	cancel context.CancelFunc
	done   chan struct{}
}

// NewManager returns a Manager with no streams; they stop when ctx ends
// or Stop is called. tok configures every pool's Tokenizer (its APIKey
// comes from the targets).
func NewManager(ctx context.Context, opts Options, tok TokenizerOptions) *Manager {
	opts.setDefaults()
	m := &Manager{opts: opts, tokOpts: tok, subs: map[subKey]*running{}}
	m.ctx, m.cancel = context.WithCancel(ctx)
	empty := map[string]*poolEntry{}
	m.pools.Store(&empty)
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
	old := *m.pools.Load()
	pools := make(map[string]*poolEntry, len(old))
	want := make(map[subKey]Target, len(targets))
	for _, t := range targets {
		want[subKey{t.Pool, t.Address}] = t
		pe := pools[t.Pool]
		if pe == nil {
			pe = old[t.Pool]
			if pe == nil || pe.key != t.APIKey {
				x := NewIndex()
				if pe != nil {
					x = pe.index
				}
				o := m.tokOpts
				o.APIKey = t.APIKey
				if o.OnUnstable == nil {
					pool, log := t.Pool, m.opts.Logger
					o.OnUnstable = func(model string, chat bool) {
						log.Warn("KV events: the model's stable prompt prefixes are not a prefix of its prompts' tokens (chat template or tokenizer); its requests are matched by whole prompts only",
							"pool", pool, "model", model, "chat", chat)
					}
				}
				tok := NewTokenizer(o)
				tok.pool = t.Pool
				pe = &poolEntry{index: x, tok: tok, key: t.APIKey}
			}
			pools[t.Pool] = pe
		}
	}
	for k, r := range m.subs {
		if t, ok := want[k]; ok && t == r.sub.t {
			continue
		}
		r.cancel()
		<-r.done
		delete(m.subs, k)
		if pe := old[k.pool]; pe != nil {
			pe.index.Remove(k.addr)
		}
	}
	for k, t := range want {
		if m.subs[k] != nil {
			continue
		}
		srv := pools[k.pool].index.Server(k.addr)
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
	m.pools.Store(&pools)
	for name, pe := range old {
		if pools[name] == nil || pools[name].tok != pe.tok {
			pe.tok.Close()
		}
	}
}

// Index returns the pool's Index, or nil when none of its servers
// publishes events.
func (m *Manager) Index(pool string) *Index {
	if pe := (*m.pools.Load())[pool]; pe != nil {
		return pe.index
	}
	return nil
}

// Tokenizer returns the pool's Tokenizer, or nil when none of its
// servers publishes events.
func (m *Manager) Tokenizer(pool string) *Tokenizer {
	if pe := (*m.pools.Load())[pool]; pe != nil {
		return pe.tok
	}
	return nil
}

// ErrNoEvents: the pool has no server publishing KV events.
var ErrNoEvents = errors.New("no KV events for the pool")

// Prepare turns a request for pool into a Query of its Index, without
// waiting for any server: the prompt's token ids as the engines compute
// them, from the pool's Tokenizer cache (Tokenizer.Lookup): the whole
// prompt's, or its longest stable prefix's (the Query then tells what
// each server holds of that prefix; Query.Bounded). When neither is
// cached it fails with ErrPending and a background call to the least
// busy of servers (the request's candidates) fetches the prefix for the
// requests that follow. It also fails with ErrNoEvents for a pool
// without events, ErrNoPrefix or ErrUnsupported for a request that
// cannot be matched exactly; the caller then uses its estimate alone.
// The caller consults the Query while scheduling and Releases it.
func (m *Manager) Prepare(_ context.Context, pool string, servers []string, p Prompt) (*Query, error) {
	pe := (*m.pools.Load())[pool]
	if pe == nil {
		return nil, ErrNoEvents
	}
	tok, err := pe.tok.Lookup(servers, p)
	if err != nil {
		return nil, err
	}
	q := pe.index.NewQuery(tok.IDs, tok.Adapter, tok.Salt)
	if tok.Prefix {
		q.prefix, q.total = true, tok.Total
	}
	return q, nil
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
	for _, pe := range *m.pools.Load() {
		pe.tok.Close()
	}
}
