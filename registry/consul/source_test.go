package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// answer is one scripted reply of fakeConsul.
type answer struct {
	entries []*api.ServiceEntry
	index   uint64
	err     error
}

// call records one query fakeConsul received.
type call struct {
	service string
	index   uint64
	at      time.Time
}

// fakeConsul is a scripted fetchFunc: each query takes the next answer
// the test queued for its service (blocking like a blocking query until
// there is one), or, when auto is set for the service, returns it at once.
type fakeConsul struct {
	mu    sync.Mutex
	calls []call
	queue map[string]chan answer
	auto  map[string]answer
}

func newFake() *fakeConsul {
	return &fakeConsul{queue: map[string]chan answer{}, auto: map[string]answer{}}
}

func (f *fakeConsul) ch(service string) chan answer {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, ok := f.queue[service]
	if !ok {
		c = make(chan answer, 16)
		f.queue[service] = c
	}
	return c
}

func (f *fakeConsul) reply(service string, a answer) { f.ch(service) <- a }

func (f *fakeConsul) fetch(ctx context.Context, sel registry.ConsulSelector, idx uint64) ([]*api.ServiceEntry, uint64, error) {
	f.mu.Lock()
	f.calls = append(f.calls, call{service: sel.Service, index: idx, at: time.Now()})
	a, auto := f.auto[sel.Service]
	f.mu.Unlock()
	if auto {
		return a.entries, a.index, a.err
	}
	select {
	case a := <-f.ch(sel.Service):
		return a.entries, a.index, a.err
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	}
}

func (f *fakeConsul) callsFor(service string) []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []call
	for _, c := range f.calls {
		if c.service == service {
			out = append(out, c)
		}
	}
	return out
}

// stateWith returns a state with one Consul pool per selector service.
func stateWith(pools map[string]registry.ConsulSelector) *registry.State {
	s := registry.Empty()
	for name, sel := range pools {
		s.Pools[name] = &registry.Pool{Name: name, Engine: registry.EngineVLLM, Consul: &sel, Endpoints: []registry.Endpoint{}}
	}
	return s
}

// runSource runs a Source on fake and returns the channel its updates
// arrive on. The test drives what it watches by publishing configurations
// on view: each one's WantsFrom is applied, as serve applies every
// reloaded configuration.
func runSource(t *testing.T, view registry.View, fake *fakeConsul, opts Options) (*Source, <-chan registry.Update) {
	t.Helper()
	opts.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	st, changed := view.Current()
	opts.Wants = WantsFrom(st)
	if opts.Restored == nil {
		opts.Restored = st
	}
	s := newSource(opts, fake.fetch)
	up := make(chan registry.Update)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-changed:
			}
			st, changed = view.Current()
			s.Apply(WantsFrom(st))
		}
	}()
	go func() { s.Run(ctx, up); close(done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return s, up
}

func next(t *testing.T, up <-chan registry.Update) registry.Update {
	t.Helper()
	select {
	case u := <-up:
		return u
	case <-time.After(5 * time.Second):
		t.Fatal("no update within 5s")
		return registry.Update{}
	}
}

func addrs(u registry.Update, pool string) []string {
	var out []string
	for _, ep := range u.Endpoints[pool] {
		out = append(out, ep.Address)
	}
	return out
}

func wantAddrs(t *testing.T, u registry.Update, pool string, want ...string) {
	t.Helper()
	if u.Err != nil {
		t.Fatalf("got error update %v, want endpoints %v", u.Err, want)
	}
	if got := addrs(u, pool); !slices.Equal(got, want) {
		t.Fatalf("pool %q endpoints = %v, want %v (update %+v)", pool, got, want, u)
	}
}

func TestSourceNoConsulPoolsSendsEmptyAtOnce(t *testing.T) {
	t.Parallel()
	fake := newFake()
	_, up := runSource(t, registry.NewPublisher(nil), fake, Options{})
	u := next(t, up)
	if u.Err != nil || len(u.Endpoints) != 0 || u.Source != SourceName {
		t.Fatalf("first update = %+v, want an empty contribution from %q", u, SourceName)
	}
}

func TestSourceFollowsAnswersAndKeepsMembersWhileDown(t *testing.T) {
	t.Parallel()
	fake := newFake()
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"llama": {Service: "vllm", PassingOnly: true}}))
	s, up := runSource(t, pub, fake, Options{MinBackoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond})

	fake.reply("vllm", answer{index: 10, entries: []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}})
	wantAddrs(t, next(t, up), "llama", "10.0.0.1:8000")

	fake.reply("vllm", answer{index: 11, entries: []*api.ServiceEntry{
		inst("n", "a", "", "10.0.0.1", 8000, nil, ""), inst("n", "b", "", "10.0.0.2", 8000, nil, ""),
	}})
	wantAddrs(t, next(t, up), "llama", "10.0.0.1:8000", "10.0.0.2:8000")

	// An answer with the same content sends nothing; the next change does.
	fake.reply("vllm", answer{index: 12, entries: []*api.ServiceEntry{
		inst("n", "b", "", "10.0.0.2", 8000, nil, ""), inst("n", "a", "", "10.0.0.1", 8000, nil, ""),
	}})
	testutil.Eventually(t, 5*time.Second, "index 12 reached", func() error {
		if got := s.Indexes()[registry.ConsulSelector{Service: "vllm", PassingOnly: true}]; got != 12 {
			return fmt.Errorf("index %d", got)
		}
		return nil
	})

	// Consul goes down: an error update (the Manager keeps the previous
	// contribution), never an empty one.
	down := errors.New("connection refused")
	fake.reply("vllm", answer{err: down})
	u := next(t, up)
	if !errors.Is(u.Err, down) || u.Endpoints != nil {
		t.Fatalf("update while down = %+v, want only Err wrapping %v", u, down)
	}
	st := s.Status()
	if len(st) != 1 || st[0].Up || !errors.Is(st[0].LastError, down) || st[0].Index != 12 || st[0].LastSuccess.IsZero() ||
		!slices.Equal(st[0].Pools, []string{"llama"}) {
		t.Fatalf("Status while down = %+v", st)
	}
	// Repeated failures with the same error send nothing more.
	fake.reply("vllm", answer{err: down})
	fake.reply("vllm", answer{err: down})

	// Back up: the query after a failure is a full read (index 0), and
	// the good answer is sent even though its content did not change, to
	// clear the error.
	fake.reply("vllm", answer{index: 3, entries: []*api.ServiceEntry{
		inst("n", "a", "", "10.0.0.1", 8000, nil, ""), inst("n", "b", "", "10.0.0.2", 8000, nil, ""),
	}})
	wantAddrs(t, next(t, up), "llama", "10.0.0.1:8000", "10.0.0.2:8000")
	calls := fake.callsFor("vllm")
	var idx []uint64
	for _, c := range calls {
		idx = append(idx, c.index)
	}
	if want := []uint64{0, 10, 11, 12, 0, 0, 0}; !slices.Equal(idx[:len(want)], want) {
		t.Errorf("wait indexes = %v, want prefix %v", idx, want)
	}
	if st := s.Status(); !st[0].Up || st[0].LastError != nil || st[0].Index != 3 {
		t.Errorf("Status after recovery = %+v", st)
	}
}

func TestSourceIndexGoingBackwardsResets(t *testing.T) {
	t.Parallel()
	fake := newFake()
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"llama": {Service: "vllm"}}))
	s, up := runSource(t, pub, fake, Options{})
	a := []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}
	b := []*api.ServiceEntry{inst("n", "b", "", "10.0.0.2", 8000, nil, "")}
	fake.reply("vllm", answer{index: 50, entries: a})
	wantAddrs(t, next(t, up), "llama", "10.0.0.1:8000")
	// The index goes backwards: the answer is used, and the next query is
	// a full read instead of blocking on 7 (or 50). Consul was rebuilt,
	// so the instance it no longer lists is reported failing (re-
	// registration pending), not deregistered.
	fake.reply("vllm", answer{index: 7, entries: b})
	u := next(t, up)
	wantAddrs(t, u, "llama", "10.0.0.1:8000", "10.0.0.2:8000")
	if eps := u.Endpoints["llama"]; !eps[0].Critical || eps[1].Critical {
		t.Fatalf("after the reset: %+v, want only the missing instance Critical", eps)
	}
	fake.reply("vllm", answer{index: 8, entries: b})
	testutil.Eventually(t, 5*time.Second, "query blocking on index 8", func() error {
		calls := fake.callsFor("vllm")
		var idx []uint64
		for _, c := range calls {
			idx = append(idx, c.index)
		}
		if want := []uint64{0, 50, 0, 8}; !slices.Equal(idx, want) {
			return fmt.Errorf("wait indexes %v, want %v", idx, want)
		}
		return nil
	})
	if got := s.Indexes(); !reflect.DeepEqual(got, map[registry.ConsulSelector]uint64{{Service: "vllm"}: 8}) {
		t.Errorf("Indexes() = %v", got)
	}
}

func TestSourceNoBusyLoop(t *testing.T) {
	t.Parallel()
	fake := newFake()
	// Consul answering at once with an unchanged index forever.
	fake.auto["vllm"] = answer{index: 5, entries: []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}}
	// And a Consul that fails at once forever.
	fake.auto["broken"] = answer{err: errors.New("500 internal error")}
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"a": {Service: "vllm"}, "b": {Service: "broken"}}))
	const minInterval, lo, hi = 20 * time.Millisecond, 10 * time.Millisecond, 40 * time.Millisecond
	runSource(t, pub, fake, Options{MinInterval: minInterval, MinBackoff: lo, MaxBackoff: hi})

	testutil.Eventually(t, 10*time.Second, "6 queries of each", func() error {
		if n, m := len(fake.callsFor("vllm")), len(fake.callsFor("broken")); n < 6 || m < 6 {
			return fmt.Errorf("%d and %d queries", n, m)
		}
		return nil
	})
	calls := fake.callsFor("vllm")
	for i := 1; i < 6; i++ {
		if gap := calls[i].at.Sub(calls[i-1].at); gap < minInterval {
			t.Errorf("unchanged answers: query %d came %v after the previous, want >= %v", i, gap, minInterval)
		}
	}
	calls = fake.callsFor("broken")
	wantGap := []time.Duration{lo, 2 * lo, hi, hi, hi}
	for i := 1; i < 6; i++ {
		if gap, min := calls[i].at.Sub(calls[i-1].at), wantGap[i-1]*8/10; gap < min {
			t.Errorf("errors: retry %d came %v after the previous, want >= %v (back-off)", i, gap, min)
		}
	}
}

func TestSourceSelectorsFollowTheState(t *testing.T) {
	t.Parallel()
	fake := newFake()
	vllm := registry.ConsulSelector{Service: "vllm", Tag: "llama"}
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"one": vllm, "two": vllm}))
	s, up := runSource(t, pub, fake, Options{})
	fake.reply("vllm", answer{index: 2, entries: []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}})
	u := next(t, up)
	// One watcher serves both pools.
	wantAddrs(t, u, "one", "10.0.0.1:8000")
	wantAddrs(t, u, "two", "10.0.0.1:8000")
	if n := len(fake.callsFor("vllm")); n > 2 {
		t.Errorf("%d queries for a shared selector, want one watcher", n)
	}

	// Reload: pool "two" now uses another service; "one" is removed.
	pub.Publish(stateWith(map[string]registry.ConsulSelector{"two": {Service: "sglang"}}))
	fake.reply("sglang", answer{index: 9, entries: []*api.ServiceEntry{inst("n", "s", "", "10.0.0.9", 8000, nil, "")}})
	u = next(t, up)
	if _, ok := u.Endpoints["one"]; ok || len(u.Endpoints) != 1 {
		t.Fatalf("after reload: %+v, want only pool two", u.Endpoints)
	}
	wantAddrs(t, u, "two", "10.0.0.9:8000")
	st := s.Status()
	if len(st) != 1 || st[0].Selector.Service != "sglang" {
		t.Fatalf("Status after reload = %+v, want only the sglang watcher", st)
	}
}

func TestSourceFirstAnswerWaitsForNewWatchersButNotForever(t *testing.T) {
	t.Parallel()
	fake := newFake()
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"a": {Service: "vllm"}, "b": {Service: "hung"}}))
	start := time.Now()
	_, up := runSource(t, pub, fake, Options{})
	fake.reply("vllm", answer{index: 2, entries: []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}})
	// "hung" never answers: the contribution goes out after
	// firstResultWait with what is known.
	u := next(t, up)
	wantAddrs(t, u, "a", "10.0.0.1:8000")
	if d := time.Since(start); d < firstResultWait*8/10 {
		t.Errorf("first contribution after %v, want it held back about %v for the hung watcher", d, firstResultWait)
	}
}

func TestSourceRestoredStateStandsInUntilConsulAnswers(t *testing.T) {
	t.Parallel()
	fake := newFake()
	sel := registry.ConsulSelector{Service: "vllm"}
	st := stateWith(map[string]registry.ConsulSelector{"llama": sel})
	st.Pools["llama"].Endpoints = []registry.Endpoint{
		{Address: "10.0.0.1:8000", Source: "file"},
		{Address: "10.0.0.7:8000", Source: SourceName, Models: []string{"x"}},
	}
	s, up := runSource(t, registry.NewPublisher(st), fake, Options{InitialIndexes: map[registry.ConsulSelector]uint64{sel: 40}})
	u := next(t, up)
	wantAddrs(t, u, "llama", "10.0.0.7:8000")
	if st := s.Status(); !st[0].Restored {
		t.Errorf("Status = %+v, want Restored", st)
	}
	// Consul unreachable at start: the restored members stay.
	fake.reply("vllm", answer{err: errors.New("no route to host")})
	if u := next(t, up); u.Err == nil {
		t.Fatalf("update = %+v, want an error", u)
	}
	fake.reply("vllm", answer{index: 41, entries: []*api.ServiceEntry{inst("n", "b", "", "10.0.0.8", 8000, nil, "")}})
	wantAddrs(t, next(t, up), "llama", "10.0.0.8:8000")
	if c := fake.callsFor("vllm"); c[0].index != 0 {
		t.Errorf("first query blocked on index %d, want a full read", c[0].index)
	}
}

// TestSourceRestoredReplicasStandInUntilConsulAnswers: the replicas a
// previous run learned from Consul (persisted with its state) are the
// replicas until Consul answers, so a restarted replica's picker cluster
// lists the others from the start.
func TestSourceRestoredReplicasStandInUntilConsulAnswers(t *testing.T) {
	t.Parallel()
	fake := newFake()
	st := registry.Empty()
	st.ReplicaDiscovery = &registry.ReplicaDiscovery{ConsulService: "switchyard"}
	st.Replicas = []registry.Replica{
		{ID: "10.0.0.5:9002", Address: "10.0.0.5:9002", Source: "file"},
		{ID: "sy-1", Address: "10.0.0.9:9002", Admin: "10.0.0.9:9090", Source: SourceName},
	}
	sel := replicaSelector("switchyard")
	_, up := runSource(t, registry.NewPublisher(st), fake, Options{InitialIndexes: map[registry.ConsulSelector]uint64{sel: 7}})
	u := next(t, up)
	if len(u.Replicas) != 1 || u.Replicas[0].ID != "sy-1" || u.Replicas[0].Admin != "10.0.0.9:9090" {
		t.Fatalf("replicas before Consul answered = %+v, want the restored Consul one (sy-1)", u.Replicas)
	}
	fake.reply("switchyard", answer{index: 8, entries: []*api.ServiceEntry{
		inst("n", "sy-2", "", "10.0.0.8", 9002, nil, api.HealthPassing)}})
	u = next(t, up)
	if len(u.Replicas) != 1 || u.Replicas[0].ID != "sy-2" {
		t.Fatalf("replicas once Consul answered = %+v, want Consul's (sy-2)", u.Replicas)
	}
}

// TestSourceWatchesWhatItIsTold: the Wants given at construction are
// watched before any Apply (the first contribution already has the
// members), and an applied configuration without Consul pools empties the
// contribution; the replicas' service is watched too, and its passing
// instances are the replicas.
func TestSourceWatchesWhatItIsTold(t *testing.T) {
	t.Parallel()
	fake := newFake()
	s := newSource(Options{Logger: slog.New(slog.NewTextHandler(t.Output(), nil)),
		Wants: Wants{Pools: map[string]PoolWant{"llama": {Selector: registry.ConsulSelector{Service: "vllm"}, Engine: registry.EngineVLLM}}, Replicas: "switchyard"}},
		fake.fetch)
	up := make(chan registry.Update)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, up); close(done) }()
	defer func() { cancel(); <-done }()
	fake.reply("vllm", answer{index: 3, entries: []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, "")}})
	replica := inst("n", "sy-1", "", "10.0.0.9", 9002, map[string]string{MetaAdmin: "10.0.0.9:9090", MetaXDS: "10.0.0.9:18000"}, api.HealthPassing)
	failing := inst("n", "sy-2", "", "10.0.0.8", 9002, nil, api.HealthCritical)
	fake.reply("switchyard", answer{index: 5, entries: []*api.ServiceEntry{replica, failing}})
	var u registry.Update
	testutil.Eventually(t, 5*time.Second, "members and replicas", func() error {
		select {
		case u = <-up:
		case <-time.After(time.Second):
		}
		if len(u.Endpoints["llama"]) != 1 || len(u.Replicas) != 1 {
			return fmt.Errorf("update %+v", u)
		}
		return nil
	})
	if r := u.Replicas[0]; r.ID != "sy-1" || r.Address != "10.0.0.9:9002" || r.Admin != "10.0.0.9:9090" || r.XDS != "10.0.0.9:18000" || r.Source != SourceName {
		t.Fatalf("replica %+v", r)
	}
	s.Apply(Wants{})
	if u := next(t, up); u.Err != nil || len(u.Endpoints) != 0 || len(u.Replicas) != 0 {
		t.Fatalf("after applying a configuration without Consul: %+v, want an empty contribution", u)
	}
}

func TestNewRejectsUnusableClientSettings(t *testing.T) {
	t.Parallel()
	for _, opts := range []Options{
		{Address: "ftp://127.0.0.1:8500"},
		{Address: "127.0.0.1:8501", TLS: TLSOptions{CAFile: filepath.Join(t.TempDir(), "missing-ca.pem")}},
	} {
		if _, err := New(opts); err == nil || !strings.HasPrefix(err.Error(), "consul: client for ") {
			t.Errorf("New(%+v) error = %v, want a client error", opts, err)
		}
	}
	if _, err := New(Options{Address: "https://127.0.0.1:8501", Token: "secret"}); err != nil {
		t.Errorf("New with https address: %v", err)
	}
}

// TestSourceRebuiltConsulGhosts: after an outage, instances the restarted
// Consul does not list (yet) are reported Critical for RebuildSettle, an
// instance that is listed again is normal, and when the window ends the
// ones still missing are dropped (deregistered after all).
func TestSourceRebuiltConsulGhosts(t *testing.T) {
	t.Parallel()
	fake := newFake()
	pub := registry.NewPublisher(stateWith(map[string]registry.ConsulSelector{"llama": {Service: "vllm"}}))
	_, up := runSource(t, pub, fake, Options{RebuildSettle: 300 * time.Millisecond})
	ab := []*api.ServiceEntry{inst("n", "a", "", "10.0.0.1", 8000, nil, ""), inst("n", "b", "", "10.0.0.2", 8000, nil, "")}
	fake.reply("vllm", answer{index: 50, entries: ab})
	wantAddrs(t, next(t, up), "llama", "10.0.0.1:8000", "10.0.0.2:8000")
	fake.reply("vllm", answer{err: errors.New("connection refused")})
	if u := next(t, up); u.Err == nil {
		t.Fatalf("got %+v, want the outage reported", u)
	}
	// Back with an empty catalog (higher index: not a reset, but after
	// an outage).
	fake.reply("vllm", answer{index: 60})
	u := next(t, up)
	wantAddrs(t, u, "llama", "10.0.0.1:8000", "10.0.0.2:8000")
	for _, e := range u.Endpoints["llama"] {
		if !e.Critical {
			t.Fatalf("%+v: want Critical while re-registration is pending", e)
		}
	}
	// b is registered again: listed, so no longer a ghost.
	fake.reply("vllm", answer{index: 61, entries: ab[1:]})
	u = next(t, up)
	if eps := u.Endpoints["llama"]; len(eps) != 2 || !eps[0].Critical || eps[1].Critical {
		t.Fatalf("after b re-registered: %+v, want a Critical and b fine", eps)
	}
	// The window ends with a still missing: it is dropped.
	u = next(t, up)
	wantAddrs(t, u, "llama", "10.0.0.2:8000")
}
