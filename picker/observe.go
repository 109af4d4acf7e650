package picker

import (
	"sort"
	"sync/atomic"
	"time"
)

// objectiveCounters count one model/target pair's requests. They live in
// loads and survive rebuilds, so Prometheus counters never go backwards
// while the model exists.
type objectiveCounters struct {
	requests atomic.Int64
	errors   [len(rejectCodes)]atomic.Int64 // by rejectIndex
	latency  latencyHists                   // router-measured (latency.go)
}

// objKey names one model/target pair ("" target: no rewrite).
type objKey struct{ model, target string }

// decisionBuckets are the upper bounds of the decision-latency histogram.
var decisionBuckets = [...]time.Duration{
	10 * time.Microsecond, 25 * time.Microsecond, 50 * time.Microsecond, 100 * time.Microsecond,
	250 * time.Microsecond, 500 * time.Microsecond, time.Millisecond, 2500 * time.Microsecond,
	5 * time.Millisecond, 10 * time.Millisecond, 25 * time.Millisecond,
}

// histogram is a lock-free fixed-bucket latency histogram.
type histogram struct {
	counts [len(decisionBuckets) + 1]atomic.Uint64 // last: above every bound
	sumNS  atomic.Int64
}

func (h *histogram) observe(d time.Duration) {
	i := 0
	for i < len(decisionBuckets) && d > decisionBuckets[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumNS.Add(int64(d))
}

// Histogram is a snapshot of a latency histogram in Prometheus' shape.
type Histogram struct {
	// Bounds are the bucket upper bounds in seconds; Cumulative[i] counts
	// observations <= Bounds[i].
	Bounds     []float64
	Cumulative []uint64
	Count      uint64
	SumSeconds float64
}

func (h *histogram) snapshot() Histogram {
	out := Histogram{Bounds: make([]float64, len(decisionBuckets)), Cumulative: make([]uint64, len(decisionBuckets))}
	var total uint64
	for i := range h.counts {
		total += h.counts[i].Load()
		if i < len(decisionBuckets) {
			out.Bounds[i] = decisionBuckets[i].Seconds()
			out.Cumulative[i] = total
		}
	}
	out.Count = total
	out.SumSeconds = time.Duration(h.sumNS.Load()).Seconds()
	return out
}

// ObjectiveStats are one model/target pair's request counters.
type ObjectiveStats struct {
	Model, Target string // Target is the model itself when not rewritten
	Requests      int64
	Errors        map[int]int64 // local replies by HTTP status
	// Latency is what the router measured of the pair's successful
	// responses (nil: none yet).
	Latency *Latency
}

// PoolStats describe one pool's scheduling state.
type PoolStats struct {
	Name string
	// Saturated: every eligible endpoint is over the queue or KV threshold
	// (sheddable requests get 429).
	Saturated bool
	// SaturatedShare is the share (0..1) of the pool's ready endpoints
	// that are saturated on their own (no ready endpoint: 1).
	SaturatedShare float64
	// Prefix index size and the blocks of routed prompts the chosen
	// endpoint was believed to hold (MatchedBlocks / PromptBlocks is the
	// index's hit ratio).
	PrefixEntries, PrefixBlocks int
	PrefixBytes                 int64
	PromptBlocks, MatchedBlocks int64
	// PDDecisions counts the prefill/decode decisions of a disaggregated
	// pool's requests by decision (picker/pd's reasons: "split", or why
	// the request went whole); nil for other pools.
	PDDecisions map[string]int64
}

// Observability is everything the picker reports beyond Stats.
type Observability struct {
	Decision   Histogram
	Objectives []ObjectiveStats // sorted by model, target
	Running    map[string]int64 // in-flight requests by model
	Pools      []PoolStats      // sorted by name
}

// Observe collects the picker's histograms and per-model and per-pool
// counters. It locks the prefix indexes briefly: call it from a metrics
// scrape, not per request.
func (s *Server) Observe(now time.Time) Observability {
	out := Observability{Decision: s.stats.decision.snapshot(), Running: map[string]int64{}}
	snap := s.snap.Load()
	s.loads.mu.Lock()
	for k, c := range s.loads.objectives {
		os := ObjectiveStats{Model: k.model, Target: k.target, Requests: c.requests.Load(), Errors: map[int]int64{}, Latency: c.latency.snapshot()}
		if os.Target == "" {
			os.Target = os.Model
		}
		for i, code := range rejectCodes {
			if n := c.errors[i].Load(); n > 0 {
				os.Errors[code] = n
			}
		}
		out.Objectives = append(out.Objectives, os)
	}
	for m, r := range s.loads.running {
		out.Running[m] = r.Load()
	}
	s.loads.mu.Unlock()
	sort.Slice(out.Objectives, func(i, j int) bool {
		a, b := out.Objectives[i], out.Objectives[j]
		return a.Model < b.Model || a.Model == b.Model && a.Target < b.Target
	})
	for name, pv := range snap.pools {
		ps := PoolStats{Name: name, PromptBlocks: pv.state.promptBlocks.Load(), MatchedBlocks: pv.state.matchedBlocks.Load()}
		st := pv.state.index.Stats()
		ps.PrefixEntries, ps.PrefixBlocks, ps.PrefixBytes = st.Entries, st.Blocks, st.Bytes
		ps.Saturated = s.saturated(pv, now)
		ps.SaturatedShare = s.saturatedShare(pv, now)
		ps.PDDecisions = pdDecisions(pv)
		out.Pools = append(out.Pools, ps)
	}
	sort.Slice(out.Pools, func(i, j int) bool { return out.Pools[i].Name < out.Pools[j].Name })
	return out
}

// saturatedShare is the share of pv's ready endpoints that the pool's
// saturation rule judges saturated one by one.
func (s *Server) saturatedShare(pv *poolView, now time.Time) float64 {
	if len(pv.ready) == 0 {
		return 1
	}
	n := 0
	for i := range pv.ready {
		if s.saturatedAmong(pv, pv.ready[i:i+1], now) {
			n++
		}
	}
	return float64(n) / float64(len(pv.ready))
}

// Saturated reports, per pool, whether the pool is saturated at now (see
// PoolStats.Saturated). It takes no locks; a status page may poll it.
func (s *Server) Saturated(now time.Time) map[string]bool {
	snap := s.snap.Load()
	out := make(map[string]bool, len(snap.pools))
	for name, pv := range snap.pools {
		out[name] = s.saturated(pv, now)
	}
	return out
}

// saturated applies the pool's saturation rule (and Options.Saturation)
// to its endpoints that are not draining.
func (s *Server) saturated(pv *poolView, now time.Time) bool {
	return s.saturatedAmong(pv, pv.ready, now)
}
