package metrics

import (
	"math"
	"time"
)

// Perf is what successive scrapes of one endpoint say about its speed:
// the mean of each latency histogram over its recent requests, and the
// concurrency limit it showed. It is derived from the difference between
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
	// MaxRunning is the server's slot limit (max-num-seqs) once it has
	// shown it: the largest running count ever seen, held while requests
	// waited and the KV cache had room for perfPinnedScrapes scrapes in a
	// row (0 until then). A queue at one scrape is no sign of a limit:
	// requests that arrive during an engine step wait for the next one.
	MaxRunning int
	// maxSeen is the largest running count seen; pinned counts the
	// scrapes in a row that found it running with a queue.
	maxSeen, pinned int
}

// PerfRequests is how many recent requests the Perf means mostly
// reflect: a scrape interval in which n requests finished moves each mean
// a fraction 1-exp(-n/PerfRequests) towards that interval's mean.
const PerfRequests = 64

// perfKVRoom is the KV-cache usage below which a queue is taken to be
// waiting for a sequence slot rather than for KV blocks.
const perfKVRoom = 0.9

// perfPinnedScrapes is how many scrapes in a row must find the largest
// running count with a queue before it counts as the slot limit.
const perfPinnedScrapes = 4

// PerfRateWindow is the time constant over which Perf.Rate follows the
// first tokens per second.
const PerfRateWindow = 2 * time.Second

// next returns p updated with the requests that finished between the
// pages that gave prev and cur, dt apart. A histogram whose count went
// down (the server restarted) contributes nothing this time and starts
// afresh; so does MaxRunning.
func (p Perf) next(prev, cur *Values, dt time.Duration) Perf {
	if prev == nil {
		return p.observeRunning(cur)
	}
	restarted := false
	delta := func(k HistKind) (sum, count float64) {
		a, b := prev.Hists[k], cur.Hists[k]
		if b.Count < a.Count || b.Sum < a.Sum {
			restarted = true
			return 0, 0
		}
		return b.Sum - a.Sum, b.Count - a.Count
	}
	n := 0.0
	means := [NumHists]*float64{
		HistTTFT: &p.TTFT, HistQueue: &p.Queue, HistPrefill: &p.Prefill,
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
	if c := cur.Hists[HistTTFT].Count - prev.Hists[HistTTFT].Count; dt > 0 && c >= 0 {
		w := 1 - math.Exp(-float64(dt)/float64(PerfRateWindow))
		p.Rate += (c/dt.Seconds() - p.Rate) * w
	}
	if restarted {
		p.MaxRunning, p.maxSeen, p.pinned = 0, 0, 0
	}
	p.Requests += n
	return p.observeRunning(cur)
}

func (p Perf) observeRunning(cur *Values) Perf {
	if cur.Running > p.maxSeen {
		p.maxSeen, p.pinned = cur.Running, 0
		if p.MaxRunning > 0 && cur.Running > p.MaxRunning {
			p.MaxRunning = 0 // it was no limit after all
		}
	}
	if cur.Running == p.maxSeen && cur.Running > 0 && cur.Waiting > 0 && cur.KVUsage < perfKVRoom {
		if p.pinned++; p.pinned >= perfPinnedScrapes {
			p.MaxRunning = p.maxSeen
		}
	} else {
		p.pinned = 0
	}
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
