package pd

import (
	"fmt"
	"testing"

	"github.com/switchyard/switchyard/registry"
)

func TestPolicyFrom(t *testing.T) {
	t.Parallel()
	got := PolicyFrom(&registry.Disaggregation{MinPromptTokens: 100}, 2, 0.8)
	want := Policy{UncachedTokens: registry.DefaultUncachedTokens, MinPromptTokens: 100, PrefillQueueThreshold: 2, KVThreshold: 0.8}
	if got != want {
		t.Errorf("defaults: %+v, want %+v", got, want)
	}
	got = PolicyFrom(&registry.Disaggregation{UncachedTokens: 64, PrefillQueueThreshold: 5}, 2, 0.8)
	if got.UncachedTokens != 64 || got.PrefillQueueThreshold != 5 {
		t.Errorf("set values: %+v", got)
	}
}

func TestDecide(t *testing.T) {
	t.Parallel()
	pol := Policy{UncachedTokens: 512, MinPromptTokens: 1000, PrefillQueueThreshold: 2, KVThreshold: 0.9}
	dec := Candidate{Address: "10.0.0.31:8000", Role: registry.RoleDecode, Ready: true}
	p := func(addr string, mod func(*Candidate)) Candidate {
		c := Candidate{Address: addr, Role: registry.RolePrefill, Ready: true}
		if mod != nil {
			mod(&c)
		}
		return c
	}
	two := []Candidate{p("10.0.0.21:8000", nil), p("10.0.0.22:8000", nil)}
	for _, c := range []struct {
		desc    string
		prompt  int
		decode  Candidate
		prefill []Candidate
		noKV    bool // the policy sets no KV threshold
		want    Decision
	}{
		{desc: "long uncached prompt: split, ties to the smaller address", prompt: 4000, decode: dec, prefill: two,
			want: Decision{Split: true, Prefill: "10.0.0.21:8000", Uncached: 4000, Reason: Split}},
		{desc: "short prompt stays whole", prompt: 999, decode: dec, prefill: two,
			want: Decision{Uncached: 999, Reason: ShortPrompt}},
		{desc: "mostly cached on the decode server: whole", prompt: 4000, decode: func() Candidate { c := dec; c.CachedTokens = 3600; return c }(), prefill: two,
			want: Decision{Uncached: 400, Reason: Cached}},
		{desc: "exactly the threshold uncached: split", prompt: 4000, decode: func() Candidate { c := dec; c.CachedTokens = 3488; return c }(), prefill: two,
			want: Decision{Split: true, Prefill: "10.0.0.21:8000", Uncached: 512, Reason: Split}},
		{desc: "prefix affinity: the prefill server holding the prefix", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", nil), p("10.0.0.22:8000", func(c *Candidate) { c.CachedTokens = 2048 })},
			want:    Decision{Split: true, Prefill: "10.0.0.22:8000", Uncached: 4000, Reason: Split}},
		{desc: "affinity gives way to pending prefill work", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", nil), p("10.0.0.22:8000", func(c *Candidate) { c.CachedTokens = 2048; c.PendingPrefillTokens = 3000 })},
			want:    Decision{Split: true, Prefill: "10.0.0.21:8000", Uncached: 4000, Reason: Split}},
		{desc: "equal cost: fewer waiting", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", func(c *Candidate) { c.Waiting = 1 }), p("10.0.0.22:8000", nil)},
			want:    Decision{Split: true, Prefill: "10.0.0.22:8000", Uncached: 4000, Reason: Split}},
		{desc: "queued and full prefill servers are skipped", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", func(c *Candidate) { c.Waiting = 2 }), p("10.0.0.22:8000", func(c *Candidate) { c.KVUsage = 0.95 }), p("10.0.0.23:8000", func(c *Candidate) { c.PendingPrefillTokens = 50000 })},
			want:    Decision{Split: true, Prefill: "10.0.0.23:8000", Uncached: 4000, Reason: Split}},
		{desc: "every prefill server saturated: whole", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", func(c *Candidate) { c.Waiting = 5 })},
			want:    Decision{Uncached: 4000, Reason: PrefillSaturated}},
		{desc: "no prefill-capable server: whole", prompt: 4000, decode: dec,
			prefill: []Candidate{{Address: "10.0.0.32:8000", Role: registry.RoleDecode, Ready: true}, p("10.0.0.21:8000", func(c *Candidate) { c.Ready = false })},
			want:    Decision{Uncached: 4000, Reason: NoPrefillServer}},
		{desc: "a both-role decode server is not its own prefill server", prompt: 4000,
			decode:  Candidate{Address: "10.0.0.31:8000", Role: registry.RoleBoth, Ready: true},
			prefill: []Candidate{{Address: "10.0.0.31:8000", Role: registry.RoleBoth, Ready: true}, {Address: "10.0.0.33:8000", Role: registry.RoleBoth, Ready: true}},
			want:    Decision{Split: true, Prefill: "10.0.0.33:8000", Uncached: 4000, Reason: Split}},
		{desc: "a prefill-only server is never the decode server", prompt: 4000, decode: p("10.0.0.21:8000", nil), prefill: two,
			want: Decision{Uncached: 4000, Reason: DecodeRole}},
		{desc: "no KV threshold set: KV use ignored", prompt: 4000, decode: dec,
			prefill: []Candidate{p("10.0.0.21:8000", func(c *Candidate) { c.KVUsage = 1 })}, noKV: true,
			want: Decision{Split: true, Prefill: "10.0.0.21:8000", Uncached: 4000, Reason: Split}},
	} {
		pl := pol
		if c.noKV {
			pl.KVThreshold = 0
		}
		if got := Decide(c.prompt, c.decode, c.prefill, pl); got != c.want {
			t.Errorf("%s:\n got %+v\nwant %+v", c.desc, got, c.want)
		}
	}
}

func BenchmarkDecide(b *testing.B) {
	pol := Policy{UncachedTokens: 512, PrefillQueueThreshold: 2, KVThreshold: 0.9}
	cands := make([]Candidate, 16)
	for i := range cands {
		cands[i] = Candidate{Address: fmt.Sprintf("10.0.0.%d:8000", i+1), Role: registry.RolePrefill, Ready: true,
			CachedTokens: i * 64, Waiting: i % 3, PendingPrefillTokens: i * 100}
	}
	dec := Candidate{Address: "10.0.1.1:8000", Role: registry.RoleDecode, Ready: true}
	b.ReportAllocs()
	for b.Loop() {
		if d := Decide(8192, dec, cands, pol); !d.Split {
			b.Fatal("no split")
		}
	}
}
