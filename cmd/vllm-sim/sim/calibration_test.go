package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Calibration benchmarks drive one engine in real time (time scale 1) with
// the shared-prefix workload the spec calibrates against: 10 groups x 10
// users, a 128-token system prompt per group, a 64-token question per user,
// 64 output tokens. Run them with
//
//	go test -run '^$' -bench Calibration -benchtime 1x ./cmd/vllm-sim/sim/
//
// They report ttft_p50_ms, ttft_p99_ms and the completed req/s.

// sharedPrefix is the calibration workload. With freshQuestions every
// request carries a new 64-token question (users keep asking new things), so
// only the group's system prompt can come from the prefix cache; without it
// each user repeats one fixed question and whole prompts are cached.
type sharedPrefix struct {
	systems        []string
	freshQuestions bool
	n              int
}

func newSharedPrefix(freshQuestions bool) *sharedPrefix {
	w := &sharedPrefix{freshQuestions: freshQuestions}
	for g := range 10 {
		var sys strings.Builder
		for i := range 128 {
			fmt.Fprintf(&sys, "%c%03d ", 'a'+g, i) // 4 chars: one token each
		}
		w.systems = append(w.systems, sys.String())
	}
	return w
}

// prompt returns the next prompt of user (0..99); group = user/10.
func (w *sharedPrefix) prompt(user int) []uint32 {
	w.n++
	seed := user
	if w.freshQuestions {
		seed = w.n*100 + user
	}
	var q strings.Builder
	for i := range 64 {
		fmt.Fprintf(&q, "%04x ", (seed*64+i)&0xffff) // one token each
	}
	toks := Tokenize(RenderChat([]Message{{"system", w.systems[(user/10)%10]}, {"user", q.String()}}))
	if len(toks) != 201 { // 128 + 64 + 9 for the chat markers
		panic(fmt.Sprintf("calibration prompt has %d tokens, want 201", len(toks)))
	}
	return toks
}

type loadResult struct {
	ttfts     []time.Duration
	completed int // requests finished inside the measurement window
	window    time.Duration
}

func (r loadResult) report(b *testing.B) {
	slices.Sort(r.ttfts)
	q := func(p float64) float64 {
		if len(r.ttfts) == 0 {
			return 0
		}
		return float64(r.ttfts[int(p*float64(len(r.ttfts)-1))]) / float64(time.Millisecond)
	}
	b.ReportMetric(q(0.5), "ttft_p50_ms")
	b.ReportMetric(q(0.99), "ttft_p99_ms")
	b.ReportMetric(float64(r.completed)/r.window.Seconds(), "req/s")
	b.ReportMetric(0, "ns/op")
}

// runLoad sends requests for warmup+window, open loop at rate per second
// (Poisson) when rate > 0, otherwise closed loop with `users` concurrent
// users. TTFTs and completions are counted for requests sent after warmup.
func runLoad(b *testing.B, cfg Config, rate float64, users int, warmup, window time.Duration) loadResult {
	e, err := New(cfg, RealClock{})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go e.Run(ctx)
	w := newSharedPrefix(true)
	var wmu sync.Mutex
	next := func(user int) []uint32 {
		wmu.Lock()
		defer wmu.Unlock()
		return w.prompt(user)
	}
	start := time.Now()
	measureFrom, end := start.Add(warmup), start.Add(warmup+window)

	var mu sync.Mutex
	var res loadResult
	res.window = window
	one := func(p []uint32) {
		sent := time.Now()
		h, err := e.Submit(ctx, Request{Prompt: p, MaxTokens: 64})
		if err != nil {
			return
		}
		first := true
		for {
			var ev Event
			select {
			case ev = <-h.Events:
			case <-ctx.Done():
				return
			}
			now := time.Now()
			if first && !sent.Before(measureFrom) {
				mu.Lock()
				res.ttfts = append(res.ttfts, now.Sub(sent))
				mu.Unlock()
			}
			first = false
			if ev.Done {
				if now.After(measureFrom) && now.Before(end) {
					mu.Lock()
					res.completed++
					mu.Unlock()
				}
				return
			}
		}
	}
	var wg sync.WaitGroup
	rng := rand.New(rand.NewPCG(1, 2))
	if rate > 0 {
		at := start
		for at.Before(end) {
			time.Sleep(time.Until(at))
			p := next(rng.IntN(100))
			wg.Add(1)
			go func() { defer wg.Done(); one(p) }()
			at = at.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second)))
		}
	} else {
		for u := range users {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(u) * time.Second / time.Duration(users)) // stagger starts over 1 s
				for time.Now().Before(end) {
					one(next(u % 100))
				}
			}()
		}
	}
	// Requests still queued at the end would take long to drain under
	// overload; cancel them instead of waiting.
	time.Sleep(time.Until(end))
	cancel()
	wg.Wait()
	return res
}

func BenchmarkCalibrationLowLoad(b *testing.B) {
	for range b.N {
		runLoad(b, DefaultConfig(), 10, 0, time.Second, 5*time.Second).report(b)
	}
}

func BenchmarkCalibrationOpenLoop(b *testing.B) {
	for _, rate := range []float64{50, 100, 150, 200, 300} {
		for _, caching := range []bool{true, false} {
			b.Run(fmt.Sprintf("rate=%v/caching=%v", rate, caching), func(b *testing.B) {
				cfg := DefaultConfig()
				cfg.EnablePrefixCaching = caching
				for range b.N {
					runLoad(b, cfg, rate, 0, 2*time.Second, 4*time.Second).report(b)
				}
			})
		}
	}
}

func BenchmarkCalibrationClosedLoop100Users(b *testing.B) {
	for _, caching := range []bool{true, false} {
		b.Run(fmt.Sprintf("caching=%v", caching), func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.EnablePrefixCaching = caching
			for range b.N {
				runLoad(b, cfg, 0, 100, 2*time.Second, 4*time.Second).report(b)
			}
		})
	}
}
