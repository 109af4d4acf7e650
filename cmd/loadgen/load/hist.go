package load

import (
	"math"
	"math/bits"
	"time"
)

// histogram records durations in log-linear buckets: exact below 256 ns,
// then 128 buckets per power of two, so any quantile is within 0.8% of the
// true sample while memory stays fixed (~58 KiB) however many samples
// arrive. Count, sum, min and max are exact.
type histogram struct {
	counts   []uint64
	n        uint64
	sum      float64 // ns
	min, max int64
}

const (
	histSubBits = 7
	histSub     = 1 << histSubBits // 128
	histLinear  = 2 * histSub      // values below this are exact
	histBuckets = histLinear + 55*histSub
)

func histIndex(v int64) int {
	if v < histLinear {
		return int(v)
	}
	e := bits.Len64(uint64(v)) - (histSubBits + 1)
	return histLinear + (e-1)*histSub + int(v>>e) - histSub
}

// histValue is the midpoint of bucket idx.
func histValue(idx int) int64 {
	if idx < histLinear {
		return int64(idx)
	}
	e := (idx-histLinear)/histSub + 1
	lo := int64((idx-histLinear)%histSub+histSub) << e
	return lo + (int64(1)<<e)/2
}

func (h *histogram) record(d time.Duration) {
	v := int64(d)
	if v < 0 {
		v = 0
	}
	if h.counts == nil {
		h.counts = make([]uint64, histBuckets)
	}
	h.counts[histIndex(v)]++
	if h.n == 0 || v < h.min {
		h.min = v
	}
	if v > h.max {
		h.max = v
	}
	h.n++
	h.sum += float64(v)
}

func (h *histogram) merge(o *histogram) {
	if o.n == 0 {
		return
	}
	if h.counts == nil {
		h.counts = make([]uint64, histBuckets)
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.n == 0 || o.min < h.min {
		h.min = o.min
	}
	if o.max > h.max {
		h.max = o.max
	}
	h.n += o.n
	h.sum += o.sum
}

// quantile returns the q-quantile (0 < q <= 1) by nearest rank.
func (h *histogram) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	if rank < 1 {
		rank = 1
	}
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			v := histValue(i)
			v = max(h.min, min(h.max, v))
			return time.Duration(v)
		}
	}
	return time.Duration(h.max)
}

// Summary is a latency distribution. JSON carries milliseconds.
type Summary struct {
	Count int64         `json:"count"`
	Mean  time.Duration `json:"-"`
	P50   time.Duration `json:"-"`
	P90   time.Duration `json:"-"`
	P99   time.Duration `json:"-"`
	P999  time.Duration `json:"-"` // rare events: one token gap in a thousand
	Min   time.Duration `json:"-"`
	Max   time.Duration `json:"-"`

	MeanMs float64 `json:"mean_ms"`
	P50Ms  float64 `json:"p50_ms"`
	P90Ms  float64 `json:"p90_ms"`
	P99Ms  float64 `json:"p99_ms"`
	P999Ms float64 `json:"p999_ms"`
	MinMs  float64 `json:"min_ms"`
	MaxMs  float64 `json:"max_ms"`
}

func (h *histogram) summary() Summary {
	if h.n == 0 {
		return Summary{}
	}
	s := Summary{
		Count: int64(h.n),
		Mean:  time.Duration(h.sum / float64(h.n)),
		P50:   h.quantile(0.50),
		P90:   h.quantile(0.90),
		P99:   h.quantile(0.99),
		P999:  h.quantile(0.999),
		Min:   time.Duration(h.min),
		Max:   time.Duration(h.max),
	}
	ms := func(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }
	s.MeanMs, s.P50Ms, s.P90Ms, s.P99Ms, s.P999Ms = ms(s.Mean), ms(s.P50), ms(s.P90), ms(s.P99), ms(s.P999)
	s.MinMs, s.MaxMs = ms(s.Min), ms(s.Max)
	return s
}
