package store

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

var hour0 = time.Date(2026, 11, 26, 10, 0, 0, 0, time.UTC)

func TestUsageBucketsAndQuery(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "s.db")
	s := openT(t, path, testOpts())
	add := func(at time.Time, tenant, model string, prompt int64) {
		t.Helper()
		if err := s.AddUsage(at, tenant, model, UsageCounts{Requests: 1, PromptTokens: prompt, CompletionTokens: 2}); err != nil {
			t.Fatal(err)
		}
	}
	add(hour0.Add(5*time.Minute), "a", "m", 10)
	add(hour0.Add(59*time.Minute), "a", "m", 20)
	add(hour0.Add(61*time.Minute), "a", "m", 40)
	add(hour0.Add(3*time.Minute), "b", "", 1)
	add(hour0.Add(-time.Minute), "a", "m", 1000)

	check := func(when string) {
		t.Helper()
		rows, err := s.Usage(hour0.Add(30*time.Minute), hour0.Add(2*time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		want := []UsageRow{
			{UsageKey{hour0, "a", "m"}, UsageCounts{Requests: 2, PromptTokens: 30, CompletionTokens: 4}},
			{UsageKey{hour0, "b", ""}, UsageCounts{Requests: 1, PromptTokens: 1, CompletionTokens: 2}},
			{UsageKey{hour0.Add(time.Hour), "a", "m"}, UsageCounts{Requests: 1, PromptTokens: 40, CompletionTokens: 2}},
		}
		if fmt.Sprint(rows) != fmt.Sprint(want) {
			t.Fatalf("%s: rows\n%v\nwant\n%v", when, rows, want)
		}
	}
	check("pending")
	flushT(t, s)
	check("committed")
	add(hour0.Add(10*time.Minute), "a", "m", 100) // committed and pending together
	rows, _ := s.Usage(hour0, hour0.Add(time.Hour))
	if rows[0].PromptTokens != 130 || rows[0].Requests != 3 {
		t.Fatalf("committed + pending: %v", rows[0])
	}
	closeT(t, s)
	s = openT(t, path, testOpts())
	rows, _ = s.Usage(hour0.Add(-time.Hour), hour0.Add(3*time.Hour))
	var total int64
	for _, r := range rows {
		total += r.PromptTokens
	}
	if len(rows) != 4 || total != 1171 {
		t.Fatalf("after reopen: %v", rows)
	}
}

const usageChildEnv = "SWITCHYARD_STORE_USAGE_CHILD"

// TestUsageCrashChild is the child half of TestUsageSurvivesSIGKILL: it
// adds usage as fast as it can and reports each record once AddUsage has
// returned, until killed. Commits run every 500 ms, so a kill finds
// records both committed and only journaled.
func TestUsageCrashChild(t *testing.T) {
	path := os.Getenv(usageChildEnv)
	if path == "" {
		t.Skip("only runs as the child of TestUsageSurvivesSIGKILL")
	}
	o := testOpts()
	o.FlushInterval = 500 * time.Millisecond
	s, err := Open(path, o)
	if err != nil {
		fmt.Printf("open-error %v\n", err)
		os.Exit(3)
	}
	for i := 1; ; i++ {
		if err := s.AddUsage(hour0, "t", "m", UsageCounts{Requests: 1, PromptTokens: int64(i)}); err != nil {
			fmt.Printf("add-error %v\n", err)
			os.Exit(3)
		}
		fmt.Printf("added %d\n", i)
	}
}

// TestUsageSurvivesSIGKILL: every usage record AddUsage accepted before a
// SIGKILL is there after a restart, exactly once, through several
// commit/journal rotations and kills.
func TestUsageSurvivesSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("re-executes the test binary")
	}
	path := filepath.Join(t.TempDir(), "state.db")
	t.Setenv(usageChildEnv, path)
	var wantReq, wantPrompt int64
	for round := range 3 {
		child := testutil.StartNoCleanup(t, "usage-crash-child", os.Args[0], "-test.run=^TestUsageCrashChild$", "-test.count=1")
		testutil.Eventually(t, 30*time.Second, "child adds usage through commits", func() error {
			if child.Exited() {
				return fmt.Errorf("child exited early:\n%s", child.Output())
			}
			if n := strings.Count(child.Output(), "\nadded "); n < 20000 {
				return fmt.Errorf("%d records so far", n)
			}
			return nil
		})
		time.Sleep(time.Duration(round) * 300 * time.Millisecond) // kill at different points of the flush cycle
		child.Kill()
		// Records the child reported: AddUsage had returned for them. The
		// one after the last complete line may have been added too.
		lines := strings.Split(child.Output(), "\n")
		var last int64
		for _, l := range lines[:len(lines)-1] {
			if n, ok := strings.CutPrefix(l, "added "); ok {
				last, _ = strconv.ParseInt(n, 10, 64)
			}
			if strings.Contains(l, "-error") {
				t.Fatalf("child: %s", l)
			}
		}
		s := openT(t, path, testOpts())
		rows, err := s.Usage(hour0, hour0.Add(time.Hour))
		if err != nil || len(rows) != 1 {
			t.Fatalf("round %d: usage %v, %v", round, rows, err)
		}
		got := rows[0]
		// The child adds 1..n: n requests, n(n+1)/2 prompt tokens.
		n := got.Requests - wantReq
		if n < last || n > last+1 {
			t.Fatalf("round %d: %d requests recovered, the child reported %d accepted", round, n, last)
		}
		if got.PromptTokens-wantPrompt != n*(n+1)/2 {
			t.Fatalf("round %d: prompt tokens %d, want %d: a record was lost or counted twice", round, got.PromptTokens-wantPrompt, n*(n+1)/2)
		}
		wantReq, wantPrompt = got.Requests, got.PromptTokens
		closeT(t, s)
		t.Logf("round %d: %d records, all recovered", round, n)
	}
}

// BenchmarkAddUsage is the cost a tenant request pays to make its usage
// survive a SIGKILL: one journal line written (no fsync).
func BenchmarkAddUsage(b *testing.B) {
	s := openT(b, filepath.Join(b.TempDir(), "s.db"), Options{FlushInterval: 200 * time.Millisecond, Logger: testOpts().Logger})
	c := UsageCounts{Requests: 1, PromptTokens: 812, CachedTokens: 512, CompletionTokens: 128}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := s.AddUsage(hour0, "team-a", "meta-llama/Llama-3.1-8B-Instruct", c); err != nil {
				b.Fatal(err)
			}
		}
	})
}
