package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/internal/testutil"
)

// The tests in this file run switchyard and a real Envoy in front of real
// vLLM servers (the CPU build serving a tiny generated model). They skip
// without `make vllm` and run in `make test`'s real-vLLM pass.

// words returns n pseudo-words from the syllables the tiny model's
// tokenizer was trained on (about 1.13 tokens a word), seeded so a prompt
// is the same in every run.
func words(seed uint64, n int) string {
	syl := []string{"ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "de", "pa", "gri",
		"ol", "en", "ast", "ing", "er", "th", "qu", "ix", "um", "bra", "zo"}
	r := rand.New(rand.NewPCG(seed, 7))
	out := make([]string, n)
	for i := range out {
		out[i] = syl[r.IntN(len(syl))] + syl[r.IntN(len(syl))]
	}
	return strings.Join(out, " ")
}

// cachedUsage reads usage.prompt_tokens and prompt_tokens_details.cached_tokens
// from a non-streaming answer.
func cachedUsage(t testing.TB, body []byte) (prompt, cached int) {
	t.Helper()
	var r struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatalf("answer is not JSON: %v: %s", err, truncate(string(body), 300))
	}
	if r.Usage.Details == nil {
		t.Fatalf("answer has no usage.prompt_tokens_details: %s", truncate(string(body), 300))
	}
	return r.Usage.PromptTokens, r.Usage.Details.CachedTokens
}

// realStatus is the part of /api/status these tests read beyond status.
type realStatus struct {
	Pools []struct {
		Name      string `json:"name"`
		Endpoints []struct {
			Address      string   `json:"address"`
			Healthy      bool     `json:"healthy"`
			Waiting      *int     `json:"waiting"`
			Running      *int     `json:"running"`
			KVCacheUsage *float64 `json:"kv_cache_usage"`
			BlockSize    int      `json:"block_size"`
			NumBlocks    int      `json:"num_blocks"`
			MaxLoras     int      `json:"max_loras"`
			Models       []string `json:"models"`
			ModelsFrom   string   `json:"models_from"`
		} `json:"endpoints"`
	} `json:"pools"`
}

func (f *fleet) realStatus() (*realStatus, error) {
	body, err := httpGetString("http://" + f.admin + "/api/status")
	if err != nil {
		return nil, err
	}
	var s realStatus
	if err := json.Unmarshal([]byte(body), &s); err != nil {
		return nil, fmt.Errorf("/api/status: %w", err)
	}
	return &s, nil
}

func TestE2ERealVLLM(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	servers := realvllm.StartFleet(t, py, m,
		realvllm.Options{Name: "tiny"},
		realvllm.Options{Name: "tiny", Adapter: "sql-lora"})
	plain, lora := servers[0], servers[1]

	// No models lists: what each server serves is learned from its
	// /v1/models, so only the second gets the adapter.
	f := newFleet(t, fmt.Sprintf(`
pool "tiny" {
  engine    = "vllm"
  endpoints = [%q, %q]
}
model "tiny" {
  pool = "tiny"
}
model "sql-lora" {
  pool = "tiny"
}
model "chat" {
  pool = "tiny"
  target "tiny" {
    weight = 100
  }
}
`, plain.Addr, lora.Addr), fleetOptions{})
	ctx := context.Background()

	t.Run("LoRA affinity", func(t *testing.T) {
		for i := range 8 {
			resp, err := f.send(infReq{model: "sql-lora", prompt: words(uint64(100+i), 30), maxTokens: 4})
			checkOK(t, resp, err, "sql-lora")
			if resp.servedBy != lora.Addr {
				t.Fatalf("adapter request %d served by %q, want the adapter's server %s", i, resp.servedBy, lora.Addr)
			}
		}
	})

	// After the adapter requests: vLLM publishes lora_requests_info only
	// once the engine has handled a request.
	t.Run("metrics and served models on /api/status", func(t *testing.T) {
		testutil.Eventually(t, 30*time.Second, "real metrics and models on /api/status", func() error {
			s, err := f.realStatus()
			if err != nil {
				return err
			}
			seen := 0
			for _, p := range s.Pools {
				for _, e := range p.Endpoints {
					if e.Waiting == nil || e.Running == nil || e.KVCacheUsage == nil {
						return fmt.Errorf("%s: no scraped load yet", e.Address)
					}
					if e.BlockSize != 32 || e.NumBlocks != 512 {
						return fmt.Errorf("%s: block size %d, blocks %d; want 32 and 512 from cache_config_info", e.Address, e.BlockSize, e.NumBlocks)
					}
					want, wantLoras := []string{"tiny"}, 0
					if e.Address == lora.Addr {
						want, wantLoras = []string{"sql-lora", "tiny"}, 2
					}
					got := slices.Sorted(slices.Values(e.Models))
					if !slices.Equal(got, want) || e.ModelsFrom != "server" {
						return fmt.Errorf("%s: models %v from %q; want %v from the server", e.Address, got, e.ModelsFrom, want)
					}
					if e.MaxLoras != wantLoras {
						page, _ := lora.MetricsPage(ctx)
						return fmt.Errorf("%s: max_loras %d, want %d from lora_requests_info (server page: %q)", e.Address, e.MaxLoras, wantLoras, grepLines(page, "lora_requests_info"))
					}
					seen++
				}
			}
			if seen != 2 {
				return fmt.Errorf("%d endpoints on /api/status, want 2", seen)
			}
			return nil
		})
	})

	t.Run("prefix affinity", func(t *testing.T) {
		before := map[string]realvllm.Counters{}
		for _, s := range servers {
			c, err := s.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			before[s.Addr] = c
		}
		prefix := words(42, 1050) // ~1,200 tokens
		served := map[string]int{}
		hits := 0
		for i := range 12 {
			resp, err := f.send(infReq{model: "tiny", prompt: prefix + " " + words(uint64(1000+i), 20), maxTokens: 4})
			checkOK(t, resp, err, "tiny")
			served[resp.servedBy]++
			prompt, cached := cachedUsage(t, resp.body)
			if prompt < 1100 || prompt > 1400 {
				t.Fatalf("prompt is %d tokens, the test wants ~1,200", prompt)
			}
			if cached > 0 {
				hits++
			}
			t.Logf("request %d: %s, %d prompt tokens, %d cached", i, resp.servedBy, prompt, cached)
		}
		if len(served) != 1 {
			t.Fatalf("12 requests sharing a prefix went to %v; want one server", served)
		}
		if hits < 10 {
			t.Fatalf("%d of 12 answers had cached_tokens > 0; want at least 10", hits)
		}
		for _, s := range servers {
			if served[s.Addr] > 0 {
				continue
			}
			c, err := s.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			d := c.Sub(before[s.Addr])
			if d.PrefixQueries != 0 || d.Requests != 0 {
				t.Fatalf("the other server %s computed %v prompt tokens (%v requests) during the test; want none", s.Addr, d.PrefixQueries, d.Requests)
			}
		}
	})

	t.Run("streaming chat with usage through a rewritten name", func(t *testing.T) {
		resp, err := f.send(infReq{chat: true, stream: true, model: "chat", prompt: words(7, 40), maxTokens: 6})
		checkOK(t, resp, err, "chat")
		if !resp.done || resp.completion != 6 {
			t.Fatalf("stream done=%v, usage.completion_tokens=%d; want [DONE] and 6", resp.done, resp.completion)
		}
		resp, err = f.send(infReq{chat: true, model: "chat", prompt: words(8, 40), maxTokens: 3})
		checkOK(t, resp, err, "chat")
	})

	t.Run("unknown model is a 404 from switchyard", func(t *testing.T) {
		resp, err := f.send(infReq{model: "no-such-model", prompt: "x", maxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		if resp.status != http.StatusNotFound || resp.servedBy != "" {
			t.Fatalf("status %d served by %q: %s; want 404 from the picker", resp.status, resp.servedBy, resp.body)
		}
	})

	t.Run("server stopped under load", func(t *testing.T) {
		var (
			stop     atomic.Bool
			markedAt atomic.Int64 // unix nanos when the picker marked it down
			mu       sync.Mutex
			after5xx []string
			okAfter  int
			total    atomic.Int64
			wg       sync.WaitGroup
		)
		for w := range 4 {
			wg.Go(func() {
				for i := 0; !stop.Load(); i++ {
					start := time.Now().UnixNano()
					resp, err := f.send(infReq{model: "tiny", prompt: words(uint64(w*100000+i), 40), maxTokens: 4})
					total.Add(1)
					marked := markedAt.Load()
					if marked == 0 || start < marked {
						continue // sent before the server was known to be down
					}
					mu.Lock()
					switch {
					case err != nil:
						after5xx = append(after5xx, err.Error())
					case resp.status >= 500:
						after5xx = append(after5xx, fmt.Sprintf("%d %s", resp.status, truncate(string(resp.body), 120)))
					case resp.status == http.StatusOK:
						okAfter++
					}
					mu.Unlock()
				}
			})
		}
		defer func() { stop.Store(true); wg.Wait() }()
		// Let load flow, then stop the plain server under it.
		testutil.Eventually(t, 60*time.Second, "load flowing", func() error {
			if n := total.Load(); n < 8 {
				return fmt.Errorf("%d answers so far", n)
			}
			return nil
		})
		plain.Stop()
		testutil.Eventually(t, 60*time.Second, "stopped server marked down", func() error {
			s, err := f.realStatus()
			if err != nil {
				return err
			}
			for _, p := range s.Pools {
				for _, e := range p.Endpoints {
					if e.Address == plain.Addr && e.Healthy {
						return fmt.Errorf("%s still healthy", e.Address)
					}
				}
			}
			return nil
		})
		markedAt.Store(time.Now().UnixNano())
		testutil.Eventually(t, 60*time.Second, "requests served after the mark-down", func() error {
			mu.Lock()
			defer mu.Unlock()
			if okAfter < 40 {
				return fmt.Errorf("%d served so far", okAfter)
			}
			return nil
		})
		stop.Store(true)
		wg.Wait()
		if len(after5xx) > 0 {
			t.Fatalf("%d failures after the server was marked down (%d served): %v", len(after5xx), okAfter, after5xx[:min(5, len(after5xx))])
		}
		t.Logf("after mark-down: %d served, 0 failed", okAfter)
	})
}

// grepLines returns the lines of s that contain sub, for failure messages.
func grepLines(s, sub string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return out
}

// TestE2ERealVLLMHitRate gives two real servers more distinct prefixes
// than one server's KV cache holds, and compares the prefix-cache hit
// rate (vLLM's own prefix_cache_hits/queries, in tokens) of round-robin
// straight to the servers with switchyard's through Envoy, on the same
// request sequence. With one prefix both would hit; here only routing that
// keeps each prefix on one server keeps it cached.
func TestE2ERealVLLMHitRate(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	// 96 blocks of 32 tokens: 3,072 tokens, about 3.8 of the ~800-token
	// prefixes below; the six need 150 blocks, the pair of servers 192.
	opts := realvllm.Options{Name: "tiny", GPUBlocks: 96}
	servers := realvllm.StartFleet(t, py, m, opts, opts)
	f := newFleet(t, fmt.Sprintf(`
pool "tiny" {
  engine    = "vllm"
  endpoints = [%q, %q]
}
model "tiny" {
  pool = "tiny"
}
`, servers[0].Addr, servers[1].Addr), fleetOptions{})
	ctx := context.Background()

	const prefixes, rounds, workers = 6, 5, 2
	type job struct{ prompt string }
	var jobs []job
	r := rand.New(rand.NewPCG(3, 3))
	for round := range rounds {
		for _, p := range r.Perm(prefixes) {
			jobs = append(jobs, job{words(uint64(500+p), 700) + " " + words(uint64(9000+round*prefixes+p), 12)})
		}
	}
	counters := func() realvllm.Counters {
		var sum realvllm.Counters
		for _, s := range servers {
			c, err := s.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			sum.PrefixQueries += c.PrefixQueries
			sum.PrefixHits += c.PrefixHits
			sum.Requests += c.Requests
		}
		return sum
	}
	// run sends every job with `workers` in flight, in order; send(i, j)
	// sends job j as the i-th request.
	run := func(send func(i int, j job) error) float64 {
		before := counters()
		next := atomic.Int64{}
		var wg sync.WaitGroup
		errs := make(chan error, len(jobs))
		for range workers {
			wg.Go(func() {
				for {
					i := int(next.Add(1)) - 1
					if i >= len(jobs) {
						return
					}
					if err := send(i, jobs[i]); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		d := counters().Sub(before)
		if d.Requests != float64(len(jobs)) {
			t.Fatalf("servers finished %v requests, want %d", d.Requests, len(jobs))
		}
		return d.PrefixHits / d.PrefixQueries
	}
	client := &http.Client{Timeout: time.Minute}
	rr := run(func(i int, j job) error {
		resp, err := sendTo(client, servers[i%2].URL(), infReq{model: "tiny", prompt: j.prompt, maxTokens: 2}, nil)
		if err == nil && resp.status != http.StatusOK {
			err = fmt.Errorf("round-robin request %d: status %d: %s", i, resp.status, truncate(string(resp.body), 200))
		}
		return err
	})
	for _, s := range servers {
		if err := s.ResetPrefixCache(ctx); err != nil {
			t.Fatal(err)
		}
	}
	perServer := map[string]int{}
	var mu sync.Mutex
	sy := run(func(i int, j job) error {
		resp, err := f.send(infReq{model: "tiny", prompt: j.prompt, maxTokens: 2})
		if err == nil && resp.status != http.StatusOK {
			err = fmt.Errorf("switchyard request %d: status %d: %s", i, resp.status, truncate(string(resp.body), 200))
		}
		if err == nil {
			mu.Lock()
			perServer[resp.servedBy]++
			mu.Unlock()
		}
		return err
	})
	t.Logf("prefix-cache hit rate over %d requests (%d prefixes of ~800 tokens, KV for ~3.8 per server): switchyard %.3f, round-robin %.3f; switchyard spread %v",
		len(jobs), prefixes, sy, rr, perServer)
	if sy < rr+0.15 {
		t.Fatalf("switchyard's hit rate %.3f does not beat round-robin's %.3f by 0.15", sy, rr)
	}
}
