package status

import (
	"cmp"
	"context"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/switchyard/switchyard/picker"
	"github.com/switchyard/switchyard/picker/metrics"
)

// History defaults: a sample every 5 s over the last 15 minutes.
const (
	DefaultHistoryInterval = 5 * time.Second
	DefaultHistoryWindow   = 15 * time.Minute
)

// History keeps a bounded in-memory history of what the status page
// charts, sampled from the picker every interval: per pool the admission
// queue; per endpoint its scraped queue and KV-cache use, the picker's
// requests in flight, and TTFT p50/p90 over the interval as the router
// measured it and as the engine reports it. It serves /api/history.
type History struct {
	p        *picker.Server
	interval time.Duration
	size     int

	mu     sync.Mutex
	points []histPoint // ring, oldest first once full
	next   int
	// The cumulative histograms of the previous sample, for interval
	// deltas.
	prevRouter map[epKey]picker.Histogram
	prevEngine map[epKey]*metrics.Histogram
}

type epKey struct{ pool, addr string }

// histPoint is one sample: eps[i] is endpoint keys[i]'s. The keys are
// shared with the previous sample while the endpoints stay the same, so
// a sample costs 32 bytes per endpoint (15 minutes of them at 1,000
// endpoints: 5.8 MB).
type histPoint struct {
	t     time.Time
	pools map[string]int // admission queue: waiting requests
	keys  []epKey
	eps   []epSample
}

// epSample is one endpoint's values at a sample; NaN where there is none.
type epSample struct {
	waiting, running float32
	kv               float32
	inFlight         float32
	ttft50, ttft90   float32 // ms, router
	eng50, eng90     float32 // ms, engine
}

var none = float32(math.NaN())

// f32 stores an optional value (nil: NaN).
func f32(v *float64) float32 {
	if v == nil {
		return none
	}
	return float32(*v)
}

// opt reads a stored value back (NaN: nil), to four decimals (what a
// float32 holds of them, without its binary tail in the JSON).
func opt(v float32) *float64 {
	if v != v {
		return nil
	}
	f := math.Round(float64(v)*1e4) / 1e4
	return &f
}

// NewHistory returns a History of p sampled every interval over window
// (zero: the defaults).
func NewHistory(p *picker.Server, interval, window time.Duration) *History {
	if interval <= 0 {
		interval = DefaultHistoryInterval
	}
	if window <= 0 {
		window = DefaultHistoryWindow
	}
	return &History{p: p, interval: interval, size: max(1, int(window/interval)),
		prevRouter: map[epKey]picker.Histogram{}, prevEngine: map[epKey]*metrics.Histogram{}}
}

// Run samples every interval until ctx ends.
func (h *History) Run(ctx context.Context) error {
	t := time.NewTicker(h.interval)
	defer t.Stop()
	h.Sample(time.Now())
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
			h.Sample(now)
		}
	}
}

// Sample takes one sample at now.
func (h *History) Sample(now time.Time) {
	ps := h.p.Stats()
	lat := h.p.EndpointLatency()
	queues := h.p.AdmissionStats()
	pt := histPoint{t: now, pools: map[string]int{}, keys: make([]epKey, 0, len(ps.Endpoints)), eps: make([]epSample, 0, len(ps.Endpoints))}
	for _, q := range queues {
		n := 0
		for _, w := range q.Waiting {
			n += w.Requests
		}
		pt.pools[q.Pool] = n
	}
	router := map[epKey]picker.Histogram{}
	for _, l := range lat {
		router[epKey{l.Pool, l.Address}] = l.TTFT
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	engine := map[epKey]*metrics.Histogram{}
	for _, e := range ps.Endpoints {
		k := epKey{e.Pool, e.Address}
		s := epSample{inFlight: float32(e.InFlightRequests), waiting: none, running: none, kv: none,
			ttft50: none, ttft90: none, eng50: none, eng90: none}
		if m := e.Metrics; m != nil && !m.LastSuccess.IsZero() && !m.Failing {
			s.waiting, s.running, s.kv = float32(m.Waiting), float32(m.Running), float32(m.KVUsage)
			if m.TTFT != nil {
				engine[k] = m.TTFT
				p50, p90 := engineQuantiles(m.TTFT, h.prevEngine[k])
				s.eng50, s.eng90 = f32(p50), f32(p90)
			}
		}
		if cur, ok := router[k]; ok {
			p50, p90 := routerQuantiles(cur, h.prevRouter[k])
			s.ttft50, s.ttft90 = f32(p50), f32(p90)
		}
		pt.keys = append(pt.keys, k)
		pt.eps = append(pt.eps, s)
	}
	if len(h.points) > 0 {
		last := h.points[(h.next+len(h.points)-1)%len(h.points)]
		if slices.Equal(last.keys, pt.keys) {
			pt.keys = last.keys
		}
	}
	h.prevRouter, h.prevEngine = router, engine
	if len(h.points) < h.size {
		h.points = append(h.points, pt)
		return
	}
	h.points[h.next] = pt
	h.next = (h.next + 1) % h.size
}

// ordered returns the samples oldest first.
func (h *History) ordered() []histPoint {
	out := make([]histPoint, 0, len(h.points))
	out = append(out, h.points[h.next:]...)
	return append(out, h.points[:h.next]...)
}

// routerQuantiles returns p50 and p90 (ms) of the observations between
// prev and cur (nil when none).
func routerQuantiles(cur, prev picker.Histogram) (*float64, *float64) {
	n := float64(cur.Count)
	cum := make([]float64, len(cur.Cumulative))
	for i, c := range cur.Cumulative {
		cum[i] = float64(c)
	}
	if len(prev.Cumulative) == len(cur.Cumulative) && prev.Count <= cur.Count {
		n -= float64(prev.Count)
		for i := range cum {
			cum[i] -= float64(prev.Cumulative[i])
		}
	}
	return quantile(cur.Bounds, cum, n, 0.5), quantile(cur.Bounds, cum, n, 0.9)
}

// engineQuantiles is routerQuantiles for an engine's histogram; a count
// that went down (the server restarted) starts over.
func engineQuantiles(cur, prev *metrics.Histogram) (*float64, *float64) {
	n := cur.Count
	cum := append([]float64(nil), cur.Cumulative...)
	if prev != nil && len(prev.Cumulative) == len(cum) && prev.Count <= cur.Count {
		n -= prev.Count
		for i := range cum {
			cum[i] -= prev.Cumulative[i]
		}
	}
	return quantile(cur.Bounds, cum, n, 0.5), quantile(cur.Bounds, cum, n, 0.9)
}

// quantile estimates the q-quantile in milliseconds of n observations in
// cumulative buckets, interpolating linearly within the bucket (nil: no
// observation).
func quantile(bounds, cum []float64, n, q float64) *float64 {
	if n <= 0 || len(bounds) == 0 {
		return nil
	}
	rank := q * n
	lower, below := 0.0, 0.0
	for i, b := range bounds {
		if cum[i] >= rank {
			v := lower
			if in := cum[i] - below; in > 0 {
				v += (b - lower) * (rank - below) / in
			}
			ms := v * 1000
			return &ms
		}
		lower, below = b, cum[i]
	}
	ms := bounds[len(bounds)-1] * 1000 // above the last bound
	return &ms
}

// historyJSON is /api/history: one series per pool and endpoint, values
// aligned with Times (null: no value at that sample).
type historyJSON struct {
	IntervalS float64        `json:"interval_s"`
	WindowS   float64        `json:"window_s"`
	Times     []int64        `json:"times"` // Unix milliseconds
	Pools     []poolSeries   `json:"pools"`
	Endpoints []endpointSeri `json:"endpoints"`
}

type poolSeries struct {
	Pool   string `json:"pool"`
	Queued []*int `json:"queued"`
}

type endpointSeri struct {
	Pool      string     `json:"pool"`
	Address   string     `json:"address"`
	Waiting   []*float64 `json:"waiting"`
	Running   []*float64 `json:"running"`
	KV        []*float64 `json:"kv_cache_usage"`
	InFlight  []*float64 `json:"in_flight"`
	TTFTP50   []*float64 `json:"ttft_p50_ms"`
	TTFTP90   []*float64 `json:"ttft_p90_ms"`
	EngineP50 []*float64 `json:"engine_ttft_p50_ms"`
	EngineP90 []*float64 `json:"engine_ttft_p90_ms"`
}

// JSON renders the history for /api/history.
func (h *History) JSON() any {
	h.mu.Lock()
	pts := h.ordered()
	h.mu.Unlock()
	out := historyJSON{IntervalS: h.interval.Seconds(), WindowS: (time.Duration(h.size) * h.interval).Seconds(),
		Times: make([]int64, len(pts)), Pools: []poolSeries{}, Endpoints: []endpointSeri{}}
	pools := map[string]*poolSeries{}
	var poolOrder []string
	eps := map[epKey]*endpointSeri{}
	var epOrder []epKey
	n := len(pts)
	for i, pt := range pts {
		out.Times[i] = pt.t.UnixMilli()
		for name, q := range pt.pools {
			ps := pools[name]
			if ps == nil {
				ps = &poolSeries{Pool: name, Queued: make([]*int, n)}
				pools[name] = ps
				poolOrder = append(poolOrder, name)
			}
			v := q
			ps.Queued[i] = &v
		}
		for j, s := range pt.eps {
			k := pt.keys[j]
			es := eps[k]
			if es == nil {
				es = &endpointSeri{Pool: k.pool, Address: k.addr, Waiting: make([]*float64, n), Running: make([]*float64, n),
					KV: make([]*float64, n), InFlight: make([]*float64, n), TTFTP50: make([]*float64, n), TTFTP90: make([]*float64, n),
					EngineP50: make([]*float64, n), EngineP90: make([]*float64, n)}
				eps[k] = es
				epOrder = append(epOrder, k)
			}
			es.Waiting[i], es.Running[i], es.KV[i], es.InFlight[i] = opt(s.waiting), opt(s.running), opt(s.kv), opt(s.inFlight)
			es.TTFTP50[i], es.TTFTP90[i], es.EngineP50[i], es.EngineP90[i] = opt(s.ttft50), opt(s.ttft90), opt(s.eng50), opt(s.eng90)
		}
	}
	slices.Sort(poolOrder)
	for _, name := range poolOrder {
		out.Pools = append(out.Pools, *pools[name])
	}
	slices.SortFunc(epOrder, func(a, b epKey) int {
		if c := cmp.Compare(a.pool, b.pool); c != 0 {
			return c
		}
		return cmp.Compare(a.addr, b.addr)
	})
	for _, k := range epOrder {
		out.Endpoints = append(out.Endpoints, *eps[k])
	}
	return out
}

// serve answers /api/history.
func (h *History) serve(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(h.JSON())
}
