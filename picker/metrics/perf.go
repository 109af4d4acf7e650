package metrics

import (
	"math"
	"time"
)

// Perf is what successive scrapes of one endpoint say about its speed:
// the mean of each latency histogram over its recent requests. It is derived from the difference between
// a page's cumulative histogram sums and counts and the previous page's,
// so it describes the requests that finished between scrapes, weighted
// towards the latest PerfRequests or so. Zero fields are unknown.
type Perf struct {
	// Mean seconds per request: TTFT as the server measures it (from
	// arrival), waiting for admission, from admission to the first token,
	// and running (prefill and decode: how long a request holds a slot).
	TTFT, Queue, Prefill, Inference float64
	// PrefillTokens is the mean prompt tokens a request computed (cached
	// tokens excluded); PrefillPerToken the seconds of prefill time per
	// computed token (total prefill time over total computed tokens).
	PrefillTokens, PrefillPerToken float64
	// Requests counts the requests behind the means (0: nothing known).
	Requests float64
	// Rate is the requests per second that got their first token lately
	// (the TTFT histogram's count over time, fading over PerfRateWindow).
	Rate float64
	// prefillSecs and prefillToks are decayed sums of prefill time and
	// computed tokens, whose ratio is PrefillPerToken.
	prefillSecs, prefillToks float64
}

// PerfRequests is how many recent requests the Perf means mostly
// reflect: a scrape interval in which n requests finished moves each mean
// a fraction 1-exp(-n/PerfRequests) towards that interval's mean.
const PerfRequests = 64

// PerfRateWindow is the time constant over which Perf.Rate follows the
// first tokens per second.
const PerfRateWindow = 2 * time.Second

// next returns p updated with the requests that finished between the
// pages that gave prev and cur, dt apart. A histogram whose count went
// down (the server restarted) contributes nothing this time and starts
// afresh.
func (p Perf) next(prev, cur *Values, dt time.Duration) Perf {
	if prev == nil {
		return p
	}
	delta := func(k HistKind) (sum, count float64) {
		a, b := prev.Hists[k], cur.Hists[k]
		if b.Count < a.Count || b.Sum < a.Sum {
			return 0, 0
		}
		return b.Sum - a.Sum, b.Count - a.Count
	}
	n := 0.0
	ttft := func(v *Values) Hist {
		if v.TTFT == nil {
			return Hist{}
		}
		return Hist{Sum: v.TTFT.Sum, Count: v.TTFT.Count}
	}
	prevTTFT, curTTFT := ttft(prev), ttft(cur)
	if c := curTTFT.Count - prevTTFT.Count; c > 0 && curTTFT.Sum >= prevTTFT.Sum {
		p.TTFT = ewma(p.TTFT, (curTTFT.Sum-prevTTFT.Sum)/c, c)
		n = c
	}
	means := [NumHists]*float64{
		HistQueue: &p.Queue, HistPrefill: &p.Prefill,
		HistInference: &p.Inference, HistPrefillTokens: &p.PrefillTokens,
	}
	for k, mean := range means {
		s, c := delta(HistKind(k))
		if c <= 0 {
			continue
		}
		*mean = ewma(*mean, s/c, c)
		n = max(n, c)
	}
	if ps, pc := delta(HistPrefill); pc > 0 {
		if ts, tc := delta(HistPrefillTokens); tc > 0 && ts > 0 {
			// A ratio of decayed sums, not a mean of ratios: short
			// prefills weigh by their tokens, so PrefillPerToken times
			// PrefillTokens is the mean prefill time.
			d := math.Exp(-min(pc, tc) / PerfRequests)
			p.prefillSecs = p.prefillSecs*d + ps
			p.prefillToks = p.prefillToks*d + ts
			p.PrefillPerToken = p.prefillSecs / p.prefillToks
		}
	}
	if c := curTTFT.Count - prevTTFT.Count; dt > 0 && c >= 0 {
		w := 1 - math.Exp(-float64(dt)/float64(PerfRateWindow))
		p.Rate += (c/dt.Seconds() - p.Rate) * w
	}
	p.Requests += n
	return p
}

// ewma moves old towards v by the weight of n new requests; an unknown
// (zero) old takes v.
func ewma(old, v, n float64) float64 {
	if old == 0 || math.IsNaN(old) {
		return v
	}
	w := 1 - math.Exp(-n/PerfRequests)
	return old + w*(v-old)
}
