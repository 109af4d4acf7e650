package picker

import (
	"bytes"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Latency the router measures from the response stream it already sees:
// time to first token (the first response body bytes), time per output
// token, and the whole request, per declared model and target and per
// endpoint. Only successful (2xx) responses of picked requests count; the
// clock starts when the request headers reach the picker, so the
// admission wait is included, as the client sees it.

// Bucket upper bounds (seconds) of the router's latency histograms: fine
// enough below a second for p50/p90 estimates of TTFT.
var (
	ttftBounds = []float64{0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1,
		1.5, 2, 3, 5, 10, 20, 30, 60}
	tpotBounds     = []float64{0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5}
	durationBounds = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600}
)

// TTFTBounds, TPOTBounds and DurationBounds return the bucket bounds
// (seconds) of the router's latency histograms.
func TTFTBounds() []float64     { return ttftBounds }
func TPOTBounds() []float64     { return tpotBounds }
func DurationBounds() []float64 { return durationBounds }

// boundedHist is a lock-free histogram over fixed bounds.
type boundedHist struct {
	bounds []float64
	counts []atomic.Uint64 // len(bounds)+1: the last is above every bound
	sumNS  atomic.Int64
}

func newBoundedHist(bounds []float64) *boundedHist {
	return &boundedHist{bounds: bounds, counts: make([]atomic.Uint64, len(bounds)+1)}
}

func (h *boundedHist) observe(d time.Duration) {
	s := d.Seconds()
	i := 0
	for i < len(h.bounds) && s > h.bounds[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumNS.Add(int64(d))
}

func (h *boundedHist) snapshot() Histogram {
	out := Histogram{Bounds: h.bounds, Cumulative: make([]uint64, len(h.bounds))}
	var total uint64
	for i := range h.counts {
		total += h.counts[i].Load()
		if i < len(h.bounds) {
			out.Cumulative[i] = total
		}
	}
	out.Count = total
	out.SumSeconds = time.Duration(h.sumNS.Load()).Seconds()
	return out
}

// latencyHists are one model's or endpoint's latency histograms.
type latencyHists struct {
	once                   sync.Once
	ttft, tpot, dur, ntpot *boundedHist
}

func (l *latencyHists) init() {
	l.once.Do(func() {
		l.ttft, l.tpot = newBoundedHist(ttftBounds), newBoundedHist(tpotBounds)
		l.dur, l.ntpot = newBoundedHist(durationBounds), newBoundedHist(tpotBounds)
	})
}

func (l *latencyHists) observe(m measured) {
	l.init()
	l.ttft.observe(m.ttft)
	l.dur.observe(m.duration)
	if m.tpot > 0 {
		l.tpot.observe(m.tpot)
	}
	if m.tokens > 0 {
		l.ntpot.observe(m.duration / time.Duration(m.tokens))
	}
}

// Latency is a snapshot of router-measured latency histograms.
type Latency struct {
	TTFT, TPOT, Duration Histogram
	// NTPOT is the whole request divided by its output tokens (the
	// upstream normalized time per output token).
	NTPOT Histogram
}

func (l *latencyHists) snapshot() *Latency {
	if l.ttft == nil {
		return nil
	}
	return &Latency{TTFT: l.ttft.snapshot(), TPOT: l.tpot.snapshot(), Duration: l.dur.snapshot(), NTPOT: l.ntpot.snapshot()}
}

// EndpointLatency is one endpoint's router-measured latency.
type EndpointLatency struct {
	Pool, Address string
	Latency
}

// EndpointLatency returns the latency histograms of the endpoints of the
// current state that served requests (sorted by pool, address), and
// forgets those of endpoints that left it. It takes no lock requests
// take.
func (s *Server) EndpointLatency() []EndpointLatency {
	snap := s.snap.Load()
	var out []EndpointLatency
	s.epLatency.Range(func(k, v any) bool {
		key := k.(loadKey)
		if snap.pools[key.pool].lookup(key.addr) == nil {
			s.epLatency.Delete(k)
			return true
		}
		if l := v.(*latencyHists).snapshot(); l != nil {
			out = append(out, EndpointLatency{Pool: key.pool, Address: key.addr, Latency: *l})
		}
		return true
	})
	sortEndpointLatency(out)
	return out
}

func sortEndpointLatency(out []EndpointLatency) {
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && (out[j].Pool < out[j-1].Pool || out[j].Pool == out[j-1].Pool && out[j].Address < out[j-1].Address); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
}

// endpointLatency returns the histograms of endpoint addr in pool.
func (s *Server) endpointLatency(pool, addr string) *latencyHists {
	k := loadKey{pool, addr}
	if v, ok := s.epLatency.Load(k); ok {
		return v.(*latencyHists)
	}
	v, _ := s.epLatency.LoadOrStore(k, new(latencyHists))
	return v.(*latencyHists)
}

// tailBytes is how much of the response's end is kept to find the usage
// block (vLLM's usage object ends within ~150 bytes of the body).
const tailBytes = 512

// respLatency follows one response: its status, when its first body
// bytes and its end arrived, and its output tokens.
type respLatency struct {
	status     int
	sse        bool
	first, end time.Time
	events     int // SSE "data:" events, [DONE] excluded
	tail       [tailBytes]byte
	tailN      int
}

var (
	sseData  = []byte("data:")
	sseDone  = []byte("[DONE]")
	usageKey = []byte(`"completion_tokens":`)
)

// headers notes the response status and whether it is an event stream.
func (r *respLatency) headers(h *extprocv3.HttpHeaders, now time.Time) {
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch k := hv.GetKey(); {
		case k == ":status":
			r.status, _ = strconv.Atoi(string(headerBytes(hv)))
		case strings.EqualFold(k, "content-type"):
			r.sse = strings.HasPrefix(strings.ToLower(string(headerBytes(hv))), "text/event-stream")
		}
	}
	if h.GetEndOfStream() {
		r.end = now
	}
}

// body notes one response body message.
func (r *respLatency) body(data []byte, eos bool, now time.Time) {
	if len(data) > 0 {
		if r.first.IsZero() {
			r.first = now
		}
		if r.sse {
			r.events += countAcross(r.tail[:r.tailN], data, sseData) + bytes.Count(data, sseData)
			r.events -= countAcross(r.tail[:r.tailN], data, sseDone) + bytes.Count(data, sseDone)
		}
		r.keepTail(data)
	}
	if eos {
		r.end = now
	}
}

// keepTail keeps the last tailBytes of the body.
func (r *respLatency) keepTail(data []byte) {
	if len(data) >= tailBytes {
		r.tailN = copy(r.tail[:], data[len(data)-tailBytes:])
		return
	}
	if r.tailN+len(data) > tailBytes {
		drop := r.tailN + len(data) - tailBytes
		copy(r.tail[:], r.tail[drop:r.tailN])
		r.tailN -= drop
	}
	r.tailN += copy(r.tail[r.tailN:], data)
}

// countAcross counts occurrences of pat that start in prev and end in
// next (a pattern split between two body messages).
func countAcross(prev, next, pat []byte) int {
	k := len(pat) - 1
	if len(prev) == 0 || len(next) == 0 || k == 0 {
		return 0
	}
	var win [16]byte
	a := prev[max(0, len(prev)-k):]
	b := next[:min(k, len(next))]
	w := append(append(win[:0], a...), b...)
	return bytes.Count(w, pat)
}

// tokens returns the output tokens: the usage block's completion_tokens
// when the body ends with one, else the stream's events (about one token
// each), else 0.
func (r *respLatency) tokens() int {
	t := r.tail[:r.tailN]
	if i := bytes.LastIndex(t, usageKey); i >= 0 {
		rest := bytes.TrimLeft(t[i+len(usageKey):], " ")
		n := 0
		for len(rest) > 0 && rest[0] >= '0' && rest[0] <= '9' {
			n = n*10 + int(rest[0]-'0')
			rest = rest[1:]
		}
		if n > 0 {
			return n
		}
	}
	if r.sse {
		return max(r.events, 0)
	}
	return 0
}

// endAt is when the response ended, or now if its end was not seen.
func (r *respLatency) endAt(now time.Time) time.Time {
	if r.end.IsZero() {
		return now
	}
	return r.end
}

// measured is what one finished response contributes.
type measured struct {
	ttft, tpot, duration time.Duration
	tokens               int
}

// measure returns the response's latency from arrival at start; ok is
// false when it does not count (no successful response body).
func (r *respLatency) measure(start, now time.Time) (measured, bool) {
	if r.status/100 != 2 || r.first.IsZero() || start.IsZero() {
		return measured{}, false
	}
	end := r.end
	if end.IsZero() {
		end = now
	}
	m := measured{ttft: r.first.Sub(start), duration: end.Sub(start), tokens: r.tokens()}
	if r.sse && m.tokens > 1 {
		m.tpot = (m.duration - m.ttft) / time.Duration(m.tokens-1)
	}
	return m, true
}
