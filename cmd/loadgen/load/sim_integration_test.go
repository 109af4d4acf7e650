package load_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/testutil"
)

// startSim runs a real cmd/vllm-sim on a free loopback port, 20x faster
// than real time, and returns its address.
func startSim(t *testing.T) string {
	t.Helper()
	port := testutil.FreePort(t)
	testutil.Start(t, "vllm-sim", testutil.Binary(t, "vllm-sim"),
		"-port", strconv.Itoa(port), "-model", "sim-model", "-time-scale", "20", "-log-level", "warn")
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	testutil.WaitHTTP(t, "http://"+addr+"/health", 15*time.Second)
	return addr
}

// A shared-prefix run against the real simulator: every request succeeds,
// later requests of a group hit the prefix cache, and x-served-by names the
// simulator.
func TestAgainstVLLMSim(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a vllm-sim process")
	}
	addr := startSim(t)
	cases := []struct {
		api      load.API
		workload load.Workload
	}{
		{load.APICompletions, load.Workload{Kind: load.WorkloadSharedPrefix, Groups: 2, UsersPerGroup: 4, SystemLen: 64, QuestionLen: 16, Output: load.Fixed(8)}},
		{load.APIChat, load.Workload{Kind: load.WorkloadMultiTurn, Sessions: 3, Turns: 3, SystemLen: 32, QuestionLen: 16, Output: load.Fixed(8)}},
	}
	for _, tc := range cases {
		t.Run(string(tc.workload.Kind), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			rep, err := load.Run(ctx, load.Config{
				URL: "http://" + addr, API: tc.api, Model: "sim-model",
				Workload: tc.workload,
				Arrival:  load.ArrivalConstant, Stages: []load.Stage{{Rate: 20, Duration: time.Second}},
				Seed: 3, Timeout: 20 * time.Second, DrainTimeout: 20 * time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			tot := rep.Total
			if tot.Sent+tot.SessionsBusy != 20 || tot.Completed != tot.Sent || tot.Sent < 10 {
				t.Fatalf("sent %d completed %d failed %d busy %d errors %v %v", tot.Sent, tot.Completed, tot.Failed, tot.SessionsBusy, tot.Errors, tot.ErrorExamples)
			}
			if tot.PrefixCacheHitRate <= 0 || tot.CachedTokens <= 0 {
				t.Errorf("prefix cache hit rate %v (%d of %d prompt tokens)", tot.PrefixCacheHitRate, tot.CachedTokens, tot.PromptTokens)
			}
			if len(tot.Servers) != 1 || tot.Servers[addr] != tot.Completed {
				t.Errorf("servers %v, want all %d from %s", tot.Servers, tot.Completed, addr)
			}
			if tot.OutputTokens != 8*tot.Completed || tot.TTFT.Count != tot.Completed || tot.ITL.Count == 0 {
				t.Errorf("output tokens %d, TTFT samples %d, ITL samples %d for %d requests", tot.OutputTokens, tot.TTFT.Count, tot.ITL.Count, tot.Completed)
			}
			if tot.TTFT.P50 <= 0 || tot.TTFT.P50 > tot.E2E.P50 {
				t.Errorf("TTFT p50 %v vs E2E p50 %v", tot.TTFT.P50, tot.E2E.P50)
			}
		})
	}
}
