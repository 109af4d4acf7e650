package sim

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// virtualLoad runs the shared-prefix workload against an engine on a
// ManualClock: a discrete-event simulation that measures what the model
// itself predicts, immune to CPU contention on the test machine. The
// frontend latency is added to each request's arrival instead of being
// slept in Submit. rate > 0 is Poisson open loop; otherwise `users` closed
// loop users without think time.
func virtualLoad(t testing.TB, cfg Config, fresh bool, rate float64, users int, warmup, window time.Duration) loadResult {
	t.Helper()
	frontend := cfg.FrontendLatency
	cfg.FrontendLatency = 0
	clk := NewManualClock(t0)
	e, err := New(cfg, clk)
	if err != nil {
		t.Fatal(err)
	}
	w := newSharedPrefix(fresh)
	rng := rand.New(rand.NewPCG(3, 4))
	type pending struct {
		at   time.Time // arrival at the API server
		user int
	}
	type live struct {
		h       *Handle
		arrival time.Time
		user    int
		first   bool
	}
	var queue []pending // sorted by at
	push := func(p pending) {
		i, _ := slices.BinarySearchFunc(queue, p.at, func(a pending, t time.Time) int { return a.at.Compare(t) })
		queue = slices.Insert(queue, i, p)
	}
	measureFrom, end := t0.Add(warmup), t0.Add(warmup+window)
	if rate > 0 {
		for at := t0; at.Before(end); at = at.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second))) {
			push(pending{at: at, user: rng.IntN(100)})
		}
	} else {
		for u := range users { // staggered over 1 s so users do not move in lockstep
			push(pending{at: t0.Add(time.Duration(u) * time.Second / time.Duration(users)), user: u})
		}
	}
	var res loadResult
	res.window = window
	var inflight []*live
	for clk.Now().Before(end) {
		// Requests whose frontend latency has elapsed enter the engine.
		now := clk.Now()
		for len(queue) > 0 && !queue[0].at.Add(frontend).After(now) {
			p := queue[0]
			queue = queue[1:]
			h, err := e.Submit(context.Background(), Request{Prompt: w.prompt(p.user % 100), MaxTokens: 64})
			if err != nil {
				t.Fatal(err)
			}
			inflight = append(inflight, &live{h: h, arrival: p.at, user: p.user, first: true})
		}
		if !e.Step(context.Background()) {
			if len(queue) == 0 {
				break
			}
			clk.SleepUntil(context.Background(), queue[0].at.Add(frontend))
			continue
		}
		now = clk.Now()
		keep := inflight[:0]
		for _, l := range inflight {
			done := false
		drain:
			for {
				select {
				case ev := <-l.h.Events:
					if l.first && !l.arrival.Before(measureFrom) {
						res.ttfts = append(res.ttfts, now.Sub(l.arrival))
					}
					l.first = false
					if ev.Done {
						done = true
						if now.After(measureFrom) {
							res.completed++
						}
						if rate <= 0 {
							push(pending{at: now, user: l.user})
						}
						break drain
					}
				default:
					break drain
				}
			}
			if !done {
				keep = append(keep, l)
			}
		}
		inflight = keep
	}
	return res
}

func quantile(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[int(p*float64(len(s)-1))]
}

// TestCalibrationVirtualTime checks the default configuration against the
// spec's Llama-3-8B/H100 calibration in simulated time, with users asking
// fresh questions (only system prompts cacheable): TTFT p50 of 25-40 ms at
// low load, and a saturation throughput between 90 and 200 req/s with prefix
// caching, lower without it.
func TestCalibrationVirtualTime(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates tens of thousands of engine steps")
	}
	low := virtualLoad(t, DefaultConfig(), true, 10, 0, 2*time.Second, 20*time.Second)
	p50 := quantile(low.ttfts, 0.5)
	t.Logf("10 req/s: TTFT p50 %v p99 %v, %.1f req/s", p50, quantile(low.ttfts, 0.99), float64(low.completed)/low.window.Seconds())
	if p50 < 25*time.Millisecond || p50 > 40*time.Millisecond {
		t.Errorf("low-load TTFT p50 = %v, want 25-40 ms", p50)
	}
	sat := func(caching bool) float64 {
		cfg := DefaultConfig()
		cfg.EnablePrefixCaching = caching
		r := virtualLoad(t, cfg, true, 400, 0, 5*time.Second, 10*time.Second)
		x := float64(r.completed) / r.window.Seconds()
		t.Logf("400 req/s offered, caching=%v: %.1f req/s completed", caching, x)
		return x
	}
	with, without := sat(true), sat(false)
	if with < 90 || with > 200 {
		t.Errorf("saturation with prefix caching = %.1f req/s, want 90-200", with)
	}
	if without >= with*0.8 {
		t.Errorf("saturation without caching %.1f req/s is not clearly below %.1f with caching", without, with)
	}
}

// BenchmarkCalibrationVirtual logs a rate sweep in simulated time (run with
// -benchtime 1x -v); it takes a few seconds of CPU.
func BenchmarkCalibrationVirtual(b *testing.B) {
	for range b.N {
		for _, fresh := range []bool{true, false} {
			for _, caching := range []bool{true, false} {
				for _, rate := range []float64{10, 50, 100, 150, 200, 400} {
					cfg := DefaultConfig()
					cfg.EnablePrefixCaching = caching
					r := virtualLoad(b, cfg, fresh, rate, 0, 5*time.Second, 10*time.Second)
					b.Logf("fresh_questions=%v caching=%v rate=%v: %.1f req/s, TTFT p50 %v p99 %v", fresh, caching, rate,
						float64(r.completed)/r.window.Seconds(), quantile(r.ttfts, 0.5), quantile(r.ttfts, 0.99))
				}
				cfg := DefaultConfig()
				cfg.EnablePrefixCaching = caching
				r := virtualLoad(b, cfg, fresh, 0, 100, 5*time.Second, 10*time.Second)
				b.Logf("fresh_questions=%v caching=%v 100 closed-loop users: %.1f req/s, TTFT p50 %v", fresh, caching,
					float64(r.completed)/r.window.Seconds(), quantile(r.ttfts, 0.5))
			}
		}
	}
}
