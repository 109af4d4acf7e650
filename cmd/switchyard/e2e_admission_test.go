package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker"
)

// admissionView is the admission part of /api/status.
type admissionView struct {
	Pools []struct {
		Name      string `json:"name"`
		Admission *struct {
			Queued  int `json:"queued"`
			Waiting []struct {
				Priority int `json:"priority"`
				Requests int `json:"requests"`
			} `json:"waiting"`
			Dispatched uint64            `json:"dispatched"`
			Rejected   map[string]uint64 `json:"rejected"`
		} `json:"admission"`
	} `json:"pools"`
}

// TestE2EAdmission runs the admission queue through serve and a real
// Envoy, on one simulator that runs one sequence at a time: once its
// batch is full, the picker holds new requests (queue_threshold 1: send
// only where a request starts at once). A high-priority one (the
// operator's priority header) goes first when the slot frees, though it
// came last; one that waits out the TTL gets Envoy's 429 with
// retry-after and x-switchyard-admission; the status page and /metrics
// show it all.
func TestE2EAdmission(t *testing.T) {
	t.Parallel()
	s := startSim(t, simOptions{timeScale: 1, extra: []string{"-max-num-seqs", "1"}})
	cfg := fmt.Sprintf(`pool "p" {
  endpoints = [%q]
  scheduling {
    queue_threshold = 1
    scrape_interval = "20ms"
  }
  admission {
    ttl             = "3s"
    priority_header = "x-priority"
    priority_max    = 1
  }
}
model "m-a" {
  pool = "p"
}
`, s.Addr)
	f := newFleet(t, cfg, fleetOptions{})
	view := func() admissionView {
		t.Helper()
		var v admissionView
		b, err := httpGetString("http://" + f.admin + "/api/status")
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(b), &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	queue := func() (queued int, bands []int, dispatched uint64, rejected map[string]uint64) {
		for _, p := range view().Pools {
			if p.Name == "p" && p.Admission != nil {
				for _, w := range p.Admission.Waiting {
					bands = append(bands, w.Priority)
				}
				return p.Admission.Queued, bands, p.Admission.Dispatched, p.Admission.Rejected
			}
		}
		t.Fatal("pool p has no admission queue in /api/status")
		return
	}

	// Two long requests: one runs, one waits in the engine.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	long := func(c context.Context, headers map[string]string) *http.Response {
		req, _ := http.NewRequestWithContext(c, "POST", "http://"+f.listen+"/v1/completions",
			strings.NewReader(`{"model":"m-a","prompt":"hold","max_tokens":4000,"stream":true}`))
		for k, v := range headers {
			req.Header.Set(k, v)
		}
		resp, err := f.client.Do(req)
		if err != nil {
			if c.Err() == nil {
				t.Error(err)
			}
			return nil
		}
		return resp
	}
	// Two long requests: one runs, one waits in the engine (the picker
	// does not know the batch size yet), and the scrape that sees it
	// waiting teaches the picker the batch: 1.
	busy, stopBusy := context.WithCancel(ctx)
	r1 := long(busy, nil)
	go func() { _ = long(busy, nil) }()
	testutil.Eventually(t, 10*time.Second, "pool saturated", func() error {
		b, err := httpGetString("http://" + f.admin + "/api/status")
		if err != nil || !strings.Contains(b, `"saturated": true`) {
			return fmt.Errorf("not saturated yet (%v)", err)
		}
		return nil
	})

	type answer struct {
		resp *infResp
		err  error
	}
	low := make(chan answer, 1)
	go func() {
		r, err := f.send(infReq{model: "m-a", prompt: "low", maxTokens: 1})
		low <- answer{r, err}
	}()
	testutil.Eventually(t, 10*time.Second, "low queued", func() error {
		if q, _, _, _ := queue(); q != 1 {
			return fmt.Errorf("%d queued", q)
		}
		return nil
	})
	// A long high-priority request, queued behind the low one.
	high := make(chan *http.Response, 1)
	go func() { high <- long(ctx, map[string]string{"x-priority": "7"}) }() // clamped to 1
	testutil.Eventually(t, 10*time.Second, "high queued", func() error {
		if q, bands, _, _ := queue(); q != 2 || fmt.Sprint(bands) != "[1 0]" {
			return fmt.Errorf("%d queued, bands %v", q, bands)
		}
		return nil
	})

	stopBusy() // both long requests end: the slot frees
	if r1 != nil {
		r1.Body.Close()
	}
	testutil.Eventually(t, 10*time.Second, "high dispatched first", func() error {
		q, bands, d, _ := queue()
		if q != 1 || d != 1 || fmt.Sprint(bands) != "[0]" {
			return fmt.Errorf("%d queued (bands %v), %d dispatched", q, bands, d)
		}
		return nil
	})
	if h := <-high; h == nil || h.StatusCode != 200 {
		t.Fatalf("high-priority request: %+v", h)
	} else {
		defer h.Body.Close()
	}
	// The high one holds the slot: the low one waits out its TTL.
	a := <-low
	if a.err != nil {
		t.Fatalf("low: %v", a.err)
	}
	if a.resp.status != 429 || a.resp.header.Get(picker.HeaderAdmission) != "ttl" || a.resp.header.Get("retry-after") == "" ||
		!strings.Contains(string(a.resp.body), `"code":429`) {
		t.Fatalf("low: %d %s=%q retry-after=%q %s", a.resp.status, picker.HeaderAdmission,
			a.resp.header.Get(picker.HeaderAdmission), a.resp.header.Get("retry-after"), a.resp.body)
	}
	if _, _, _, rej := queue(); rej["ttl"] != 1 {
		t.Errorf("rejected %v, want ttl: 1", rej)
	}
	fams := scrapeMetrics(t, f.admin)
	for _, m := range []struct {
		name   string
		labels map[string]string
	}{
		{"inference_extension_flow_control_request_queue_duration_seconds", map[string]string{"inference_pool": "p", "priority": "0", "outcome": "rejected_ttl"}},
		{"inference_extension_flow_control_request_queue_duration_seconds", map[string]string{"inference_pool": "p", "priority": "1", "outcome": "dispatched"}},
		{"switchyard_admission_dispatched_total", map[string]string{"pool": "p"}},
		{"switchyard_admission_rejected_total", map[string]string{"pool": "p", "reason": "ttl"}},
	} {
		if v, ok := metricValue(fams, m.name, m.labels); !ok || v != 1 {
			t.Errorf("%s%v = %v (present %v), want 1", m.name, m.labels, v, ok)
		}
	}
	if _, ok := metricValue(fams, "inference_extension_flow_control_pool_saturation", map[string]string{"inference_pool": "p"}); !ok {
		t.Error("no inference_extension_flow_control_pool_saturation series for p")
	}
	cancel()
}
