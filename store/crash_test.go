package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/switchyard/switchyard/internal/testutil"
)

const crashChildEnv = "SWITCHYARD_STORE_CRASH_CHILD"

// TestCrashChild is the child half of TestSIGKILLLosesNothingFlushed: it
// writes to the store as fast as it can and reports on stdout what is
// durable, until the parent kills it.
func TestCrashChild(t *testing.T) {
	path := os.Getenv(crashChildEnv)
	if path == "" {
		t.Skip("only runs as the child of TestSIGKILLLosesNothingFlushed")
	}
	s, err := Open(path, Options{FlushInterval: 2 * time.Millisecond, Logger: testOpts().Logger})
	if err != nil {
		fmt.Printf("open-error %v\n", err)
		os.Exit(3)
	}
	snap, err := s.Load()
	if err != nil {
		fmt.Printf("load-error %v\n", err)
		os.Exit(3)
	}
	fmt.Printf("start %d\n", snap.StateVersion)
	ctx := context.Background()
	for i := snap.StateVersion + 1; i < snap.StateVersion+1_000_000; i++ {
		s.SaveState(makeState(5, 20, i))
		s.SaveMetrics(map[EndpointKey]Metrics{{Pool: "pool-00", Address: "10.0.0.0:8000"}: {Waiting: int(i)}})
		if err := s.SavePrefix("pool-00", "10.0.0.0:8000", []byte(strconv.FormatUint(i, 10))); err != nil {
			fmt.Printf("prefix-error %v\n", err)
			os.Exit(3)
		}
		s.SaveConsulIndex("service:vllm", i)
		if i%4 == 0 {
			if err := s.Flush(ctx); err != nil {
				fmt.Printf("flush-error %v\n", err)
				os.Exit(3)
			}
			fmt.Printf("flushed %d\n", i)
		}
	}
}

// crashReport is what a killed child said was durable.
type crashReport struct {
	maxFlushed uint64
	flushes    int
}

func parseCrashOutput(t *testing.T, out string) crashReport {
	t.Helper()
	var r crashReport
	lines := strings.Split(out, "\n")
	lines = lines[:len(lines)-1] // the last line may be cut off by the kill
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if strings.HasSuffix(f[0], "-error") {
			t.Fatalf("child failed: %s", l)
		}
		if len(f) != 2 {
			continue
		}
		n, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			continue
		}
		if f[0] == "flushed" {
			r.maxFlushed = max(r.maxFlushed, n)
			r.flushes++
		}
	}
	return r
}

func TestSIGKILLLosesNothingFlushed(t *testing.T) {
	if testing.Short() {
		t.Skip("re-executes the test binary")
	}
	path := filepath.Join(t.TempDir(), "state.db")
	t.Setenv(crashChildEnv, path)
	for round := range 3 {
		child := testutil.StartNoCleanup(t, "store-crash-child", os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
		// Kill it mid-stream once it has flushed a few batches.
		testutil.Eventually(t, 30*time.Second, "child flushes", func() error {
			if child.Exited() {
				return fmt.Errorf("child exited early:\n%s", child.Output())
			}
			if n := strings.Count(child.Output(), "\nflushed "); n < 10+round*5 {
				return fmt.Errorf("%d flushes so far", n)
			}
			return nil
		})
		child.Kill()
		rep := parseCrashOutput(t, child.Output())
		if rep.flushes == 0 {
			t.Fatalf("round %d: child reported nothing durable:\n%s", round, child.Output())
		}

		checkIntegrity(t, path)
		s, err := Open(path, testOpts())
		if err != nil {
			t.Fatalf("round %d: reopen after SIGKILL: %v", round, err)
		}
		if s.Recovery() != nil {
			t.Fatalf("round %d: store moved aside after SIGKILL: %v", round, s.Recovery().Reason)
		}
		snap := loadT(t, s)
		if snap.StateVersion < rep.maxFlushed {
			t.Errorf("round %d: state version %d, but the child flushed %d", round, snap.StateVersion, rep.maxFlushed)
		}
		st := snap.State()
		if st == nil || len(st.Pools) != 5 || st.Version != snap.StateVersion {
			t.Errorf("round %d: state after crash is damaged: %+v", round, st)
		}
		if idx := snap.ConsulIndexes["service:vllm"]; idx < rep.maxFlushed {
			t.Errorf("round %d: consul index %d < flushed %d", round, idx, rep.maxFlushed)
		}
		if got := string(snap.Prefix[EndpointKey{"pool-00", "10.0.0.0:8000"}]); got == "" {
			t.Errorf("round %d: prefix blob lost", round)
		}
		closeT(t, s)
		t.Logf("round %d: child flushed %d batches, state %d (flushed %d)", round, rep.flushes, snap.StateVersion, rep.maxFlushed)
	}
}

// checkIntegrity runs bbolt's own consistency check over the file.
func checkIntegrity(t *testing.T, path string) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("bbolt open after SIGKILL: %v", err)
	}
	defer db.Close()
	err = db.View(func(tx *bolt.Tx) error {
		for err := range tx.Check() {
			t.Errorf("bbolt check: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
