// Package sched owns the picker's scheduling framework: the endpoint snapshot
// the scheduler sees, and the small plug-in interfaces (Filter, Scorer,
// Picker) a Profile chains together to choose a primary endpoint plus
// fallbacks for one request. It knows nothing about Envoy or gRPC.
//
// Hot-path rules: filters narrow a caller-owned candidate slice in place,
// scorers write into a caller-owned []float64, and nothing allocates per
// request once a Scratch has grown to the pool size.
package sched

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

// Load holds an endpoint's live counters. One Load exists per pool+address
// and survives every state rebuild, so in-flight accounting is never lost
// when the registry publishes a new version.
type Load struct {
	// InFlightRequests counts requests picked for the endpoint whose
	// response has not finished yet.
	InFlightRequests atomic.Int64
	// InFlightTokens sums the estimated prompt tokens of those requests.
	InFlightTokens atomic.Int64
	// Picked counts every time the endpoint was chosen as primary.
	Picked atomic.Int64
	// PeerPicked counts the picks of the endpoint other replicas shared.
	PeerPicked atomic.Int64
	// Served counts responses Envoy reported as served by this endpoint.
	Served atomic.Int64
	// PrefillRequests counts the requests sent to the endpoint (by this
	// picker or, when replicas share picks, another) whose first token has
	// not come yet, and PrefillTokens the prompt tokens they are predicted
	// to compute: the prefill work ahead of a new request (profiles with
	// the TTFT scorer keep them; see StartPrefill).
	PrefillRequests atomic.Int64
	PrefillTokens   atomic.Int64
	// PrefillFailed is when (Unix ns) a split request's prefill on the
	// endpoint last failed, as the decode server's sidecar reported it (0:
	// never); the picker chooses the endpoint for prefills again once a
	// later scrape of it succeeds.
	PrefillFailed atomic.Int64
	// prefillUntil (Unix nanoseconds) is when the prefill work counted
	// in PrefillRequests is predicted to be done.
	prefillUntil atomic.Int64
	// ttft learns the endpoint's time to first token.
	ttft ttftLearner
	// cacheBlocks is the KV block count last applied to the prefix index.
	cacheBlocks atomic.Int64
	// mark is the in-flight count when the latest scrape was taken, and
	// batch the server's learned batch size (0: not learned yet); see
	// MarkScrape and waitingIfSent.
	mark  atomic.Pointer[scrapeMark]
	batch atomic.Int64
	// batchSeen is when a scrape last showed requests waiting (Unix ns):
	// the batch was confirmed then.
	batchSeen atomic.Int64
	// shrinkRuns counts consecutive scrapes with requests waiting behind
	// fewer running than the batch, shrinkMax the most running among them
	// (see MarkScrape). Only the endpoint's scrape goroutine writes them.
	shrinkRuns, shrinkMax atomic.Int64
}

// shrinkAfter is how many scrapes in a row must show requests waiting
// behind a smaller batch before the learned batch shrinks to it.
const shrinkAfter = 5

// scrapeMark ties a scrape (by its LastSuccess time) to the picker's
// in-flight count at that moment.
type scrapeMark struct {
	at       time.Time
	inFlight int64
}

// Demand reports what the picker sent the endpoint: every pick so far and
// the requests in flight (its own, and other replicas' when they share
// picks). It makes Load a metrics.Demand: the scraper reads an endpoint
// that gets traffic at its interval, an idle one rarely.
func (l *Load) Demand() (sent, inFlight int64) {
	return l.Picked.Load() + l.PeerPicked.Load(), l.InFlightRequests.Load()
}

var _ metrics.Demand = (*Load)(nil)

// MarkScrape records, for the successful scrape s about to be published,
// the requests in flight now, so that what was sent and what finished
// since the scrape can be told apart from what the scrape counted. It
// also learns the server's batch: while requests wait, the running ones
// fill it (its sequence limit, or what its KV cache holds). One scrape
// can catch a request that arrived between two scheduler steps waiting
// beside a batch that is not full, so the batch grows at once to the
// largest running count seen with requests waiting, but shrinks only
// when shrinkAfter scrapes in a row show requests waiting behind fewer
// running (long prompts filling the KV cache). The metrics scraper calls
// it (Options.OnScrape).
func (l *Load) MarkScrape(s *metrics.Snapshot) {
	l.mark.Store(&scrapeMark{at: s.LastSuccess, inFlight: l.InFlightRequests.Load()})
	r, b := int64(s.Running), l.batch.Load()
	switch {
	case s.Waiting > 0 && r > 0:
		l.batchSeen.Store(s.LastSuccess.UnixNano())
		if r >= b {
			l.batch.Store(r)
			l.shrinkRuns.Store(0)
			l.shrinkMax.Store(0)
			return
		}
		l.shrinkMax.Store(max(l.shrinkMax.Load(), r))
		if l.shrinkRuns.Add(1) >= shrinkAfter {
			l.batch.Store(l.shrinkMax.Load())
			l.shrinkRuns.Store(0)
			l.shrinkMax.Store(0)
		}
	default:
		l.shrinkRuns.Store(0)
		l.shrinkMax.Store(0)
		if r > b && b > 0 {
			l.batch.Store(r)
		}
	}
}

// MetricsSource yields an endpoint's latest scraped Snapshot with one atomic
// load (picker/metrics.Handle implements it). Load may return nil before the
// first scrape.
type MetricsSource interface {
	Load() *metrics.Snapshot
}

// Endpoint is one immutable endpoint entry of a pool snapshot.
type Endpoint struct {
	Pool    string
	Address string
	// Models the endpoint advertises; empty means it serves the whole pool.
	Models   []string
	Draining bool
	// Role is the endpoint's part in a disaggregated pool (RoleBoth in
	// every other pool): RoleFilter keeps clients' requests off prefill
	// servers.
	Role registry.Role
	// Load is shared across snapshots (never nil).
	Load *Load
	// Metrics is the endpoint's scraped load; nil when it is not scraped
	// (draining, or scraping disabled).
	Metrics MetricsSource
}

// Snapshot returns the endpoint's latest scraped Snapshot, or nil.
func (e *Endpoint) Snapshot() *metrics.Snapshot {
	if e.Metrics == nil {
		return nil
	}
	return e.Metrics.Load()
}

// Freshness classifies an endpoint's scraped metrics.
type Freshness int

// Freshness values.
const (
	// Unscraped: no source, or no scrape attempted yet. Nothing is known,
	// nothing is held against it.
	Unscraped Freshness = iota
	// Fresh: the latest successful scrape is within its MaxAge.
	Fresh
	// Stale: scrapes fail or are too old; the endpoint is presumed unhealthy.
	Stale
)

// Freshness classifies e's metrics at now and returns the snapshot when it
// is fresh (nil otherwise). An endpoint marked failing (FailureThreshold
// scrapes in a row failed) is stale even while its last good values are
// younger than MaxAge: it is the state EDS withholds it for, and a server
// refusing connections must not keep getting picked until MaxAge passes.
func (e *Endpoint) Freshness(now time.Time) (Freshness, *metrics.Snapshot) {
	s := e.Snapshot()
	switch {
	case s == nil:
		return Unscraped, nil
	case !s.Failing && s.Fresh(now):
		return Fresh, s
	default:
		return Stale, nil
	}
}

// fresh returns e's snapshot if it is fresh at now, else nil.
func (e *Endpoint) fresh(now time.Time) *metrics.Snapshot {
	_, s := e.Freshness(now)
	return s
}

// isFresh reports whether snapshot s counts as fresh at now (Freshness).
func isFresh(s *metrics.Snapshot, now time.Time) bool {
	return !s.Failing && s.Fresh(now)
}

// freshAt returns eps[i]'s snapshot if it is fresh at the decision's
// time, else nil. While Rank runs, eps being its candidates, the answer
// comes from the snapshots it looked up once for the whole decision (the
// scorers ask again and again over a thousand endpoints).
func (req *Request) freshAt(eps []*Endpoint, i int) *metrics.Snapshot {
	if sc := req.scratch; sc != nil && sc.memoOK && len(eps) == len(sc.memo) && &eps[0] == sc.memoOf {
		return sc.memo[i]
	}
	return eps[i].fresh(req.Now)
}

// Serves reports whether the endpoint advertises model (or advertises
// nothing, meaning it serves everything in its pool).
func (e *Endpoint) Serves(model string) bool {
	return e.serves(model, false)
}

// serves is Serves; with discovered, an endpoint that advertises nothing
// is judged by the models its server lists (/v1/models) once known.
func (e *Endpoint) serves(model string, discovered bool) bool {
	if len(e.Models) > 0 {
		return slices.Contains(e.Models, model)
	}
	if discovered {
		if s := e.Snapshot(); s != nil && s.ServedModels != nil {
			return slices.Contains(s.ServedModels, model)
		}
	}
	return true
}

// Request is what the scheduler knows about one request.
type Request struct {
	// Model is the name the client sent; TargetModel the name sent upstream
	// (equal when no rewrite applies).
	Model       string
	TargetModel string
	// Tokens is the estimated prompt size in tokens.
	Tokens   int64
	Priority int
	// Subset, when HasSubset, restricts candidates to these addresses.
	Subset    []string
	HasSubset bool
	// Body is the (possibly rewritten) request body; read-only.
	Body []byte
	// Now is the decision time, used for every freshness check of one
	// decision; zero means time.Now() when the profile runs.
	Now time.Time
	// Hashes are the prompt's chained block hashes (picker/prefix), root
	// first; empty disables prefix affinity for this request.
	Hashes []uint64
	// BlockTokens is the KV block size (tokens) Hashes were cut with;
	// 0 means prefix.DefaultBlockTokens.
	BlockTokens int
	// Cache, when set, is the request's exact view of the candidates' KV
	// caches (see CacheView); the prefix and TTFT scorers consult it first
	// and the estimating index (Hashes) for candidates it does not know.
	Cache CacheView
	// Session is the session-affinity key (the session header's value);
	// empty means none.
	Session string
	// Explain asks Rank to record a per-scorer explanation of the top
	// candidates in the Scratch (debug logging only: it allocates).
	Explain bool
	// Record asks Filter and Rank to keep the decision's breakdown in the
	// Scratch (see Scratch.Breakdown): what each filter left and every
	// scorer's score of every candidate. Once the Scratch has grown to the
	// pool it allocates nothing; set it only for requests whose decision
	// is traced or recorded.
	Record bool

	scratch *Scratch
}

// CacheView is a request's exact view of what the candidates hold in
// their KV caches, prepared for it before scheduling from the servers'
// own KV-cache events (picker/kvevents.Query implements it).
type CacheView interface {
	// CachedTokens sets tokens[i] to how many of the request's prompt
	// tokens addrs[i] holds in its KV cache (what the server will report
	// as cached), and exact[i] to whether that is known from the server's
	// events; where it is not, the caller estimates. tokens and exact are
	// at least as long as addrs.
	CachedTokens(addrs []string, tokens []int, exact []bool)
	// Tokens is the prompt's length in the engine's tokens.
	Tokens() int
}

// Filter narrows the candidate set. It must return a prefix-reusing subslice
// of eps (filter in place) and must not retain it.
type Filter interface {
	Name() string
	Filter(req *Request, eps []*Endpoint) []*Endpoint
}

// Scorer rates every candidate in [0,1] (higher is better), writing
// scores[i] for eps[i]. It must not retain either slice. A scorer without
// fresh data for an endpoint gives it a neutral score (the mean of the
// others', or 1 when nothing is known), so missing data neither attracts
// nor repels traffic.
type Scorer interface {
	Name() string
	Score(req *Request, eps []*Endpoint, scores []float64)
}

// Observer is implemented by scorers that learn from decisions (prefix
// affinity, session affinity): Picked is called with the primary endpoint
// once a request is routed.
type Observer interface {
	Picked(req *Request, primary *Endpoint)
}

// Picker chooses up to n endpoints from scored candidates, best first, and
// appends them to dst. It may reorder eps and scores.
type Picker interface {
	Name() string
	Pick(eps []*Endpoint, scores []float64, n int, dst []*Endpoint) []*Endpoint
}

// weightedScorer is a scorer with its weight in a profile.
type weightedScorer struct {
	Scorer Scorer
	Weight float64
}

// Profile is one scheduling strategy: filters, then weighted scorers, then a
// picker. Saturation, when set, decides whether sheddable requests are
// refused.
type Profile struct {
	Name       string
	Filters    []Filter
	Scorers    []weightedScorer
	Picker     Picker
	Saturation Saturation
}

// Scratch is per-request working memory; reuse it (e.g. via sync.Pool) to
// keep scheduling allocation-free.
type Scratch struct {
	// Req is a reusable Request for callers that keep one Scratch per
	// decision: plug-ins take the request by pointer through interfaces,
	// so a fresh one per decision would be a heap allocation.
	Req Request

	cands  []*Endpoint
	scores []float64
	tmp    []float64
	picked []*Endpoint
	// Hashes is a reusable buffer for Request.Hashes.
	Hashes []uint64
	// Explanation holds Rank's explanation when Request.Explain is set.
	Explanation string
	// EmptiedBy names the filter that left no candidate in the last
	// Filter ("" when candidates remained or the pool was empty).
	EmptiedBy string
	// Scorer-private buffers. names and matched hold the prefix scorer's
	// per-candidate matches when matchedOK.
	matched   []int
	names     []string
	matchedOK bool
	// From Request.Cache, by the candidate order in names: exact cached
	// tokens, and whether each is exact; estimated is the prefix index's
	// counts before the exact ones replaced them.
	cached    []int
	exact     []bool
	estimated []int
	per       [][]float64
	// The TTFT scorer's predictions, by the candidate order in names.
	preds   []Prediction
	predsOK bool
	// The TTFT scorer's own fits of the candidates (cache-aware).
	fits []ownFit
	// memo holds each candidate's fresh snapshot (nil: none) while Rank
	// runs on the candidates starting at memoOf (see freshAt).
	memo   []*metrics.Snapshot
	memoOf **Endpoint
	memoOK bool
	// What Record keeps (see Breakdown).
	rec recorded
}

// PrefixMatch returns how many of the request's blocks the prefix scorer
// believed endpoint addr holds, in the last Rank; ok is false when the
// prefix scorer did not run or addr was not a candidate.
func (sc *Scratch) PrefixMatch(addr string) (int, bool) {
	if !sc.matchedOK {
		return 0, false
	}
	for i, n := range sc.names {
		if n == addr {
			return sc.matched[i], true
		}
	}
	return 0, false
}

// CachedTokens returns how many prompt tokens the last Rank's request
// view (Request.Cache) says endpoint addr holds; ok is false when that is
// not known exactly (no view, addr not exact there, or not a candidate).
func (sc *Scratch) CachedTokens(addr string) (tokens int, ok bool) {
	if !sc.matchedOK {
		return 0, false
	}
	for i, n := range sc.names {
		if n == addr && i < len(sc.exact) && sc.exact[i] {
			return sc.cached[i], true
		}
	}
	return 0, false
}

// Schedule runs the profile over pool and returns up to n endpoints, best
// first. The returned slice aliases sc and is valid until sc is reused.
func (p *Profile) Schedule(req *Request, pool []*Endpoint, n int, sc *Scratch) []*Endpoint {
	return p.Rank(req, p.Filter(req, pool, sc), n, sc)
}

// Filter runs only the profile's filters and returns the candidates (an
// alias of sc's buffer).
func (p *Profile) Filter(req *Request, pool []*Endpoint, sc *Scratch) []*Endpoint {
	if req.Now.IsZero() {
		req.Now = time.Now()
	}
	sc.cands = append(sc.cands[:0], pool...)
	cands := sc.cands
	sc.EmptiedBy = ""
	sc.rec.reset(req.Record, len(cands))
	for _, f := range p.Filters {
		if len(cands) == 0 {
			break
		}
		if cands = f.Filter(req, cands); len(cands) == 0 {
			sc.EmptiedBy = f.Name()
		}
		if req.Record {
			sc.rec.filters = append(sc.rec.filters, filterCount{Name: f.Name(), Left: len(cands)})
		}
	}
	return cands
}

// Saturated reports whether the profile's saturation rule holds for the
// filtered candidates (false without a rule).
func (p *Profile) Saturated(req *Request, cands []*Endpoint) bool {
	if p.Saturation == nil {
		return false
	}
	if req.Now.IsZero() {
		req.Now = time.Now()
	}
	return p.Saturation.Saturated(req.Now, cands)
}

// Rank scores already-filtered candidates and picks up to n of them, best
// first. cands may be reordered.
func (p *Profile) Rank(req *Request, cands []*Endpoint, n int, sc *Scratch) []*Endpoint {
	if len(cands) == 0 {
		return sc.picked[:0]
	}
	if req.Now.IsZero() {
		req.Now = time.Now()
	}
	req.scratch = sc
	sc.matchedOK, sc.predsOK = false, false
	if cap(sc.memo) < len(cands) {
		sc.memo = make([]*metrics.Snapshot, len(cands))
	}
	sc.memo = sc.memo[:len(cands)]
	for i, e := range cands {
		sc.memo[i] = e.fresh(req.Now)
	}
	sc.memoOf, sc.memoOK = &cands[0], true
	defer func() {
		req.scratch = nil
		sc.memoOK, sc.memoOf = false, nil
		clear(sc.memo) // keep no snapshot alive
	}()
	sc.scores = grow(sc.scores, len(cands))
	sc.tmp = grow(sc.tmp, len(cands))
	clear(sc.scores)
	keep := req.Explain || req.Record
	if keep {
		sc.per = sc.per[:0]
		sc.rec.scorers = sc.rec.scorers[:0]
	}
	for _, ws := range p.Scorers {
		if ws.Weight == 0 {
			continue
		}
		clear(sc.tmp)
		ws.Scorer.Score(req, cands, sc.tmp)
		for i, s := range sc.tmp {
			sc.scores[i] += ws.Weight * s
		}
		if keep {
			sc.keepScores(ws)
		}
	}
	if req.Explain {
		sc.Explanation = p.explain(cands, sc)
	}
	if req.Record {
		// The picker may reorder cands and scores: keep them as scored.
		sc.rec.cands = append(sc.rec.cands[:0], cands...)
		sc.rec.totals = append(sc.rec.totals[:0], sc.scores...)
		sc.rec.ranked = true
	}
	sc.picked = p.Picker.Pick(cands, sc.scores, n, sc.picked[:0])
	return sc.picked
}

// Picked tells the profile's observers which endpoint got the request.
func (p *Profile) Picked(req *Request, primary *Endpoint) {
	for _, ws := range p.Scorers {
		if o, ok := ws.Scorer.(Observer); ok && ws.Weight != 0 {
			o.Picked(req, primary)
		}
	}
}

// explain renders the top candidates by total score with every scorer's
// weighted contribution, e.g.
// "10.0.0.1:8000 total=3.20 [queue=1.00*2 prefix=0.40*3]; ...".
func (p *Profile) explain(cands []*Endpoint, sc *Scratch) string {
	order := make([]int, len(cands))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return sc.scores[order[a]] > sc.scores[order[b]] })
	// Three candidates, or every one when a scorer explains its own
	// figures (the TTFT scorer's predictions).
	limit := 3
	for _, ws := range p.Scorers {
		if _, ok := ws.Scorer.(explainer); ok && ws.Weight != 0 {
			limit = len(order)
		}
	}
	var b strings.Builder
	for k, i := range order {
		if k == limit {
			fmt.Fprintf(&b, "; %d more", len(order)-k)
			break
		}
		if k > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s total=%.3f [", cands[i].Address, sc.scores[i])
		j := 0
		for _, ws := range p.Scorers {
			if ws.Weight == 0 {
				continue
			}
			if j > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%s=%.3f*%g", ws.Scorer.Name(), sc.per[j][i], ws.Weight)
			j++
		}
		b.WriteByte(']')
		if d := explainDetail(p, sc, cands[i].Address); d != "" {
			b.WriteByte(' ')
			b.WriteString(d)
		}
	}
	return b.String()
}

func grow(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	return s[:n]
}
