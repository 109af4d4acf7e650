package picker

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

func TestEndpointHealthUnknownIsNotHealthy(t *testing.T) {
	h := newEndpointHealth(HealthPolicy{})
	h.setTargets([]metrics.Target{{Pool: "p", Address: "10.0.0.1:8000"}, {Pool: "p", Address: "10.0.0.2:8000"}})
	a := metrics.Key{Pool: "p", Address: "10.0.0.1:8000"}
	b := metrics.Key{Pool: "p", Address: "10.0.0.2:8000"}

	// a fails before b was ever scraped: b is unknown, so a stays in EDS.
	h.set(a, true)
	if h.Unhealthy("p", a.Address) {
		t.Fatal("a withheld while its only peer is unscraped")
	}
	// b fails too: the whole pool fails, nothing is withheld.
	h.set(b, true)
	if got := h.UnhealthyEndpoints(); len(got) != 0 {
		t.Fatalf("whole pool failing, withheld %v", got)
	}
	// b answers: now a is withheld.
	ch := h.Changed()
	h.set(b, false)
	select {
	case <-ch:
	default:
		t.Fatal("recovery did not wake watchers")
	}
	if !h.Unhealthy("p", a.Address) || h.Unhealthy("p", b.Address) {
		t.Fatalf("after b recovered: unhealthy %v", h.UnhealthyEndpoints())
	}
	// A repeated report is not a change.
	ch = h.Changed()
	h.set(b, false)
	select {
	case <-ch:
		t.Fatal("a repeated report woke watchers")
	default:
	}
	// b leaves the target set: a has no answering peer left.
	h.setTargets([]metrics.Target{{Pool: "p", Address: a.Address}})
	if h.Unhealthy("p", a.Address) {
		t.Fatal("a withheld after its only answering peer left")
	}
}

// fakeClock is a settable clock for HealthPolicy tests.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time         { return c.t }
func (c *fakeClock) add(d time.Duration)    { c.t = c.t.Add(d) }
func failingAs(err error) *metrics.Snapshot { return &metrics.Snapshot{Err: err, Failing: true} }
func keys(n int, pool string) []metrics.Key {
	out := make([]metrics.Key, n)
	for i := range out {
		out[i] = metrics.Key{Pool: pool, Address: fmt.Sprintf("10.0.0.%d:8000", i+1)}
	}
	return out
}

func healthFor(ks []metrics.Key, clock *fakeClock) *EndpointHealth {
	h := newEndpointHealth(HealthPolicy{})
	h.now = clock.now
	var targets []metrics.Target
	for _, k := range ks {
		targets = append(targets, metrics.Target{Pool: k.Pool, Address: k.Address})
	}
	h.setTargets(targets)
	for _, k := range ks {
		h.observe(metrics.Transition{Key: k, Healthy: true})
	}
	return h
}

// A scrape that times out is not a server failure at once: the endpoint
// stays in EDS until it has failed for SoftFailAfter; a refused
// connection takes it out at once; a recovery puts it back at once.
func TestEndpointHealthTimeoutsNeedTime(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ks := keys(4, "p")
	h := healthFor(ks, clock)
	timeout := fmt.Errorf("scrape: %w", context.DeadlineExceeded)
	h.observe(metrics.Transition{Key: ks[0], Healthy: false, Snapshot: failingAs(timeout)})
	if h.Unhealthy("p", ks[0].Address) {
		t.Fatal("a timing-out endpoint was withheld at once")
	}
	clock.add(DefaultSoftFailAfter - time.Millisecond)
	if h.Unhealthy("p", ks[0].Address) {
		t.Fatal("withheld before SoftFailAfter")
	}
	clock.add(time.Millisecond)
	if !h.Unhealthy("p", ks[0].Address) {
		t.Fatal("still in EDS after failing for SoftFailAfter")
	}
	h.observe(metrics.Transition{Key: ks[0], Healthy: true})
	if h.Unhealthy("p", ks[0].Address) {
		t.Fatal("recovered endpoint still withheld")
	}

	refusedErr := fmt.Errorf("scrape: %w", &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)})
	h.observe(metrics.Transition{Key: ks[1], Healthy: false, Snapshot: failingAs(refusedErr)})
	if !h.Unhealthy("p", ks[1].Address) {
		t.Fatal("an endpoint refusing connections stayed in EDS")
	}
}

// Many endpoints timing out together is switchyard's own trouble (CPU
// starvation): none of them is withheld, however long it lasts; refused
// connections still are.
func TestEndpointHealthFleetWideTimeoutsAreIgnored(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ks := append(keys(6, "a"), keys(4, "b")...)
	h := healthFor(ks, clock)
	timeout := fmt.Errorf("scrape: %w", context.DeadlineExceeded)
	for _, k := range ks[:6] { // 6 of 10 time out
		h.observe(metrics.Transition{Key: k, Healthy: false, Snapshot: failingAs(timeout)})
	}
	clock.add(time.Minute)
	if got := h.UnhealthyEndpoints(); len(got) != 0 {
		t.Fatalf("withheld %v while most of the fleet timed out", got)
	}
	refusedErr := &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	h.observe(metrics.Transition{Key: ks[6], Healthy: false, Snapshot: failingAs(refusedErr)})
	if got := h.UnhealthyEndpoints(); len(got) != 1 || got[0] != ks[6] {
		t.Fatalf("withheld %v, want only the refusing %v", got, ks[6])
	}
	// Back to a minority timing out: they have failed long enough.
	for _, k := range ks[:4] {
		h.observe(metrics.Transition{Key: k, Healthy: true})
	}
	if got := h.UnhealthyEndpoints(); len(got) != 3 {
		t.Fatalf("withheld %v, want a's two timing-out endpoints and b's refusing one", got)
	}
}

// refused recognises a real refused connection, and only that.
func TestRefusedClassifiesRealErrors(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	_, err = http.Get("http://" + addr + "/metrics")
	if err == nil || !refused(fmt.Errorf("scrape: %w", err)) {
		t.Fatalf("connection to a closed port: %v, not classified as refused", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Nanosecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if _, err := http.DefaultClient.Do(req); err == nil || refused(err) {
		t.Fatalf("timeout %v classified as refused", err)
	}
}

// Run reports the first change at once and coalesces a burst of flips
// into one more report, carrying the final state.
func TestEndpointHealthRunCoalescesFlips(t *testing.T) {
	ks := keys(3, "p")
	h := newEndpointHealth(HealthPolicy{ReportInterval: 300 * time.Millisecond})
	var targets []metrics.Target
	for _, k := range ks {
		targets = append(targets, metrics.Target{Pool: k.Pool, Address: k.Address})
		h.observe(metrics.Transition{Key: k, Healthy: true})
	}
	h.setTargets(targets)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	up := make(chan registry.Update, 100)
	done := make(chan struct{})
	go func() { h.Run(ctx, up); close(done) }()
	defer func() { cancel(); <-done }()
	next := func(within time.Duration) (registry.Update, bool) {
		select {
		case u := <-up:
			return u, true
		case <-time.After(within):
			return registry.Update{}, false
		}
	}
	if u, ok := next(5 * time.Second); !ok || len(u.ScrapeFailing) != 0 {
		t.Fatalf("first report %+v %v, want an empty one", u, ok)
	}
	h.set(ks[0], true)
	u, ok := next(5 * time.Second)
	if !ok || len(u.ScrapeFailing["p"]) != 1 {
		t.Fatalf("first change %+v %v, want %v withheld", u, ok, ks[0])
	}
	// A burst of flips within the interval, ending with ks[1] failing
	// and ks[0] answering.
	for i := range 21 {
		h.set(ks[1], i%2 == 0)
		h.set(ks[0], i%2 == 1)
	}
	u, ok = next(5 * time.Second)
	if !ok {
		t.Fatal("no report after the burst")
	}
	if got := u.ScrapeFailing["p"]; len(got) != 1 || got[0] != ks[1].Address {
		t.Fatalf("report after the burst %v, want [%s]", got, ks[1].Address)
	}
	if extra, ok := next(700 * time.Millisecond); ok {
		t.Fatalf("a second report %+v for one burst", extra)
	}
}
