package sched

import (
	"testing"

	"github.com/switchyard/switchyard/picker/prefix"
)

// fakeCache is an exact view that knows some endpoints.
type fakeCache struct {
	tokens int
	cached map[string]int // absent: not exact
}

func (f fakeCache) Tokens() int { return f.tokens }

func (f fakeCache) CachedTokens(addrs []string, tokens []int, exact []bool) {
	for i, a := range addrs {
		tokens[i], exact[i] = f.cached[a]
	}
}

// The exact view decides for the endpoints it knows; the estimating index
// answers for the others.
func TestPrefixScorerPrefersTheExactView(t *testing.T) {
	t.Parallel()
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 1, CharsPerToken: 4})
	hashes := h.Hash(nil, "m", "aaaabbbbccccddddeeeeffffgggghhhh") // 8 blocks
	idx := prefix.NewIndex(prefix.Config{})
	idx.Add("a", hashes[:8]) // the estimate believes a holds it all
	idx.Add("c", hashes[:2])
	cache := fakeCache{tokens: 400, cached: map[string]int{"a": 0, "b": 300}} // a was evicted; b holds 3/4
	p := &prefixScorer{Index: idx, Guard: DefaultLoadGuard}
	var sc Scratch
	req := Request{Now: now, Hashes: hashes, BlockTokens: 4, Cache: cache, scratch: &sc}
	eps := mkEps(m{}, m{}, m{})
	got := make([]float64, 3)
	p.Score(&req, eps, got)
	inDelta(t, got, []float64{0, 0.75, 0.25})
	if n, ok := sc.CachedTokens("b"); !ok || n != 300 {
		t.Errorf("CachedTokens(b) = %d, %v", n, ok)
	}
	if _, ok := sc.CachedTokens("c"); ok {
		t.Error("c reported exact")
	}
	if n, ok := sc.PrefixMatch("b"); !ok || n != 75 {
		t.Errorf("PrefixMatch(b) = %d blocks of 4, want 75", n)
	}
	// Without hashes (no estimate), the view alone scores.
	req = Request{Now: now, Cache: cache}
	clear(got)
	p.Score(&req, eps, got)
	inDelta(t, got, []float64{0, 0.75, 0})
}

// The TTFT scorer prices each endpoint's prefill by the exact cached
// tokens.
func TestTTFTScorerUsesTheExactView(t *testing.T) {
	t.Parallel()
	eps := mkEps(m{}, m{})
	cache := fakeCache{tokens: 2000, cached: map[string]int{"a": 0, "b": 1600}}
	ts := &TTFTScorer{}
	var sc Scratch
	req := Request{Now: now, Tokens: 2000, BlockTokens: 16, Cache: cache, scratch: &sc}
	scores := make([]float64, 2)
	ts.Score(&req, eps, scores)
	pa, _ := sc.Prediction("a")
	pb, _ := sc.Prediction("b")
	if pa.Uncached != 2000 || pb.Uncached != 400 || scores[1] <= scores[0] {
		t.Fatalf("uncached a %d, b %d; scores %v", pa.Uncached, pb.Uncached, scores)
	}
}

// When no endpoint holds any of the prompt (by the exact view where there
// is one), where the estimate remembers sending it keeps it there: a
// stale affinity, so that a group's miss lands on its own server.
func TestPrefixScorerKeepsStaleAffinityWhenNoneHolds(t *testing.T) {
	t.Parallel()
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 1, CharsPerToken: 4})
	hashes := h.Hash(nil, "m", "aaaabbbbccccddddeeeeffffgggghhhh") // 8 blocks
	idx := prefix.NewIndex(prefix.Config{})
	idx.Add("b", hashes[:8]) // b had it; its events say it was evicted
	cache := fakeCache{tokens: 400, cached: map[string]int{"a": 0, "b": 0, "c": 0}}
	p := &prefixScorer{Index: idx, Guard: DefaultLoadGuard}
	var sc Scratch
	req := Request{Now: now, Hashes: hashes, BlockTokens: 4, Cache: cache, scratch: &sc}
	got := make([]float64, 3)
	p.Score(&req, mkEps(m{}, m{}, m{}), got)
	inDelta(t, got, []float64{0, 1, 0})
	// It predicts nothing cached there.
	if n, ok := sc.CachedTokens("b"); !ok || n != 0 {
		t.Errorf("CachedTokens(b) = %d, %v", n, ok)
	}
	// One endpoint holding some: the exact view alone decides.
	cache.cached["c"] = 100
	clear(got)
	p.Score(&req, mkEps(m{}, m{}, m{}), got)
	inDelta(t, got, []float64{0, 0, 0.25})
}
