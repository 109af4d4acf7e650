package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/switchyard/switchyard/internal/realvllm"
)

// The simulator's KV cache is held to real vLLM's under pressure: the same
// sequence of token-id prompts goes to a real vLLM 0.32 server and to the
// simulator, both with 32-token blocks (the smallest the CPU build takes) and 512 KV blocks, one request at
// a time, and each request's usage.prompt_tokens_details.cached_tokens
// (what survived of its prefix) must be the same. The sequence fills the
// cache with prompts, then adds new ones and repeats old ones, so the
// answers show which blocks a full cache gives up first: the least
// recently freed, a prompt's tail before its head, never-cached blocks
// before any cached one.

const evictionFile = "eviction.json"

// evictionConfig is the cache both servers run with.
var evictionConfig = struct{ blockSize, blocks, maxModelLen int }{32, 512, 2048}

// evictionStep is one request of the trace: prompt number Prompt (a
// fixed token sequence of Blocks full blocks plus Extra tokens), one
// output token.
type evictionStep struct {
	Prompt int `json:"prompt"`
	Blocks int `json:"blocks"`
	Extra  int `json:"extra"`
	// Cached is the cached_tokens the server reported.
	Cached int `json:"cached"`
}

// evictionSteps is the trace without answers. Prompts 0-7 (61 blocks,
// the last one partial) fill 488 of the 511 usable blocks (vLLM keeps
// one as its null block); prompt 8 then evicts 30 blocks, and repeating
// 0 and 1 shows which: the tail of the least recently freed prompt, after
// the free blocks that hold no cached content. Then a seeded mix of 20
// prompts of 10-63 blocks, a third of the time one of the last three
// sent, shows the order in which prompts age out.
func evictionSteps() []evictionStep {
	size := func(p int) (int, int) {
		if p <= 8 {
			return 60, 8
		}
		return 10 + (p*37)%54, (p * 13) % 32
	}
	var s []evictionStep
	add := func(p int) {
		b, x := size(p)
		s = append(s, evictionStep{Prompt: p, Blocks: b, Extra: x})
	}
	for p := range 9 {
		add(p)
	}
	add(0)
	add(1)
	r := rand.New(rand.NewPCG(27, 1))
	recent := []int{1, 0, 8}
	for range 45 {
		p := r.IntN(20)
		if r.IntN(3) == 0 {
			p = recent[r.IntN(len(recent))]
		}
		add(p)
		recent = append([]int{p}, recent[:2]...)
	}
	return s
}

// evictionPrompt is prompt p's token ids: n tokens from its own seeded
// stream (ids 2-2047: the tiny model's vocabulary, past BOS and EOS), so
// prompts share no block.
func evictionPrompt(p, n int) []int {
	r := rand.New(rand.NewPCG(uint64(p)+1, 0x5eed))
	out := make([]int, n)
	for i := range out {
		out[i] = 2 + r.IntN(2046)
	}
	return out
}

// runEvictionTrace sends the steps to the server at base and returns
// them with the cached tokens it reported.
func runEvictionTrace(t *testing.T, base, model string) []evictionStep {
	t.Helper()
	steps := evictionSteps()
	for i := range steps {
		st := &steps[i]
		body := map[string]any{"model": model, "prompt": evictionPrompt(st.Prompt, st.Blocks*evictionConfig.blockSize+st.Extra),
			"max_tokens": 1, "ignore_eos": true}
		got := send(t, base, probe{name: fmt.Sprintf("step %d", i), method: "POST", path: "/v1/completions", body: body})
		if got.Status != 200 {
			t.Fatalf("step %d (prompt %d): status %d: %s", i, st.Prompt, got.Status, got.Body)
		}
		var r struct {
			Usage struct {
				Details *struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(got.Body), &r); err != nil {
			t.Fatalf("step %d: %v: %s", i, err, got.Body)
		}
		if r.Usage.Details != nil {
			st.Cached = r.Usage.Details.Cached
		}
	}
	return steps
}

func loadEvictionTrace(t *testing.T) []evictionStep {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(samplesDir, evictionFile))
	if err != nil {
		t.Fatalf("recorded eviction trace: %v (record with SWITCHYARD_RECORD=1 go test -run TestRealVLLMEvictionTrace ./cmd/vllm-sim)", err)
	}
	var s []evictionStep
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// compareTraces fails where got's cached tokens differ from want's.
func compareTraces(t *testing.T, who string, want, got []evictionStep) {
	t.Helper()
	clean := func(s []evictionStep) []evictionStep {
		out := slices.Clone(s)
		for i := range out {
			out[i].Cached = 0
		}
		return out
	}
	if !slices.Equal(clean(want), clean(got)) {
		t.Fatalf("the recorded trace is of other steps than evictionSteps(): record it again")
	}
	for i := range want {
		if want[i].Cached != got[i].Cached {
			t.Errorf("step %d (prompt %d, %d blocks + %d): %s reports %d cached tokens, real vLLM %d",
				i, want[i].Prompt, want[i].Blocks, want[i].Extra, who, got[i].Cached, want[i].Cached)
		}
	}
}

// TestRealVLLMEvictionTrace runs the trace on a real vLLM server and checks
// it still answers as recorded; SWITCHYARD_RECORD=1 records it instead.
func TestRealVLLMEvictionTrace(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	srv := realvllm.StartFleet(t, py, m, realvllm.Options{Name: "tiny", BlockSize: evictionConfig.blockSize,
		GPUBlocks: evictionConfig.blocks, MaxModelLen: evictionConfig.maxModelLen})[0]
	got := runEvictionTrace(t, srv.URL(), "tiny")
	if os.Getenv("SWITCHYARD_RECORD") == "1" {
		b, err := json.MarshalIndent(got, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(samplesDir, evictionFile), append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("recorded %d steps into %s", len(got), filepath.Join(samplesDir, evictionFile))
		return
	}
	compareTraces(t, "real vLLM now", loadEvictionTrace(t), got)
}

// TestSimEvictionMatchesRealVLLM holds the simulator's cache to the
// recorded trace.
func TestSimEvictionMatchesRealVLLM(t *testing.T) {
	want := loadEvictionTrace(t)
	s := startSim(t, "-model", "tiny", "-max-model-len", fmt.Sprint(evictionConfig.maxModelLen),
		"-block-size", fmt.Sprint(evictionConfig.blockSize), "-num-gpu-blocks", fmt.Sprint(evictionConfig.blocks))
	compareTraces(t, "vllm-sim", want, runEvictionTrace(t, "http://"+s.addr, "tiny"))
}
