package registry

import (
	"context"
	"slices"
	"testing"
	"time"
)

// guardFixture runs a Manager with a file-like source declaring pool "p"
// (and its guard) and a discovery-like source supplying its endpoints,
// each step's Endpoints update sent by the test.
type guardFixture struct {
	t          *testing.T
	m          *Manager
	pub        *Publisher
	file, disc *scriptSource
	version    uint64
}

func newGuardFixture(t *testing.T, g *Guard, initial ...Endpoint) *guardFixture {
	t.Helper()
	f := &guardFixture{t: t, file: newScript(), disc: newScript()}
	f.m, f.pub = startManager(t, []named{{"file", f.file}, {"consul", f.disc}})
	u := poolUpdate("p")
	u.Pools["p"].Guard = g
	f.file.send(t, u)
	f.step(initial...)
	return f
}

// step sends the discovery source's endpoints of pool p and returns the
// published endpoints of p once the state changed.
func (f *guardFixture) step(eps ...Endpoint) []Endpoint {
	f.t.Helper()
	f.disc.send(f.t, Update{Endpoints: map[string][]Endpoint{"p": eps}})
	f.version++
	return waitVersion(f.t, f.pub, f.version).Pools["p"].Endpoints
}

func ep(addr string, critical bool) Endpoint { return Endpoint{Address: addr, Critical: critical} }

// describeEps renders endpoints as "addr" or "addr(held)".
func describeEps(eps []Endpoint) []string {
	var out []string
	for _, e := range eps {
		s := e.Address
		if e.Held {
			s += "(held)"
		}
		if e.Draining {
			s += "(draining)"
		}
		out = append(out, s)
	}
	return out
}

func wantEps(t *testing.T, what string, got []Endpoint, want ...string) {
	t.Helper()
	if d := describeEps(got); !slices.Equal(d, want) {
		t.Fatalf("%s: published %v, want %v", what, d, want)
	}
}

func TestGuardHoldsMassHealthFailures(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc  string
		guard *Guard
		next  []Endpoint // the second update
		want  []string
		holds bool
	}{
		{desc: "3 of 4 fail at once: held",
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true), ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.1:80(held)", "10.0.0.2:80(held)", "10.0.0.3:80(held)", "10.0.0.4:80"}, holds: true},
		{desc: "all fail: held",
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true), ep("10.0.0.4:80", true)},
			want: []string{"10.0.0.1:80(held)", "10.0.0.2:80(held)", "10.0.0.3:80(held)", "10.0.0.4:80(held)"}, holds: true},
		{desc: "1 of 4 fails: removed at once",
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", false), ep("10.0.0.3:80", false), ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"}},
		{desc: "2 of 4 fail, at the threshold: removed",
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", false), ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.3:80", "10.0.0.4:80"}},
		{desc: "3 of 4 deregistered: deliberate, never held",
			next: []Endpoint{ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.4:80"}},
		{desc: "3 of 4 draining: deliberate, never held",
			next: []Endpoint{{Address: "10.0.0.1:80", Draining: true}, {Address: "10.0.0.2:80", Draining: true}, {Address: "10.0.0.3:80", Draining: true}, ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.1:80(draining)", "10.0.0.2:80(draining)", "10.0.0.3:80(draining)", "10.0.0.4:80"}},
		{desc: "guard disabled (grace 0)", guard: &Guard{Threshold: 0.5},
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true), ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.4:80"}},
		{desc: "threshold 0.9: 3 of 4 is not enough", guard: &Guard{Threshold: 0.9, Grace: time.Minute},
			next: []Endpoint{ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true), ep("10.0.0.4:80", false)},
			want: []string{"10.0.0.4:80"}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			f := newGuardFixture(t, tc.guard, ep("10.0.0.1:80", false), ep("10.0.0.2:80", false), ep("10.0.0.3:80", false), ep("10.0.0.4:80", false))
			wantEps(t, tc.desc, f.step(tc.next...), tc.want...)
			st := f.m.Status()
			if holds := len(st.Guards) == 1; holds != tc.holds || (tc.holds && st.GuardActivations["p"] != 1) {
				t.Fatalf("guard status %v, activations %v; want a hold: %v", st.Guards, st.GuardActivations, tc.holds)
			}
			if !tc.holds {
				return
			}
			// Recovery: the held endpoints pass again; the hold ends.
			wantEps(t, "recovered", f.step(ep("10.0.0.1:80", false), ep("10.0.0.2:80", false), ep("10.0.0.3:80", false), ep("10.0.0.4:80", false)),
				"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80")
			if g := f.m.Status().Guards; len(g) != 0 {
				t.Fatalf("hold still active after recovery: %v", g)
			}
		})
	}
}

// TestGuardLetsGoOfFailingScrapes: the health input marks a held endpoint
// whose own metrics scrapes fail; the guard stops holding it at once.
func TestGuardLetsGoOfFailingScrapes(t *testing.T) {
	t.Parallel()
	f := &guardFixture{t: t, file: newScript(), disc: newScript()}
	health := newScript()
	f.m, f.pub = startManager(t, []named{{"file", f.file}, {"consul", f.disc}, {"health", health}})
	f.file.send(t, poolUpdate("p"))
	health.send(t, Update{})
	all := []Endpoint{ep("10.0.0.1:80", false), ep("10.0.0.2:80", false), ep("10.0.0.3:80", false)}
	f.step(all...)
	wantEps(t, "all fail", f.step(ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true)),
		"10.0.0.1:80(held)", "10.0.0.2:80(held)", "10.0.0.3:80(held)")
	health.send(t, Update{ScrapeFailing: map[string][]string{"p": {"10.0.0.2:80"}}})
	f.version++
	wantEps(t, "scrape of .2 fails", waitVersion(t, f.pub, f.version).Pools["p"].Endpoints, "10.0.0.1:80(held)", "10.0.0.3:80(held)")
}

// TestGuardGraceEnds: when the grace period ends with the endpoints still
// failing, they are removed without any new update, and the hold does not
// renew itself.
func TestGuardGraceEnds(t *testing.T) {
	t.Parallel()
	f := newGuardFixture(t, &Guard{Threshold: 0.5, Grace: 200 * time.Millisecond}, ep("10.0.0.1:80", false), ep("10.0.0.2:80", false))
	start := time.Now()
	wantEps(t, "all fail", f.step(ep("10.0.0.1:80", true), ep("10.0.0.2:80", true)), "10.0.0.1:80(held)", "10.0.0.2:80(held)")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := WaitFor(ctx, f.pub, func(s *State) bool { return len(s.Pools["p"].Endpoints) == 0 })
	if err != nil {
		t.Fatalf("held endpoints never removed: %v (%v)", err, describeEps(s.Pools["p"].Endpoints))
	}
	if since := time.Since(start); since < 200*time.Millisecond {
		t.Fatalf("removed after %v, before the grace period ended", since)
	}
	if g := f.m.Status().Guards; len(g) != 0 {
		t.Fatalf("hold renewed itself: %v", g)
	}
	if n := f.m.Status().GuardActivations["p"]; n != 1 {
		t.Fatalf("%d activations, want 1", n)
	}
}

// TestGuardJoinsLaterFailures: during a hold, endpoints that fail in a
// later update (services re-registered one by one) join it.
func TestGuardJoinsLaterFailures(t *testing.T) {
	t.Parallel()
	f := newGuardFixture(t, nil, ep("10.0.0.1:80", false), ep("10.0.0.2:80", false), ep("10.0.0.3:80", false))
	wantEps(t, "2 of 3", f.step(ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", false)),
		"10.0.0.1:80(held)", "10.0.0.2:80(held)", "10.0.0.3:80")
	wantEps(t, "the third too", f.step(ep("10.0.0.1:80", true), ep("10.0.0.2:80", true), ep("10.0.0.3:80", true)),
		"10.0.0.1:80(held)", "10.0.0.2:80(held)", "10.0.0.3:80(held)")
	if g := f.m.Status().Guards; len(g) != 1 || len(g[0].Held) != 3 {
		t.Fatalf("guard status %v, want one hold of 3", g)
	}
}
