package tenant

import "time"

// window counts what was charged over a sliding span of time (a minute, a
// day) in fixed slots: a charge at time t stays counted until the end of
// its slot plus the span, so it is never forgotten early (a burst can not
// reuse budget still inside any span-long interval) and at most one slot
// late. The zero value is unusable; see newWindow. Not safe for concurrent
// use (the tenant's mutex guards it).
type window struct {
	span, slot time.Duration
	// counts is a ring of n+1 slots: slot index k (k = time / slot) lives
	// at counts[k % len(counts)]; the ring holds indexes (last-n, last].
	counts []int64
	last   int64 // newest slot index the ring has advanced to
	total  int64
}

func newWindow(span time.Duration, slots int) *window {
	return &window{span: span, slot: span / time.Duration(slots), counts: make([]int64, slots+1)}
}

func (w *window) index(t time.Time) int64 { return t.UnixNano() / int64(w.slot) }

// advance drops the slots that fall out of the window at now.
func (w *window) advance(now time.Time) {
	k := w.index(now)
	if k <= w.last {
		return
	}
	n := int64(len(w.counts))
	if k-w.last >= n {
		clear(w.counts)
		w.total = 0
	} else {
		for i := w.last + 1; i <= k; i++ {
			j := i % n
			w.total -= w.counts[j]
			w.counts[j] = 0
		}
	}
	w.last = k
}

// used returns what is counted at now.
func (w *window) used(now time.Time) int64 {
	w.advance(now)
	return w.total
}

// add charges n (may be negative: a refund) at time at, or at now when at
// is already out of the window (a refund is then dropped). Counts never go
// below zero.
func (w *window) add(now, at time.Time, n int64) {
	w.advance(now)
	k := w.index(at)
	if k > w.last || k <= w.last-int64(len(w.counts)) {
		if n < 0 {
			return
		}
		k = w.last
	}
	j := k % int64(len(w.counts))
	if n < 0 {
		n = -min(-n, w.counts[j])
	}
	w.counts[j] += n
	w.total += n
}

// expiry is when the charges of slot index k stop being counted.
func (w *window) expiry(k int64) time.Time {
	return time.Unix(0, (k+int64(len(w.counts)))*int64(w.slot))
}

// waitFor returns how long from now until at most limit-need is counted,
// i.e. until a charge of need fits under limit (0 if it fits now).
func (w *window) waitFor(now time.Time, need, limit int64) time.Duration {
	w.advance(now)
	excess := w.total + need - limit
	if excess <= 0 {
		return 0
	}
	n := int64(len(w.counts))
	for k := w.last - n + 1; k <= w.last; k++ {
		excess -= w.counts[k%n]
		if excess <= 0 {
			return w.expiry(k).Sub(now)
		}
	}
	return w.expiry(w.last).Sub(now)
}

// reset returns how long from now until nothing is counted.
func (w *window) reset(now time.Time) time.Duration {
	w.advance(now)
	n := int64(len(w.counts))
	for k := w.last; k > w.last-n; k-- {
		if w.counts[k%n] != 0 {
			return w.expiry(k).Sub(now)
		}
	}
	return 0
}
