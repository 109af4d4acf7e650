package admission

import "time"

// WaitBounds are the upper bounds (seconds) of the wait histogram's
// buckets.
var waitBounds = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// WaitBounds returns the histogram's bucket bounds in seconds.
func WaitBounds() []float64 { return append([]float64(nil), waitBounds...) }

// Histogram is one outcome's waits: Cumulative[i] counts waits <=
// WaitBounds()[i].
type Histogram struct {
	Count      uint64
	SumSeconds float64
	Cumulative []uint64
}

// WaitKey names one wait histogram: the band and how the wait ended
// ("dispatched", "rejected_ttl", "rejected_overflow",
// "rejected_no_endpoint", "evicted" or "cancelled").
type WaitKey struct {
	Priority int
	Outcome  string
}

// waitHistogram counts waits by band and outcome; used under Queue.mu.
// Bands are few (the models' priorities and the header's bounds), so
// the map stays small.
type waitHistogram struct{ by map[WaitKey]*Histogram }

func newWaitHistogram() *waitHistogram { return &waitHistogram{by: map[WaitKey]*Histogram{}} }

func (w *waitHistogram) observe(priority int, outcome string, d time.Duration) {
	k := WaitKey{Priority: priority, Outcome: outcome}
	h := w.by[k]
	if h == nil {
		h = &Histogram{Cumulative: make([]uint64, len(waitBounds))}
		w.by[k] = h
	}
	s := d.Seconds()
	h.Count++
	h.SumSeconds += s
	for i, b := range waitBounds {
		if s <= b {
			h.Cumulative[i]++
		}
	}
}

func (w *waitHistogram) snapshot() map[WaitKey]Histogram {
	out := make(map[WaitKey]Histogram, len(w.by))
	for k, h := range w.by {
		c := *h
		c.Cumulative = append([]uint64(nil), h.Cumulative...)
		out[k] = c
	}
	return out
}
