package metrics

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

func TestReadingRoundTrip(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewParser(registry.EngineVLLM, nil)
	if err != nil {
		t.Fatal(err)
	}
	real, err := p.Parse(page)
	if err != nil {
		t.Fatal(err)
	}
	if real.TTFT == nil {
		t.Fatal("the real page has no TTFT histogram")
	}
	for _, r := range []Reading{
		{Values: real, Interval: 50 * time.Millisecond, Cost: 3 * time.Millisecond, PageBytes: len(page), Filter: FilterIgnored,
			Models: []string{"base", "lora-a"}},
		{Values: Values{Waiting: 3, Running: -1, KVUsage: 0.25, BlockSize: 16, NumBlocks: 1000, MaxLoras: 2,
			RunningAdapters: []string{"a"}, WaitingAdapters: []string{"b", "c"}, Missing: []string{"kv_usage"},
			Hists: [NumHists]Hist{{Sum: 1.5, Count: 3}, {}, {Sum: math.Inf(1)}, {Count: 7}}}, Interval: time.Second},
		{Err: "scrape http://10.0.0.1:8000/metrics: connection refused", Interval: 100 * time.Millisecond},
		{Values: Values{Waiting: 1}, Models: []string{}},
	} {
		b, err := r.AppendBinary(nil)
		if err != nil {
			t.Fatal(err)
		}
		var got Reading
		if err := got.UnmarshalBinary(b); err != nil || !reflect.DeepEqual(got, r) {
			t.Fatalf("round trip:\n got %+v, %v\nwant %+v", got, err, r)
		}
		if r.Values.TTFT != nil {
			t.Logf("a reading of the real vLLM 0.32 page (%d bytes) takes %d bytes", len(page), len(b))
		}
		// Later fields are skipped; every cut is an error.
		if err := got.UnmarshalBinary(append(b, 1, 2, 3)); err != nil || !reflect.DeepEqual(got, r) {
			t.Fatalf("with trailing bytes: %+v, %v", got, err)
		}
		for i := range len(b) {
			if err := new(Reading).UnmarshalBinary(b[:i]); err == nil {
				t.Fatalf("cut at %d of %d bytes decoded without error", i, len(b))
			}
		}
		b[0] = readingVersion + 1
		if err := new(Reading).UnmarshalBinary(b); err == nil {
			t.Fatal("an unknown version decoded")
		}
	}
}

func FuzzReading(f *testing.F) {
	b, _ := Reading{Values: Values{Waiting: 2, TTFT: &Histogram{Bounds: []float64{0.1, 1}, Cumulative: []float64{1, 2}, Count: 2, Sum: 0.6}},
		Models: []string{"m"}}.AppendBinary(nil)
	f.Add(b)
	f.Add([]byte{readingVersion, readingFailed, 0, 0, 0, 0, 1, 'x'})
	f.Fuzz(func(t *testing.T, b []byte) {
		var r Reading
		if err := r.UnmarshalBinary(b); err != nil {
			return
		}
		again, err := r.AppendBinary(nil)
		if err != nil {
			t.Fatalf("a decoded reading does not encode: %v", err)
		}
		var r2 Reading
		if err := r2.UnmarshalBinary(again); err != nil {
			t.Fatalf("re-encoded %x does not decode: %v", b, err)
		}
		// NaN is not equal to itself: compare the encodings.
		if third, _ := r2.AppendBinary(nil); string(third) != string(again) {
			t.Fatalf("re-encoding %x is not stable", b)
		}
	})
}

// TestRendezvousOrder: every replica that knows the same replicas names
// the same owner for an endpoint; endpoints spread evenly; a replica
// that leaves moves only its own endpoints, and one that joins takes
// only endpoints from the others, about its share.
func TestRendezvousOrder(t *testing.T) {
	t.Parallel()
	keys := make([]Key, 3000)
	for i := range keys {
		keys[i] = Key{Pool: fmt.Sprintf("pool-%d", i%7), Address: fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250)}
	}
	all := []string{"r1", "r2", "r3"}
	owners := func(names []string) map[Key]string {
		out := map[Key]string{}
		for _, k := range keys {
			var first string
			for i, self := range names {
				o := Owner(self, slices.Delete(slices.Clone(names), i, i+1), k)
				if o == "" {
					o = self
				}
				if i == 0 {
					first = o
				} else if o != first {
					t.Fatalf("%v: %s names %s the owner, %s names %s", k, names[0], first, self, o)
				}
			}
			out[k] = first
		}
		return out
	}
	three := owners(all)
	count := map[string]int{}
	for _, o := range three {
		count[o]++
	}
	for _, r := range all {
		if n := count[r]; n < 850 || n > 1150 {
			t.Errorf("%s owns %d of 3000 endpoints", r, n)
		}
	}
	two := owners([]string{"r1", "r3"})
	moved := 0
	for k, o := range three {
		if o != "r2" && two[k] != o {
			t.Fatalf("%v moved from %s though r2 left", k, o)
		}
		if o == "r2" {
			moved++
		}
	}
	four := owners([]string{"r1", "r2", "r3", "r4"})
	took := 0
	for k, o := range four {
		if o != three[k] {
			if o != "r4" {
				t.Fatalf("%v moved from %s to %s when r4 joined", k, three[k], o)
			}
			took++
		}
	}
	if took < 600 || took > 900 {
		t.Errorf("r4 took %d of 3000 endpoints, want about a quarter", took)
	}
}

// countingTransport counts the metrics pages read through it by host,
// and fails the requests to the hosts in down.
type countingTransport struct {
	mu    sync.Mutex
	hits  map[string]int
	down  map[string]bool
	inner http.RoundTripper
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	down := c.down[r.URL.Host]
	if !down && r.URL.Path == "/metrics" {
		c.hits[r.URL.Host]++
	}
	c.mu.Unlock()
	if down {
		return nil, errors.New("no route to host")
	}
	return c.inner.RoundTrip(r)
}

func (c *countingTransport) count(host string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hits[host]
}

func (c *countingTransport) setDown(host string, down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down[host] = down
}

// scrapeLog records every scrape an endpoint answered, by anyone.
type scrapeLog struct {
	mu sync.Mutex
	at map[string][]time.Time
}

func (l *scrapeLog) add(host string) {
	l.mu.Lock()
	l.at[host] = append(l.at[host], time.Now())
	l.mu.Unlock()
}

// maxGap is the longest an endpoint went without a scrape since since
// (up to now).
func (l *scrapeLog) maxGap(host string, since time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	last, gap := since, time.Duration(0)
	for _, at := range l.at[host] {
		if at.Before(since) {
			continue
		}
		gap = max(gap, at.Sub(last))
		last = at
	}
	return max(gap, time.Since(last))
}

// shareSet is several Managers reading endpoints together, each
// reading's OnReading delivered straight to the others' Ingest (a link
// can be cut), each with its own transport.
type shareSet struct {
	t      *testing.T
	names  []string
	mgrs   []*Manager
	trs    []*countingTransport
	cut    [][]atomic.Bool // cut[i][j]: i's readings do not reach j
	log    *scrapeLog
	keys   []Key
	hosts  []string
	closed atomic.Bool
	// ticks are a 5 ms ticker's ticks: a long gap between two is the
	// whole test process stalled (a loaded machine), which delays every
	// scrape alike and is no fault of the sharing.
	ticksMu sync.Mutex
	ticks   []time.Time
}

// newShareSet starts n Managers over endpoints fake servers, every
// endpoint read every interval whatever its traffic.
func newShareSet(t *testing.T, n, endpoints int, interval time.Duration) *shareSet {
	t.Helper()
	s := &shareSet{t: t, log: &scrapeLog{at: map[string][]time.Time{}}}
	var targets []Target
	for range endpoints {
		srv := newFakeServer(t, vllmPage(1, 1, 0.5))
		host := srv.addr()
		inner := srv.Config.Handler
		srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/metrics" {
				s.log.add(host)
			}
			inner.ServeHTTP(w, r)
		})
		s.hosts = append(s.hosts, host)
		s.keys = append(s.keys, Key{Pool: "p", Address: host})
		targets = append(targets, Target{Pool: "p", Address: host, Interval: interval, IdleInterval: interval})
	}
	s.cut = make([][]atomic.Bool, n)
	for i := range n {
		s.cut[i] = make([]atomic.Bool, n)
		s.names = append(s.names, fmt.Sprintf("r%d", i+1))
		s.trs = append(s.trs, &countingTransport{hits: map[string]int{}, down: map[string]bool{}, inner: NewHTTPClient().Transport})
	}
	// Every manager exists before any reads, so OnReading finds them all.
	for i := range n {
		s.mgrs = append(s.mgrs, NewManager(context.Background(), s.optsFor(i)))
	}
	tickDone := make(chan struct{})
	go func() {
		tk := time.NewTicker(5 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-tickDone:
				return
			case now := <-tk.C:
				s.ticksMu.Lock()
				s.ticks = append(s.ticks, now)
				s.ticksMu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		close(tickDone)
		s.closed.Store(true)
		for _, m := range s.mgrs {
			m.Stop()
		}
	})
	for i, m := range s.mgrs {
		m.SetReplicas(s.names[i], s.others(i))
		if err := m.Sync(targets); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// stall returns the longest the test process went without running its
// ticker since since (up to now), beyond the ticker's period.
func (s *shareSet) stall(since time.Time) time.Duration {
	s.ticksMu.Lock()
	defer s.ticksMu.Unlock()
	last, gap := since, time.Duration(0)
	for _, at := range s.ticks {
		if at.Before(since) {
			continue
		}
		gap = max(gap, at.Sub(last))
		last = at
	}
	gap = max(gap, time.Since(last))
	return max(gap-5*time.Millisecond, 0)
}

func (s *shareSet) optsFor(i int) Options {
	o := fastOptions()
	o.Client = &http.Client{Transport: s.trs[i]}
	name := s.names[i]
	o.OnReading = func(k Key, r Reading) {
		if s.closed.Load() {
			return
		}
		for j, m := range s.mgrs {
			if j != i && !s.cut[i][j].Load() {
				_ = m.Ingest(k, name, r)
			}
		}
	}
	return o
}

func (s *shareSet) others(i int) []string {
	return slices.Delete(slices.Clone(s.names), i, i+1)
}

// readers returns, per endpoint, which managers read it during d.
func (s *shareSet) readers(d time.Duration) map[string][]string {
	before := make([][]int, len(s.mgrs))
	for i, tr := range s.trs {
		for _, h := range s.hosts {
			before[i] = append(before[i], tr.count(h))
		}
	}
	time.Sleep(d) // the window counted
	out := map[string][]string{}
	for i, tr := range s.trs {
		for j, h := range s.hosts {
			if tr.count(h) > before[i][j] {
				out[h] = append(out[h], s.names[i])
			}
		}
	}
	return out
}

// waitFresh waits until every manager holds a fresh view of every
// endpoint.
func (s *shareSet) waitFresh(what string) {
	s.t.Helper()
	testutil.Eventually(s.t, 10*time.Second, what, func() error {
		now := time.Now()
		for i, m := range s.mgrs {
			for _, k := range s.keys {
				if sn := m.Get(k); !sn.Fresh(now) {
					return fmt.Errorf("%s: %s not fresh: %+v", s.names[i], k.Address, sn)
				}
			}
		}
		return nil
	})
}

// TestSharedScrapesOneReaderEach: with three replicas sharing, each
// endpoint is read by its owner alone, and every replica's view of
// every endpoint is fresh, the others' marked with the owner's name.
func TestSharedScrapesOneReaderEach(t *testing.T) {
	t.Parallel()
	s := newShareSet(t, 3, 9, 20*time.Millisecond)
	s.waitFresh("every view fresh")
	// Let the start, where each read everything before it knew the
	// others, pass.
	testutil.Eventually(t, 10*time.Second, "one reader per endpoint", func() error {
		for h, rs := range s.readers(200 * time.Millisecond) {
			want := Owner(s.names[0], s.others(0), Key{Pool: "p", Address: h})
			if want == "" {
				want = s.names[0]
			}
			if len(rs) != 1 || rs[0] != want {
				return fmt.Errorf("%s read by %v, owner %s", h, rs, want)
			}
		}
		return nil
	})
	now := time.Now()
	for i, m := range s.mgrs {
		own, standIn, shared := m.Roles()
		if standIn != 0 || own+shared != len(s.keys) || own == len(s.keys) {
			t.Errorf("%s: %d own, %d standing in, %d shared", s.names[i], own, standIn, shared)
		}
		for _, k := range s.keys {
			sn := m.Get(k)
			owner := m.Owner(k)
			if sn.From != owner || !sn.Fresh(now) || sn.Waiting != 1 {
				t.Errorf("%s's view of %s: from %q (owner %q), %+v", s.names[i], k.Address, sn.From, owner, sn)
			}
		}
	}
}

// TestSharedScrapesStandInForASilentOwner: when an owner's readings stop
// reaching a replica that still counts it (it stalled, or the way between
// them broke one way, before failure detection says so), that replica
// keeps the last values, shows them stale, and reads the endpoints
// itself once they have been stale for a grace; the endpoints are never
// left unread.
func TestSharedScrapesStandInForASilentOwner(t *testing.T) {
	t.Parallel()
	const interval = 20 * time.Millisecond
	s := newShareSet(t, 2, 6, interval)
	s.waitFresh("every view fresh")
	// The silent one is the owner of the first endpoint; the other
	// watches.
	silent := 0
	if s.mgrs[0].Owner(s.keys[0]) != "" {
		silent = 1
	}
	watcher := 1 - silent
	r1, r2 := s.names[silent], s.names[watcher]
	w := s.mgrs[watcher]
	var owned []Key // the silent one's endpoints
	for _, k := range s.keys {
		if w.Owner(k) == r1 {
			owned = append(owned, k)
		}
	}
	if len(owned) == 0 {
		t.Fatalf("%s owns none of %d endpoints", r1, len(s.keys))
	}
	testutil.Eventually(t, 10*time.Second, r2+" reads none of "+r1+"'s endpoints", func() error {
		rs := s.readers(100 * time.Millisecond)
		for _, k := range owned {
			if slices.Contains(rs[k.Address], r2) {
				return fmt.Errorf("%s still reads %s", r2, k.Address)
			}
		}
		return nil
	})
	cut := time.Now()
	s.cut[silent][watcher].Store(true)
	// Stale first, with the silent one's name on it.
	k := owned[0]
	testutil.Eventually(t, 5*time.Second, r2+" shows "+r1+"'s reading stale", func() error {
		sn := w.Get(k)
		if sn.From != r1 || sn.Fresh(time.Now()) {
			return fmt.Errorf("from %q, age %v, max %v", sn.From, sn.Age(time.Now()), sn.MaxAge)
		}
		return nil
	})
	// Then the watcher reads it itself.
	s.waitFresh(r2 + " stands in")
	took := time.Since(cut)
	for _, k := range owned {
		if sn := w.Get(k); sn.From != "" {
			t.Errorf("%s's view of %s from %q, want its own", r2, k.Address, sn.From)
		}
	}
	if _, standIn, _ := w.Roles(); standIn != len(owned) {
		t.Errorf("%s stands in for %d endpoints, want %d", r2, standIn, len(owned))
	}
	maxAge := max(3*interval, DefaultMinMaxAge)
	grace := max(interval, MinStandInGrace)
	t.Logf("%s stood in %v after %s's readings stopped (stale after %v, grace %v)", r2, took.Round(time.Millisecond), r1, maxAge, grace)
	// The silent one reads on all along: the endpoints were never left
	// unread.
	since := cut.Add(-100 * time.Millisecond)
	for _, k := range owned {
		if g, stall := s.log.maxGap(k.Address, since), s.stall(since); g > 10*interval+stall {
			t.Errorf("%s unread for %v (the test process stalled %v)", k.Address, g, stall)
		}
	}
	// The silent one's readings come again: the watcher stops reading.
	s.cut[silent][watcher].Store(false)
	testutil.Eventually(t, 10*time.Second, r2+" stands by again", func() error {
		if _, standIn, _ := w.Roles(); standIn != 0 {
			return fmt.Errorf("%s stands in for %d", r2, standIn)
		}
		rs := s.readers(100 * time.Millisecond)
		for _, k := range owned {
			if slices.Contains(rs[k.Address], r2) {
				return fmt.Errorf("%s still reads %s", r2, k.Address)
			}
		}
		return nil
	})
}

// TestSharedScrapesOwnFailuresOnly: an owner that cannot read an endpoint
// the others can (a partition between the two) withholds it on its own
// failures, as one switchyard would; the others never take its failures
// for theirs: they read the endpoint themselves and keep it healthy, and
// stop once the owner reads it again.
func TestSharedScrapesOwnFailuresOnly(t *testing.T) {
	t.Parallel()
	s := newShareSet(t, 3, 6, 20*time.Millisecond)
	s.waitFresh("every view fresh")
	// The owner of the first endpoint (in r1's view, which all share).
	k := s.keys[0]
	o := slices.Index(s.names, s.mgrs[0].Owner(k))
	if o < 0 {
		o = 0 // r1 itself
	}
	owner, name := s.mgrs[o], s.names[o]
	if owner.Owner(k) != "" {
		t.Fatalf("%s does not see itself as %s's owner", name, k.Address)
	}
	s.trs[o].setDown(k.Address, true)
	testutil.Eventually(t, 5*time.Second, name+" finds it failing, the others do not", func() error {
		if sn := owner.Get(k); !sn.Failing {
			return fmt.Errorf("%s: %+v", name, sn)
		}
		for i, m := range s.mgrs {
			if i == o {
				continue
			}
			sn := m.Get(k)
			if sn.Failing || sn.Err != nil || !sn.Fresh(time.Now()) {
				return fmt.Errorf("%s: %+v", s.names[i], sn)
			}
		}
		return nil
	})
	rs := s.readers(200 * time.Millisecond)
	if len(rs[k.Address]) == 0 || slices.Contains(rs[k.Address], name) {
		t.Errorf("read by %v while %s cannot reach it", rs[k.Address], name)
	}
	s.trs[o].setDown(k.Address, false)
	testutil.Eventually(t, 10*time.Second, "only "+name+" reads it again", func() error {
		rs := s.readers(200 * time.Millisecond)
		if !slices.Equal(rs[k.Address], []string{name}) {
			return fmt.Errorf("read by %v", rs[k.Address])
		}
		if sn := owner.Get(k); sn.Failing || sn.Err != nil {
			return fmt.Errorf("%s: %+v", name, sn)
		}
		return nil
	})
}

// TestSharedScrapesSplitViews: replicas that disagree on who is live (a
// stream up one way only, a replica not yet seen by all) leave no
// endpoint unread, and every view stays fresh. Even views that count a
// replica that is gone (before failure detection drops it) leave its
// endpoints unread only until the first after it in their order stands
// in.
func TestSharedScrapesSplitViews(t *testing.T) {
	t.Parallel()
	const interval = 20 * time.Millisecond
	for _, c := range []struct {
		views [][]string
		// settle is how long endpoints may go unread at the start.
		settle time.Duration
	}{
		// r1 counts r2; r2 counts nobody.
		{views: [][]string{{"r2"}, {}}},
		// r1 and r2 count each other; r3 is seen by r2 only and counts
		// nobody.
		{views: [][]string{{"r2"}, {"r1", "r3"}, {}}},
		// Every replica counts the next one only.
		{views: [][]string{{"r2"}, {"r3"}, {"r1"}}},
		// Both count r9, which is gone: its endpoints wait for the
		// stand-in (stale after 250 ms, then one or two graces).
		{views: [][]string{{"r2", "r9"}, {"r1", "r9"}}, settle: DefaultMinMaxAge + 2*MinStandInGrace + 2*interval},
	} {
		t.Run(strings.ReplaceAll(fmt.Sprint(c.views), " ", ","), func(t *testing.T) {
			t.Parallel()
			s := newShareSet(t, len(c.views), 12, interval)
			from := time.Now()
			for i, v := range c.views {
				s.mgrs[i].SetReplicas(s.names[i], v)
			}
			s.waitFresh("every view fresh")
			// Every endpoint is read by someone, all the time: gaps of
			// a few intervals beyond the test process's measured stall
			// are scheduling on a loaded machine; an endpoint nobody
			// owns stays unread for the whole window.
			rs := s.readers(500 * time.Millisecond)
			for _, h := range s.hosts {
				if len(rs[h]) == 0 {
					t.Errorf("%s read by nobody", h)
				}
				if g, stall := s.log.maxGap(h, from.Add(c.settle)), s.stall(from.Add(c.settle)); g > 10*interval+stall {
					t.Errorf("%s unread for %v (the test process stalled %v)", h, g, stall)
				}
			}
			s.waitFresh("every view still fresh")
		})
	}
}
