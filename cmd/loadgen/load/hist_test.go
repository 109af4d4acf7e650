package load

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestHistogramQuantilesWithinOnePercent(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h histogram
	var exact []time.Duration
	for range 50000 {
		// Log-uniform from 1µs to 10s covers every bucket range we use.
		d := time.Duration(math.Exp(rng.Float64()*math.Log(1e7)) * 1e3)
		h.record(d)
		exact = append(exact, d)
	}
	slices.Sort(exact)
	for _, q := range []float64{0.01, 0.5, 0.9, 0.99, 0.999, 1} {
		want := exact[int(math.Ceil(q*float64(len(exact))))-1]
		got := h.quantile(q)
		if rel := math.Abs(float64(got-want)) / float64(want); rel > 0.01 {
			t.Errorf("q%.3f: got %v, want %v (%.2f%% off)", q, got, want, 100*rel)
		}
	}
	s := h.summary()
	if s.Count != 50000 || s.Min != exact[0] || s.Max != exact[len(exact)-1] || s.P999 != h.quantile(0.999) || s.P999Ms != math.Round(float64(s.P999)/1e3)/1e3 {
		t.Errorf("summary %+v", s)
	}
}

func TestHistogramSmallValuesExactAndMerge(t *testing.T) {
	var a, b histogram
	for i := 1; i <= 100; i++ {
		a.record(time.Duration(i))
		b.record(time.Duration(100 + i))
	}
	if a.quantile(0.5) != 50 || a.quantile(0.99) != 99 {
		t.Errorf("p50 %v p99 %v, want 50ns and 99ns", a.quantile(0.5), a.quantile(0.99))
	}
	a.merge(&b)
	s := a.summary()
	if s.Count != 200 || s.Min != 1 || s.Max != 200 || s.P50 != 100 || s.Mean != 100 {
		t.Errorf("merged %+v", s)
	}
	var empty histogram
	if (empty.summary() != Summary{}) {
		t.Error("empty histogram has a non-zero summary")
	}
}

func TestHistogramIndexRoundTrip(t *testing.T) {
	for _, v := range []int64{0, 255, 256, 257, 511, 512, 1 << 20, 1<<40 + 12345, math.MaxInt64} {
		idx := histIndex(v)
		if idx < 0 || idx >= histBuckets {
			t.Fatalf("value %d: index %d out of range", v, idx)
		}
		mid := histValue(idx)
		if rel := math.Abs(float64(mid-v)) / math.Max(1, float64(v)); rel > 0.008 {
			t.Errorf("value %d: bucket midpoint %d is %.3f%% off", v, mid, 100*rel)
		}
	}
}

func TestParsers(t *testing.T) {
	st, err := ParseStages("10:30s, 50.5:1m", ArrivalPoisson)
	if err != nil || len(st) != 2 || st[0] != (Stage{Rate: 10, Duration: 30 * time.Second}) || st[1] != (Stage{Rate: 50.5, Duration: time.Minute}) {
		t.Errorf("rate stages %+v %v", st, err)
	}
	st, err = ParseStages("4:1s,16:2s", ArrivalConcurrency)
	if err != nil || st[0].Concurrency != 4 || st[1].Concurrency != 16 || st[1].Duration != 2*time.Second {
		t.Errorf("concurrency stages %+v %v", st, err)
	}
	for _, bad := range []string{"10", "x:1s", "10:forever", "2.5:1s"} {
		if _, err := ParseStages(bad, ArrivalConcurrency); err == nil {
			t.Errorf("ParseStages(%q) accepted", bad)
		}
	}
	l, err := ParseLoRA("sql-lora:0.2,other:0.1")
	if err != nil || len(l) != 2 || l[0] != (LoRASplit{"sql-lora", 0.2}) || l[1] != (LoRASplit{"other", 0.1}) {
		t.Errorf("lora %+v %v", l, err)
	}
	if l, err := ParseLoRA(""); err != nil || l != nil {
		t.Errorf("empty lora %+v %v", l, err)
	}
	if _, err := ParseLoRA("x"); err == nil {
		t.Error("lora without fraction accepted")
	}
	if r, err := ParseRange("64-256"); err != nil || r != (Range{64, 256}) {
		t.Errorf("range %v %v", r, err)
	}
	if r, err := ParseRange("128"); err != nil || r != Fixed(128) {
		t.Errorf("fixed %v %v", r, err)
	}
	for _, bad := range []string{"", "a", "9-3", "1-b"} {
		if _, err := ParseRange(bad); err == nil {
			t.Errorf("ParseRange(%q) accepted", bad)
		}
	}
	if n, v, err := ParseHeader("x-session-id:  abc "); err != nil || n != "x-session-id" || v != "abc" {
		t.Errorf("header %q %q %v", n, v, err)
	}
	if _, _, err := ParseHeader("no colon"); err == nil {
		t.Error("header without colon accepted")
	}
}

func TestValidateNamesEveryProblem(t *testing.T) {
	cfg := Config{
		URL: "127.0.0.1:8080", API: "grpc", Workload: Workload{Kind: WorkloadSharedPrefix},
		Arrival: "burst", Stages: []Stage{{Rate: -1}},
		LoRA: []LoRASplit{{"a", 0.7}, {"b", 0.6}},
	}
	err := cfg.Validate()
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"url", "api", "model", "output length", "groups", "system prompt", "arrival", "stage 0: duration", "sum to 1.300"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	good := Config{URL: "http://127.0.0.1:8080/v1", Model: "m", Workload: Workload{Kind: WorkloadRandom, Input: Fixed(1), Output: Fixed(1)},
		Stages: []Stage{{Rate: 1, Duration: time.Second}}}
	if err := good.Validate(); err != nil {
		t.Errorf("valid config rejected: %v", err)
	}
	if e := good.withDefaults(); !slices.Equal(e.endpoints(), []string{"http://127.0.0.1:8080/v1/completions"}) {
		t.Errorf("endpoints %q", e.endpoints())
	}
	good.URL, good.API = "http://h:1/, http://h:2/v1", APIChat
	if got := good.endpoints(); !slices.Equal(got, []string{"http://h:1/v1/chat/completions", "http://h:2/v1/chat/completions"}) {
		t.Errorf("endpoints %q", got)
	}
	if err := good.Validate(); err != nil {
		t.Errorf("two URLs rejected: %v", err)
	}
	good.URL = "http://h:1,ftp://h:2"
	if err := good.Validate(); err == nil || !strings.Contains(err.Error(), "ftp://h:2") {
		t.Errorf("bad second URL: %v", err)
	}
}
