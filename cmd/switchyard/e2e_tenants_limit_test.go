package main

// How well a tenant's token budget holds under load, one switchyard and
// three replicas. Long (over a minute each): only with SWITCHYARD_BENCH=1.
//
//	SWITCHYARD_BENCH=1 go test -run 'TestE2ETenantTokenLimit' -v -timeout 10m ./cmd/switchyard/

import (
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/apikey"
)

// limitRun is the outcome of an open-loop load against a tenant's budget.
type limitRun struct {
	mu       sync.Mutex
	admitted []admittedReq // 200s, by send time
	limited  int           // 429s
	failed   []string      // anything else
}

type admittedReq struct {
	sent   time.Time
	tokens int64 // prompt + completion, as the response reported
}

// drive sends rate requests per second for d through base, each an
// open-loop completion of about tokensPerReq tokens for key.
func drive(c *http.Client, base, key string, rate float64, d time.Duration, maxTokens int) *limitRun {
	run := &limitRun{}
	var wg sync.WaitGroup
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	for i := 0; time.Since(start) < d; i++ {
		next := start.Add(time.Duration(i) * interval)
		time.Sleep(time.Until(next))
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"m-a","prompt":"request %d asks about the budget of its tenant","max_tokens":%d,"min_tokens":%d,"ignore_eos":true}`, i, maxTokens, maxTokens)
			sent := time.Now()
			r, err := postTo(c, base, "/v1/completions", body, "authorization", "Bearer "+key)
			run.mu.Lock()
			defer run.mu.Unlock()
			switch {
			case err != nil:
				run.failed = append(run.failed, err.Error())
			case r.status == http.StatusTooManyRequests:
				run.limited++
			case r.status == http.StatusOK:
				p, c, ok := lastUsage(r.body)
				if !ok {
					run.failed = append(run.failed, "no usage: "+r.body)
					return
				}
				run.admitted = append(run.admitted, admittedReq{sent: sent, tokens: p + c})
			default:
				run.failed = append(run.failed, fmt.Sprintf("%d %s", r.status, r.body))
			}
		}()
	}
	wg.Wait()
	sort.Slice(run.admitted, func(i, j int) bool { return run.admitted[i].sent.Before(run.admitted[j].sent) })
	return run
}

// worstMinute returns the most tokens admitted within any minute of the
// run (windows starting at each admitted request), and the tokens offered
// per minute on average.
func (run *limitRun) worstMinute() (worst int64, at time.Duration) {
	a := run.admitted
	j := 0
	var sum int64
	for i := range a {
		for j < len(a) && a[j].sent.Sub(a[i].sent) < time.Minute {
			sum += a[j].tokens
			j++
		}
		if sum > worst {
			worst, at = sum, a[i].sent.Sub(a[0].sent)
		}
		sum -= a[i].tokens
	}
	return worst, at
}

func tokenLimitConfig(sims []*sim, hash string, tpm int) string {
	addrs := make([]string, len(sims))
	for i, s := range sims {
		addrs[i] = s.Addr
	}
	return fmt.Sprintf(`
pool "p" {
  endpoints = [%s]
}
model "m-a" { pool = "p" }
tenant "team-a" {
  api_keys = [%q]
  limits {
    tokens_per_minute = %d
  }
}
`, quoteList(addrs), hash, tpm)
}

// Load shape: ~80-token requests (about 20 prompt and 60 completion
// tokens; the picker reserves its estimate of the prompt plus max_tokens
// at admission and settles with the reported usage).
const (
	limitTPM       = 12000
	limitMaxTokens = 60
	limitDuration  = 75 * time.Second
)

// TestE2ETenantTokenLimit offers a tenant 3x its tokens_per_minute for
// 75 s through one switchyard and reports the most tokens any minute
// admitted, against the budget (target: within 10 %).
func TestE2ETenantTokenLimit(t *testing.T) {
	if os.Getenv("SWITCHYARD_BENCH") != "1" {
		t.Skip("over a minute long: set SWITCHYARD_BENCH=1")
	}
	key, hash, _ := apikey.New()
	sims := []*sim{startSim(t, simOptions{}), startSim(t, simOptions{})}
	f := newFleet(t, tokenLimitConfig(sims, hash, limitTPM), fleetOptions{})
	reportLimit(t, "1 switchyard, 3x the budget", drive(f.client, "http://"+f.listen, key, 3*limitTPM/80.0/60, limitDuration, limitMaxTokens), limitTPM)
}

// TestE2ETenantTokenLimitReplicas is the same with three replicas behind
// one Envoy at 2x the budget: each enforces a third of it.
func TestE2ETenantTokenLimitReplicas(t *testing.T) {
	if os.Getenv("SWITCHYARD_BENCH") != "1" {
		t.Skip("over a minute long: set SWITCHYARD_BENCH=1")
	}
	key, hash, _ := apikey.New()
	sims := []*sim{startSim(t, simOptions{}), startSim(t, simOptions{})}
	f := newReplicaFleet(t, 3, tokenLimitConfig(sims, hash, limitTPM), replicaOptions{peers: true})
	reportLimit(t, "3 replicas, 2x the budget", drive(f.client, "http://"+f.listen, key, 2*limitTPM/80.0/60, limitDuration, limitMaxTokens), limitTPM)
	for _, r := range f.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("replica %s: %d requests", r.id, st.Picker.Requests)
	}
}

func reportLimit(t *testing.T, what string, run *limitRun, budget int64) {
	t.Helper()
	if len(run.failed) > 0 {
		t.Fatalf("%s: %d requests failed, e.g. %s", what, len(run.failed), run.failed[0])
	}
	var total int64
	for _, a := range run.admitted {
		total += a.tokens
	}
	worst, at := run.worstMinute()
	over := float64(worst-budget) / float64(budget) * 100
	t.Logf("%s: %d admitted (%d tokens), %d refused with 429; worst minute (from +%v) admitted %d tokens against %d: %+.1f %%",
		what, len(run.admitted), total, run.limited, at.Round(time.Second), worst, budget, over)
	if run.limited == 0 {
		t.Errorf("%s: nothing was refused: the load did not exceed the budget", what)
	}
	if over > 10 {
		t.Errorf("%s: the worst minute overshoots the budget by %.1f %% (target <= 10 %%)", what, over)
	}
}

// burstOutput is what the simulators generate for a request without
// max_tokens in TestE2ETenantBurstWithoutMaxTokens (-default-max-tokens).
const burstOutput = 300

// burst sends n completions for key at once, none with max_tokens, and
// returns the tokens the admitted ones used (as their usage reports) and
// how many were refused with 429.
func burst(t *testing.T, f *fleet, key string, n int) (admitted, tokens int64, limited int) {
	t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	var failed []string
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"m-a","prompt":"burst request %d asks about its tenant's budget"}`, i)
			r, err := f.post("/v1/completions", body, "authorization", "Bearer "+key)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				failed = append(failed, err.Error())
			case r.status == http.StatusTooManyRequests:
				limited++
			case r.status == http.StatusOK:
				p, c, ok := lastUsage(r.body)
				if !ok {
					failed = append(failed, "no usage: "+r.body)
					return
				}
				admitted++
				tokens += p + c
			default:
				failed = append(failed, fmt.Sprintf("%d %s", r.status, r.body))
			}
		}()
	}
	wg.Wait()
	if len(failed) > 0 {
		t.Fatalf("%d of %d burst requests failed, e.g. %s", len(failed), n, failed[0])
	}
	return admitted, tokens, limited
}

// TestE2ETenantBurstWithoutMaxTokens sends a tenant, at once, three times
// its tokens_per_minute in completions that set no max_tokens (the
// simulators generate 300 tokens for each). Each reserves its prompt
// estimate plus assumed_max_tokens at admission, so the burst's tokens stay
// within the budget as long as the outputs do not exceed that assumption:
// with the default (1024) and with assumed_max_tokens = 300, the
// simulators' real output.
func TestE2ETenantBurstWithoutMaxTokens(t *testing.T) {
	const tpm = 6000
	keyA, hashA, _ := apikey.New()
	keyB, hashB, _ := apikey.New()
	sims := []*sim{
		startSim(t, simOptions{extra: []string{"-default-max-tokens", strconv.Itoa(burstOutput)}}),
		startSim(t, simOptions{extra: []string{"-default-max-tokens", strconv.Itoa(burstOutput)}}),
	}
	f := newFleet(t, fmt.Sprintf(`
pool "p" {
  endpoints = [%q, %q]
}
model "m-a" { pool = "p" }
tenant "default-assumption" {
  api_keys = [%q]
  limits {
    tokens_per_minute = %d
  }
}
tenant "assumes-300" {
  api_keys = [%q]
  limits {
    tokens_per_minute  = %d
    assumed_max_tokens = %d
  }
}
`, sims[0].Addr, sims[1].Addr, hashA, tpm, hashB, tpm, burstOutput), fleetOptions{})
	// 3x the budget: each request uses about 15 prompt and 300 output tokens.
	n := 3 * tpm / (burstOutput + 15)
	for _, c := range []struct{ tenant, key string }{{"default-assumption", keyA}, {"assumes-300", keyB}} {
		admitted, tokens, limited := burst(t, f, c.key, n)
		over := float64(tokens-tpm) / tpm * 100
		t.Logf("%s: burst of %d requests without max_tokens (3x tokens_per_minute %d): %d admitted using %d tokens (%+.1f %% of the budget), %d refused with 429",
			c.tenant, n, tpm, admitted, tokens, over, limited)
		if limited == 0 || admitted == 0 {
			t.Errorf("%s: %d admitted, %d refused: the burst must be cut, not refused whole", c.tenant, admitted, limited)
		}
		if over > 10 {
			t.Errorf("%s: the burst used %d tokens against a budget of %d (%+.1f %%; bound +10 %%)", c.tenant, tokens, tpm, over)
		}
	}
}
