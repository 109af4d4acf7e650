package sim

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// The engine's KV events describe its prefix cache exactly: replaying
// them after every step gives the cached hashes, with their copies,
// whatever the eviction pressure, preemption and adapters did.
func TestKVEventsMirrorTheCache(t *testing.T) {
	held := map[uint64]int{}
	var stores, removals, clears int
	var bad []string
	e, clk := testEngine(t, func(c *Config) {
		c.NumGPUBlocks, c.BlockSize, c.MaxNumSeqs, c.MaxNumBatchedTokens = 40, 4, 6, 48
		c.OnKVEvents = func(evs []KVEvent) {
			for _, ev := range evs {
				switch ev.Kind {
				case KVStored:
					stores++
					if ev.HasParent && held[ev.Parent] == 0 {
						bad = append(bad, fmt.Sprintf("stored run on unknown parent %x", ev.Parent))
					}
					if len(ev.Tokens) < len(ev.Hashes)*4 {
						bad = append(bad, fmt.Sprintf("%d tokens for %d blocks", len(ev.Tokens), len(ev.Hashes)))
					}
					for _, h := range ev.Hashes {
						held[h]++
					}
				case KVRemoved:
					removals++
					for _, h := range ev.Hashes {
						if held[h] == 0 {
							bad = append(bad, fmt.Sprintf("removed unknown %x", h))
						}
						if held[h]--; held[h] == 0 {
							delete(held, h)
						}
					}
				case KVCleared:
					clears++
					clear(held)
				}
			}
		}
	})
	tr := newTracker(e, clk)
	rng := rand.New(rand.NewPCG(3, 4))
	prefixes := [][]uint32{nTokens("a", 24), nTokens("b", 16), nTokens("c", 30)}
	check := func() {
		t.Helper()
		if len(bad) > 0 {
			t.Fatal(bad)
		}
		want := map[uint64]int{}
		for h, list := range e.kv.byHash {
			want[h] = len(list)
		}
		if len(want) != len(held) {
			t.Fatalf("events hold %d hashes, the cache %d", len(held), len(want))
		}
		for h, n := range want {
			if held[h] != n {
				t.Fatalf("hash %x: %d copies by events, %d in the cache", h, held[h], n)
			}
		}
	}
	for round := range 30 {
		for range 1 + rng.IntN(5) {
			p := concat(prefixes[rng.IntN(len(prefixes))], nTokens(fmt.Sprint("q", rng.IntN(9)), 1+rng.IntN(20)))
			lora := ""
			if rng.IntN(3) == 0 {
				lora = "sql"
			}
			tr.submit(t, Request{Prompt: p, MaxTokens: 1 + rng.IntN(12), LoRA: lora})
		}
		for range 1 + rng.IntN(6) {
			tr.step(t)
			check()
		}
		if round == 20 {
			tr.run(t)
			if !e.ResetPrefixCache() {
				t.Fatal("reset of an idle engine failed")
			}
			tr.submit(t, Request{Prompt: prefixes[0], MaxTokens: 1})
			tr.step(t) // the clear goes out with the next step
			check()
		}
	}
	tr.run(t)
	check()
	if stores == 0 || removals == 0 || clears != 1 {
		t.Fatalf("stores %d removals %d clears %d: the workload did not exercise eviction", stores, removals, clears)
	}
	// A busy engine refuses a reset, as vLLM does.
	tr.submit(t, Request{Prompt: prefixes[1], MaxTokens: 50})
	tr.step(t)
	if e.ResetPrefixCache() {
		t.Fatal("reset with a running request succeeded")
	}
}
