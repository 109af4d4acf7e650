package status

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/metrics"
)

// Quantiles interpolate within buckets of the interval's observations.
func TestQuantile(t *testing.T) {
	bounds := []float64{0.01, 0.02, 0.05}
	// 10 observations: 4 <= 10 ms, 8 <= 20 ms, 10 <= 50 ms.
	p50 := quantile(bounds, []float64{4, 8, 10}, 10, 0.5)
	if p50 == nil || *p50 < 12.4 || *p50 > 12.6 { // 10 + 10 * (5-4)/(8-4)
		t.Errorf("p50 %v, want 12.5 ms", p50)
	}
	p90 := quantile(bounds, []float64{4, 8, 10}, 10, 0.9)
	if p90 == nil || *p90 < 34.9 || *p90 > 35.1 { // 20 + 30 * (9-8)/2
		t.Errorf("p90 %v, want 35 ms", p90)
	}
	if quantile(bounds, []float64{0, 0, 0}, 0, 0.5) != nil {
		t.Error("a quantile of nothing")
	}
	// The router's histograms are deltas between samples.
	prev := picker.Histogram{Bounds: bounds, Cumulative: []uint64{100, 100, 100}, Count: 100}
	cur := picker.Histogram{Bounds: bounds, Cumulative: []uint64{100, 100, 110}, Count: 110}
	if p, _ := routerQuantiles(cur, prev); p == nil || *p < 20 || *p > 50 {
		t.Errorf("interval p50 %v, want in the 20-50 ms bucket", p)
	}
	// An engine whose count went down restarted: its histogram is new.
	eprev := &metrics.Histogram{Bounds: bounds, Cumulative: []float64{50, 50, 50}, Count: 50}
	ecur := &metrics.Histogram{Bounds: bounds, Cumulative: []float64{2, 2, 2}, Count: 2}
	if p, _ := engineQuantiles(ecur, eprev); p == nil || *p > 10 {
		t.Errorf("after a restart p50 %v, want within 10 ms", p)
	}
}

// History keeps a bounded window of samples and serves them as series.
func TestHistoryWindowAndJSON(t *testing.T) {
	src, pub, _ := liveSources(t)
	pub.Publish(state(1))
	src.Picker = picker.New(pub, picker.Options{DisableMetrics: true}, nil)
	h := NewHistory(src.Picker, time.Second, 3*time.Second)
	t0 := time.Unix(1000, 0)
	for i := 0; i < 5; i++ {
		h.Sample(t0.Add(time.Duration(i) * time.Second))
	}
	src.History = h
	mux := http.NewServeMux()
	src.Register(mux)
	code, body := get(t, mux, "/api/history")
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, body)
	}
	var got historyJSON
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatal(err)
	}
	if got.IntervalS != 1 || got.WindowS != 3 || len(got.Times) != 3 || got.Times[0] != 1002000 || got.Times[2] != 1004000 {
		t.Fatalf("interval %v window %v times %v: want the 3 newest, oldest first", got.IntervalS, got.WindowS, got.Times)
	}
	if len(got.Endpoints) != 2 || got.Endpoints[0].Address != "127.0.0.1:18001" || len(got.Endpoints[0].InFlight) != 3 || *got.Endpoints[0].InFlight[2] != 0 {
		t.Fatalf("endpoints %+v", got.Endpoints)
	}
	if got.Endpoints[0].Waiting[0] != nil || got.Endpoints[0].TTFTP50[0] != nil {
		t.Errorf("values without scrapes or requests: waiting %v ttft %v, want null", got.Endpoints[0].Waiting[0], got.Endpoints[0].TTFTP50[0])
	}
}

// /api/decisions filters and reports bad filters.
func TestDecisionsAPI(t *testing.T) {
	src, _, _ := liveSources(t)
	mux := http.NewServeMux()
	src.Register(mux)
	if code, _ := get(t, mux, "/api/decisions"); code != http.StatusNotFound {
		t.Errorf("without a recorder: %d", code)
	}
	rec := decisions.New(decisions.Options{})
	rec.Add(&decisions.Record{Model: "m", Target: "m", Pool: "p", Picked: "127.0.0.1:18001", Status: 200})
	rec.Add(&decisions.Record{Model: "x", Target: "x", Status: 404, Error: `model "x" does not exist`})
	src.Decisions = rec
	mux = http.NewServeMux()
	src.Register(mux)
	code, body := get(t, mux, "/api/decisions?status=4xx")
	if code != http.StatusOK || !strings.Contains(body, `"model":"x"`) || strings.Contains(body, `"model":"m"`) || !strings.Contains(body, `"recorded":2`) {
		t.Errorf("filtered: %d %s", code, body)
	}
	// stats.kept is the records held (2), not the ring's size (1000).
	var doc struct {
		Stats struct {
			Kept, Size int
		} `json:"stats"`
	}
	if err := json.Unmarshal([]byte(body), &doc); err != nil || doc.Stats.Kept != 2 || doc.Stats.Size != decisions.DefaultSize {
		t.Errorf("stats kept %d size %d (%v), want 2 of %d: %s", doc.Stats.Kept, doc.Stats.Size, err, decisions.DefaultSize, body)
	}
	if _, body := get(t, mux, "/api/status"); !strings.Contains(body, `"kept": 2,`) {
		t.Errorf("/api/status decision_records: %s", body)
	}
	if code, body := get(t, mux, "/api/decisions?status=abc"); code != http.StatusBadRequest || !strings.Contains(body, "status") {
		t.Errorf("bad filter: %d %s", code, body)
	}
}
