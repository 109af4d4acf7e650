package tenant

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/registry"
)

// clock is a fake clock tests move by hand.
type clock struct{ t time.Time }

func (c *clock) now() time.Time       { return c.t }
func (c *clock) step(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *clock                { return &clock{t: time.Date(2026, 11, 26, 10, 0, 0, 0, time.UTC)} }
func state(tenants ...*registry.Tenant) *registry.State {
	st := registry.Empty()
	st.Tenants = map[string]*registry.Tenant{}
	for _, t := range tenants {
		st.Tenants[t.Name] = t
	}
	return st
}

func TestWindowSlidesAndNeverForgetsEarly(t *testing.T) {
	t.Parallel()
	c := newClock()
	w := newWindow(time.Minute, 60)
	c.step(300 * time.Millisecond) // mid-slot
	w.add(c.now(), c.now(), 10)
	c.step(59 * time.Second)
	if got := w.used(c.now()); got != 10 {
		t.Fatalf("after 59 s: used %d, want 10", got)
	}
	c.step(time.Second) // exactly one span after the charge: still counted
	if got := w.used(c.now()); got != 10 {
		t.Fatalf("after 60 s: used %d, want 10 (a charge is never forgotten early)", got)
	}
	c.step(time.Second) // past the charge's slot end plus the span
	if got := w.used(c.now()); got != 0 {
		t.Fatalf("after 61 s: used %d, want 0", got)
	}
	// A jump longer than the window clears everything.
	w.add(c.now(), c.now(), 5)
	c.step(time.Hour)
	if got := w.used(c.now()); got != 0 {
		t.Fatalf("after an hour: used %d", got)
	}
}

func TestWindowRefundsAndWaits(t *testing.T) {
	t.Parallel()
	c := newClock()
	w := newWindow(time.Minute, 60)
	t0 := c.now()
	w.add(c.now(), t0, 40)
	c.step(10 * time.Second)
	w.add(c.now(), c.now(), 50)
	// Refund at the first charge's slot; never below zero.
	w.add(c.now(), t0, -100)
	if got := w.used(c.now()); got != 50 {
		t.Fatalf("used %d, want 50", got)
	}
	w.add(c.now(), t0, 30)
	// 80 counted: a charge of 40 fits under 100 once the 30 of t0 expires,
	// 61 s after t0 (51 s from now).
	if got := w.waitFor(c.now(), 40, 100); got != 51*time.Second {
		t.Fatalf("waitFor = %v, want 51s", got)
	}
	if got := w.waitFor(c.now(), 20, 100); got != 0 {
		t.Fatalf("waitFor of a charge that fits = %v", got)
	}
	if got := w.reset(c.now()); got != 61*time.Second {
		t.Fatalf("reset = %v, want 61s (the newest charge's expiry)", got)
	}
	// A refund for a charge already out of the window is dropped.
	c.step(2 * time.Minute)
	w.add(c.now(), t0, -10)
	if got := w.used(c.now()); got != 0 {
		t.Fatalf("used %d", got)
	}
}

func TestAdmitRequestsPerMinute(t *testing.T) {
	t.Parallel()
	c := newClock()
	tab := NewSet().Build(state(&registry.Tenant{Name: "a", Limits: registry.Limits{RequestsPerMinute: 3}}), 1)
	tn := tab.Tenant("a")
	for i := range 3 {
		if _, d := tn.Admit(c.now(), 1000); d != nil {
			t.Fatalf("request %d denied: %+v", i, d)
		}
		c.step(time.Second)
	}
	_, d := tn.Admit(c.now(), 0)
	if d == nil || d.Limit != "requests_per_minute" || d.Used != 3 {
		t.Fatalf("fourth request: %+v", d)
	}
	// The first request (at t=0) leaves the window 61 s after it was made.
	if d.RetryAfter != 58*time.Second {
		t.Fatalf("retry after %v, want 58s", d.RetryAfter)
	}
	c.step(d.RetryAfter)
	if _, d := tn.Admit(c.now(), 0); d != nil {
		t.Fatalf("after retry-after: %+v", d)
	}
}

func TestAdmitTokensReserveAndSettle(t *testing.T) {
	t.Parallel()
	c := newClock()
	tab := NewSet().Build(state(&registry.Tenant{Name: "a", Limits: registry.Limits{TokensPerMinute: 1000, TokensPerDay: 1500}}), 1)
	tn := tab.Tenant("a")
	// A burst: reservations count at once, so the fourth does not pass.
	var rs []Reservation
	for i := range 3 {
		r, d := tn.Admit(c.now(), 300)
		if d != nil {
			t.Fatalf("reservation %d denied: %+v", i, d)
		}
		rs = append(rs, r)
	}
	if _, d := tn.Admit(c.now(), 300); d == nil || d.Limit != "tokens_per_minute" || d.Used != 900 {
		t.Fatalf("fourth reservation: %+v", d)
	}
	// Actual usage is lower: the refunds make room.
	for _, r := range rs {
		tn.Settle(c.now(), r, 100)
	}
	if got := tn.Used(c.now())["tokens_per_minute"]; got != 300 {
		t.Fatalf("used after settling %d, want 300", got)
	}
	if _, d := tn.Admit(c.now(), 600); d != nil {
		t.Fatalf("denied after refunds: %+v", d)
	}
	// The day budget (1500) now has 900: a minute later the minute
	// window is empty but the day's is not.
	c.step(2 * time.Minute)
	_, d := tn.Admit(c.now(), 700)
	if d == nil || d.Limit != "tokens_per_day" {
		t.Fatalf("day budget: %+v", d)
	}
	// More than the actual estimate is charged now.
	r, d := tn.Admit(c.now(), 100)
	if d != nil {
		t.Fatal(d)
	}
	tn.Settle(c.now(), r, 400)
	if got := tn.Used(c.now()); got["tokens_per_day"] != 1300 || got["tokens_per_minute"] != 400 {
		t.Fatalf("used %v", got)
	}
}

func TestAdmitOversizedRequestOnlyIntoEmptyWindow(t *testing.T) {
	t.Parallel()
	c := newClock()
	tn := NewSet().Build(state(&registry.Tenant{Name: "a", Limits: registry.Limits{TokensPerMinute: 100}}), 1).Tenant("a")
	if _, d := tn.Admit(c.now(), 500); d != nil {
		t.Fatalf("oversized request into an empty window denied: %+v", d)
	}
	_, d := tn.Admit(c.now(), 500)
	if d == nil || d.RetryAfter <= 0 {
		t.Fatalf("second oversized request: %+v", d)
	}
}

func TestLimitsSplitAmongReplicasAndSurviveReloads(t *testing.T) {
	t.Parallel()
	c := newClock()
	set := NewSet()
	cfg := &registry.Tenant{Name: "a", Limits: registry.Limits{RequestsPerMinute: 10, TokensPerMinute: 1000}}
	tn := set.Build(state(cfg), 3).Tenant("a")
	if l := tn.Local(); l.RequestsPerMinute != 4 || l.TokensPerMinute != 334 {
		t.Fatalf("local share %+v, want 4 requests and 334 tokens (rounded up)", l)
	}
	for range 4 {
		if _, d := tn.Admit(c.now(), 10); d != nil {
			t.Fatal(d)
		}
	}
	if _, d := tn.Admit(c.now(), 10); d == nil || d.Configured != 10 || d.Local != 4 {
		t.Fatalf("fifth request on a third of 10: %+v", d)
	}
	h := map[string]string{}
	var hs Headers
	tn.Headers(c.now(), 3, &hs)
	for i := range hs.Len() {
		h[hs.Key(i)] = string(hs.Value(i))
	}
	want := map[string]string{
		"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m1s",
		"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "882", "x-ratelimit-reset-tokens": "1m1s",
	}
	if fmt.Sprint(h) != fmt.Sprint(want) {
		t.Fatalf("headers %v\nwant    %v", h, want)
	}
	// A reload (one replica left) keeps the counts.
	tn = set.Build(state(cfg), 1).Tenant("a")
	if got := tn.Used(c.now())["requests_per_minute"]; got != 4 {
		t.Fatalf("counts lost on rebuild: %d", got)
	}
	if _, d := tn.Admit(c.now(), 10); d != nil {
		t.Fatalf("with the whole budget: %+v", d)
	}
	// A tenant removed and added again starts afresh.
	set.Build(state(&registry.Tenant{Name: "b"}), 1)
	if got := set.Build(state(cfg), 1).Tenant("a").Used(c.now())["requests_per_minute"]; got != 0 {
		t.Fatalf("removed tenant kept %d", got)
	}
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	a := &registry.Tenant{Name: "a", KeyHashes: []string{apikey.Hash("key-a1"), apikey.Hash("key-a2")}, Models: []string{"m"}}
	b := &registry.Tenant{Name: "b", KeyHashes: []string{apikey.Hash("key-b")}}
	tab := NewSet().Build(state(a, b), 1)
	for key, want := range map[string]string{"key-a1": "a", "key-a2": "a", "key-b": "b", "key-c": "", "": "", "KEY-A1": ""} {
		got := tab.Authenticate([]byte(key))
		if (got == nil && want != "") || (got != nil && got.Name != want) {
			t.Errorf("Authenticate(%q) = %v, want %q", key, got, want)
		}
	}
	ta := tab.Tenant("a")
	if !ta.Allows("m") || ta.Allows("n") || !tab.Tenant("b").Allows("anything") {
		t.Fatal("model lists not applied")
	}
	if NewSet().Build(registry.Empty(), 1) != nil {
		t.Fatal("a state without tenants must give a nil table")
	}
	var none *Table
	if none.Authenticate([]byte("key-a1")) != nil {
		t.Fatal("nil table authenticated a key")
	}
}

func TestCredentials(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc    string
		headers [][2]string
		key     string
		err     error
	}{
		{"bearer", [][2]string{{"authorization", "Bearer sy-abc"}}, "sy-abc", nil},
		{"scheme case and spaces", [][2]string{{"authorization", "  bEaReR \t sy-abc  "}}, "sy-abc", nil},
		{"x-api-key", [][2]string{{"x-api-key", " sy-abc "}}, "sy-abc", nil},
		{"both agreeing", [][2]string{{"authorization", "Bearer k"}, {"x-api-key", "k"}}, "k", nil},
		{"both differing", [][2]string{{"authorization", "Bearer k"}, {"x-api-key", "j"}}, "", ErrAmbiguous},
		{"authorization twice", [][2]string{{"authorization", "Bearer k"}, {"authorization", "Bearer k"}}, "", ErrAmbiguous},
		{"none", [][2]string{{"content-type", "application/json"}}, "", ErrNoKey},
		{"basic", [][2]string{{"authorization", "Basic dXNlcjpwYXNz"}}, "", ErrBadScheme},
		{"token alone", [][2]string{{"authorization", "sy-abc"}}, "", ErrBadScheme},
		{"bearer without token", [][2]string{{"authorization", "Bearer"}}, "", ErrMalformed},
		{"bearer and spaces", [][2]string{{"authorization", "Bearer   "}}, "", ErrMalformed},
		{"inner space", [][2]string{{"authorization", "Bearer a b"}}, "", ErrMalformed},
		{"empty x-api-key", [][2]string{{"x-api-key", ""}}, "", ErrMalformed},
		{"too long", [][2]string{{"x-api-key", strings.Repeat("k", MaxKeyBytes+1)}}, "", ErrMalformed},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			var c Credentials
			for _, h := range tc.headers {
				c.Add(h[0], []byte(h[1]))
			}
			key, err := c.Key()
			if !errors.Is(err, tc.err) || string(key) != tc.key {
				t.Fatalf("Key() = %q, %v; want %q, %v", key, err, tc.key, tc.err)
			}
		})
	}
}

func TestFormatReset(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{0: "0s", 499 * time.Microsecond: "0.001s", 250 * time.Millisecond: "0.25s",
		time.Second: "1s", 6 * time.Minute: "6m0s", 1500 * time.Millisecond: "1.5s"} {
		if got := FormatReset(d); got != want {
			t.Errorf("FormatReset(%v) = %q, want %q", d, got, want)
		}
	}
	if RetryAfterSeconds(100*time.Millisecond) != "1" || RetryAfterSeconds(58*time.Second+time.Millisecond) != "59" {
		t.Error("retry-after not rounded up to whole seconds")
	}
}
