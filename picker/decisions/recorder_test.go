package decisions

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

func rec(model, pool, picked string, status int) *Record {
	return &Record{Time: time.Now(), Model: model, Target: model, Pool: pool, Picked: picked, Status: status}
}

// The ring keeps the newest Size records; queries filter and answer
// newest first.
func TestRingAndFilters(t *testing.T) {
	r := New(Options{Size: 4})
	r.Add(rec("a", "p1", "e1", 200))
	r.Add(rec("b", "p1", "e2", 429))
	r.Add(rec("a", "p2", "e3", 503))
	r.Add(rec("c", "p2", "e1", 200))
	r.Add(rec("a", "p1", "e2", 200)) // evicts the first
	seqs := func(rs []*Record) string {
		var b strings.Builder
		for _, x := range rs {
			fmt.Fprintf(&b, "%d ", x.Seq)
		}
		return strings.TrimSpace(b.String())
	}
	for _, c := range []struct {
		desc string
		f    Filter
		want string
	}{
		{"everything kept, newest first", Filter{}, "5 4 3 2"},
		{"model", Filter{Model: "a"}, "5 3"},
		{"pool", Filter{Pool: "p2"}, "4 3"},
		{"endpoint", Filter{Endpoint: "e1"}, "4"},
		{"status", Filter{Status: "200"}, "5 4"},
		{"status class", Filter{Status: "5xx"}, "3"},
		{"4xx", Filter{Status: "4XX"}, "2"},
		{"limit", Filter{Limit: 1}, "5"},
		{"no match", Filter{Model: "zzz"}, ""},
	} {
		if got := seqs(r.Query(c.f)); got != c.want {
			t.Errorf("%s: got %q, want %q", c.desc, got, c.want)
		}
	}
	if s := r.Stats(); s.Recorded != 5 || s.Kept != 4 || s.Size != 4 {
		t.Errorf("stats %+v", s)
	}
}

// Kept counts the records the ring holds: what was added until the ring
// is full, then its size.
func TestStatsKept(t *testing.T) {
	r := New(Options{Size: 4})
	for i, want := range []int{0, 1, 2, 3, 4, 4, 4} {
		if i > 0 {
			r.Add(&Record{Model: "m"})
		}
		s := r.Stats()
		if s.Kept != want || s.Size != 4 || s.Recorded != uint64(i) {
			t.Errorf("after %d records: kept %d of size %d, recorded %d; want kept %d", i, s.Kept, s.Size, s.Recorded, want)
		}
		if n := len(r.Query(Filter{Limit: 100})); n != s.Kept {
			t.Errorf("after %d records: %d records answer a query, Stats says %d kept", i, n, s.Kept)
		}
	}
}

func TestParseFilter(t *testing.T) {
	f, err := ParseFilter(url.Values{"model": {"m"}, "status": {"5xx"}, "limit": {"7"}})
	if err != nil || f.Model != "m" || f.Status != "5xx" || f.Limit != 7 {
		t.Fatalf("%+v %v", f, err)
	}
	for _, q := range []url.Values{{"status": {"abc"}}, {"limit": {"-1"}}, {"status": {"9xx"}}} {
		if _, err := ParseFilter(q); err == nil {
			t.Errorf("%v accepted", q)
		}
	}
}

// Readers racing writers see only whole records, each once, in order.
func TestConcurrentAddQuery(t *testing.T) {
	r := New(Options{Size: 64})
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				r.Add(rec("m", "p", "e", 200))
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for {
		got := r.Query(Filter{Limit: 1000})
		for i := 1; i < len(got); i++ {
			if got[i].Seq >= got[i-1].Seq {
				t.Fatalf("out of order: %d after %d", got[i].Seq, got[i-1].Seq)
			}
		}
		select {
		case <-done:
			if got := r.Query(Filter{Limit: 1000}); len(got) != 64 || got[0].Seq != 8000 {
				t.Fatalf("after writers: %d records, newest %d", len(got), got[0].Seq)
			}
			return
		default:
		}
	}
}

// Sampling records about the configured share; Disabled none.
func TestSample(t *testing.T) {
	half := New(Options{Sample: 0.5})
	n := 0
	for i := 0; i < 10000; i++ {
		if half.Sample() {
			n++
		}
	}
	if n < 4500 || n > 5500 {
		t.Errorf("sample 0.5 recorded %d of 10000", n)
	}
	if New(Options{}).Sample() != true {
		t.Error("default does not record")
	}
	if New(Options{Disabled: true}).Sample() {
		t.Error("disabled records")
	}
	var nilRec *Recorder
	if nilRec.Sample() {
		t.Error("nil recorder records")
	}
}

// The JSON shape: candidates best first, scores keyed by scorer.
func TestRecordJSON(t *testing.T) {
	r := &Record{Seq: 3, Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Model: "chat", Target: "llama", Pool: "p",
		PoolSize: 3, Filters: []FilterStep{{Name: "not-draining", Left: 2}},
		Scorers:   []Scorer{{Name: "queue", Weight: 2}, {Name: "prefix", Weight: 3}},
		Endpoints: []string{"a", "b"}, Candidates: []int32{1, 0}, Totals: []float32{1, 5}, Scores: []uint16{QuantizeScore(0.5), ScoreUnit, 0, ScoreUnit},
		Picked: "a", Fallbacks: []string{"b"}, Queued: true, QueueWait: 12500 * time.Microsecond, QueueOutcome: "dispatched",
		Status: 200, Served: "a", TTFT: 30 * time.Millisecond, Duration: time.Second, OutputTokens: 64, DecisionTime: 35 * time.Microsecond,
		PD: &PD{Decision: "split", Prefill: "c", UncachedTokens: 4000, Result: "fallback"}}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"seq":3,"time":"2026-01-02T03:04:05Z","model":"chat","target":"llama","pool":"p","tenant":"","priority":0,"prompt_tokens":0,` +
		`"pool_size":3,"filters":[{"name":"not-draining","left":2}],"scorers":[{"name":"queue","weight":2},{"name":"prefix","weight":3}],` +
		`"candidates":[{"endpoint":"a","total":5,"scores":{"prefix":1,"queue":1}},{"endpoint":"b","total":1,"scores":{"prefix":0,"queue":0.5}}],` +
		`"picked":"a","fallbacks":["b"],"decision_us":35,"pd":{"decision":"split","prefill":"c","uncached_tokens":4000,"result":"fallback"},` +
		`"queue":{"waited_ms":12.5,"outcome":"dispatched"},` +
		`"outcome":{"status":200,"served":"a","ttft_ms":30,"duration_ms":1000,"output_tokens":64}}`
	if string(b) != want {
		t.Fatalf("got\n%s\nwant\n%s", b, want)
	}
}

// RunFile appends one JSON object per record, and what is queued at
// shutdown is written.
func TestRunFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "decisions.jsonl")
	r := New(Options{})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- r.RunFile(ctx, path, slog.New(slog.DiscardHandler)) }()
	testutil.Eventually(t, 5*time.Second, "file writer running", func() error {
		if r.file.Load() == nil {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	for i := 0; i < 10; i++ {
		r.Add(rec(fmt.Sprintf("m%d", i), "p", "e", 200))
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		var got struct {
			Seq   uint64 `json:"seq"`
			Model string `json:"model"`
		}
		if err := json.Unmarshal(sc.Bytes(), &got); err != nil {
			t.Fatalf("line %d: %v", n+1, err)
		}
		if got.Seq != uint64(n+1) || got.Model != fmt.Sprintf("m%d", n) {
			t.Fatalf("line %d: %+v", n+1, got)
		}
		n++
	}
	if n != 10 {
		t.Fatalf("%d lines, want 10", n)
	}
	if _, err := io.ReadAll(f); err != nil {
		t.Fatal(err)
	}
	// A file that cannot be opened is an error naming it.
	if err := New(Options{}).RunFile(context.Background(), filepath.Join(t.TempDir(), "no", "such", "dir", "x"), slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "decision records file") {
		t.Fatalf("bad path: %v", err)
	}
}
