package metrics

import (
	"math"
	"testing"
	"time"
)

// page is a metrics page's histograms: TTFT (sum, count) and the others.
func page(ttft, queue, prefill, inference, tokens Hist) Values {
	return Values{TTFT: &Histogram{Sum: ttft.Sum, Count: ttft.Count},
		Hists: [NumHists]Hist{HistQueue: queue, HistPrefill: prefill, HistInference: inference, HistPrefillTokens: tokens}}
}

func TestPerfFollowsHistogramDeltas(t *testing.T) {
	t.Parallel()
	// First page: nothing to difference against.
	v0 := page(Hist{10, 100}, Hist{2, 100}, Hist{5, 100}, Hist{50, 100}, Hist{100000, 100})
	p := Perf{}.next(nil, &v0, 0)
	if p.Requests != 0 || p.TTFT != 0 {
		t.Fatalf("first page gave %+v; want nothing known", p)
	}
	// 10 requests finished: TTFT 0.2 s each, queue 0.05, prefill 0.1 for
	// 2,000 computed tokens each, running 1 s.
	v1 := page(Hist{12, 110}, Hist{2.5, 110}, Hist{6, 110}, Hist{60, 110}, Hist{120000, 110})
	p = p.next(&v0, &v1, 0)
	for name, c := range map[string][2]float64{
		"ttft": {p.TTFT, 0.2}, "queue": {p.Queue, 0.05}, "prefill": {p.Prefill, 0.1}, "inference": {p.Inference, 1},
		"tokens": {p.PrefillTokens, 2000}, "per token": {p.PrefillPerToken, 0.1 / 2000}, "requests": {p.Requests, 10},
	} {
		if math.Abs(c[0]-c[1]) > 1e-9*max(1, c[1]) {
			t.Errorf("%s = %g, want %g", name, c[0], c[1])
		}
	}
	// Ten more at TTFT 0.4: the mean moves towards it by 1-exp(-10/64).
	v2 := v1
	v2.TTFT = &Histogram{Sum: 16, Count: 120}
	p = p.next(&v1, &v2, 0)
	want := 0.2 + (1-math.Exp(-10.0/PerfRequests))*0.2
	if math.Abs(p.TTFT-want) > 1e-9 || p.Prefill != 0.1 {
		t.Fatalf("ttft %g prefill %g; want %g and the prefill mean unchanged", p.TTFT, p.Prefill, want)
	}
	// A restart (counts went down) contributes nothing.
	v3 := page(Hist{0.1, 1}, Hist{}, Hist{}, Hist{}, Hist{})
	if q := p.next(&v2, &v3, 0); q.TTFT != p.TTFT || q.Requests != p.Requests {
		t.Fatalf("after a restart %+v, want %+v", q, p)
	}
}

func TestPerfRate(t *testing.T) {
	t.Parallel()
	p := Perf{}
	prev := Values{}
	for i := 1; i <= 200; i++ {
		cur := Values{TTFT: &Histogram{Count: float64(i * 5)}} // 5 per 50 ms
		p = p.next(&prev, &cur, 50*time.Millisecond)
		prev = cur
	}
	if math.Abs(p.Rate-100) > 1 {
		t.Fatalf("rate %g, want 100/s", p.Rate)
	}
}
