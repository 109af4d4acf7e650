package picker

import (
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
)

// prefillWork is one request's prefill work counted on an endpoint
// (sched.Load.PrefillRequests and PrefillTokens) from its pick until its
// first token: the first response bytes of a streamed answer, the end of
// the response, or, where the first token cannot be seen (answers that
// are not streamed, picks of other replicas), the time the prediction
// gave it. finish may race with the timer; the counts go back once.
type prefillWork struct {
	load   *sched.Load
	tokens int64
	// inFlight: the work is also a request in flight on load
	// (InFlightRequests), as a split request's prefill on its prefill
	// server is (pd.go).
	inFlight bool
	done     atomic.Bool
	timer    *time.Timer
}

// startPrefill counts tokens of prefill work on load; with expire > 0 the
// work ends by itself after expire.
func startPrefill(load *sched.Load, tokens int64, d time.Duration, now time.Time, expire time.Duration) *prefillWork {
	w := &prefillWork{load: load, tokens: tokens}
	w.start(d, now, expire)
	return w
}

// start counts w on its endpoint (predicted to take d from now); with
// expire > 0 it ends by itself after expire.
func (w *prefillWork) start(d time.Duration, now time.Time, expire time.Duration) {
	if w.inFlight {
		w.load.InFlightRequests.Add(1)
	}
	w.load.StartPrefill(w.tokens, d, now)
	if expire > 0 {
		// The timer's callback must not read w.timer: it may fire before
		// the assignment below is visible to it.
		w.timer = time.AfterFunc(expire, func() { w.end() })
	}
}

// finish takes the work off its endpoint and stops its timer; it reports
// whether this call did (false: it was already finished). Call it from
// the goroutine that started the work (or after synchronising with it).
func (w *prefillWork) finish() bool {
	if !w.end() {
		return false
	}
	if w.timer != nil {
		w.timer.Stop()
	}
	return true
}

// end takes the work off its endpoint once, whoever calls it first.
func (w *prefillWork) end() bool {
	if w == nil || !w.done.CompareAndSwap(false, true) {
		return false
	}
	w.load.EndPrefill(w.tokens)
	if w.inFlight {
		w.load.InFlightRequests.Add(-1)
	}
	return true
}

// ttftStage is the TTFT accounting of a pool whose profile predicts TTFT
// (in that pool's chain only): a pick's predicted prefill work counts on
// its endpoint until the first token, the first token teaches the
// endpoint's model, and the request's end its hold time. Its per-request
// state is request.ttft.
type ttftStage struct{}

var (
	_ pickedStage          = ttftStage{}
	_ servedStage          = ttftStage{}
	_ responseHeadersStage = ttftStage{}
	_ responseBodyStage    = ttftStage{}
	_ releasedStage        = ttftStage{}
)

// ttftStageFor is in the chain of a pool whose profile predicts TTFT.
func ttftStageFor(_ *Server, _ *snapshot, pv *poolView) any {
	if pv != nil && pv.predictor != nil {
		return ttftStage{}
	}
	return nil
}

// ttftState is a request's TTFT accounting.
type ttftState struct {
	on       bool
	pred     sched.Prediction
	predOK   bool // pred is for the endpoint that serves the request
	pickedAt time.Time
	work     *prefillWork
	answered bool // response headers came
}

// picked starts the accounting of a pick: its predicted prefill work
// counts on the primary until the first token. A split request's prefill
// is not the primary's (the P/D stage, before this one, counts it on its
// prefill server), and its first token does not measure the primary.
func (ttftStage) picked(r *request, o *pickOutcome) {
	if r.pd.split {
		return
	}
	if pred, ok := o.sc.Prediction(r.primary.Address); ok {
		r.trackTTFT(r.primary, pred, o.req.Now, o.streamed)
	}
}

func (r *request) trackTTFT(e *sched.Endpoint, pred sched.Prediction, at time.Time, streamed bool) {
	var expire time.Duration
	if !streamed {
		// The first bytes of a whole JSON answer come at its end.
		expire = pred.Total
	}
	r.ttft = ttftState{on: true, pred: pred, predOK: true, pickedAt: at, work: startPrefill(e.Load, pred.Uncached, pred.Prefill, at, expire)}
}

// served follows a fallback: the work moves to the endpoint that serves,
// whose prediction was not made (nothing is learned from this request).
func (ttftStage) served(r *request, _ string, moved bool) {
	t, e := &r.ttft, r.primary
	if !moved || !t.on {
		return
	}
	t.predOK = false
	if t.work.finish() {
		now := time.Now()
		t.work = startPrefill(e.Load, t.pred.Tokens, time.Duration(float64(t.pred.Tokens)*t.pred.PerToken*float64(time.Second)), now, 0)
	}
}

// responseHeaders notes that the response headers came.
func (ttftStage) responseHeaders(r *request, _ *extprocv3.HttpHeaders, _ *extprocv3.ProcessingResponse) {
	if t := &r.ttft; t.on {
		t.answered = true
	}
}

// responseBody sees each response body message once the router's latency
// measurement (r.lat, latency.go) has noted it, which says whether the
// response is a successful event stream and when its first bytes came:
// those are the first token, observed against the prediction.
func (ttftStage) responseBody(r *request, data []byte, _ bool) ([]byte, bool) {
	t, lat := &r.ttft, &r.lat
	if !t.on || lat.first.IsZero() || !t.work.finish() {
		return data, false
	}
	if lat.sse && lat.status/100 == 2 && t.predOK && r.primary != nil {
		ttft := lat.first.Sub(t.pickedAt)
		r.primary.Load.ObserveTTFT(sched.Observation{Predicted: t.pred, TTFT: ttft, At: lat.first})
		if r.s.debug {
			r.s.log.Debug("first token", "pool", poolName(r.pool), "endpoint", r.primary.Address,
				"ttft_ms", float64(ttft)/1e6, "predicted_ms", float64(t.pred.Total)/1e6, "prediction", t.pred.String())
		}
	}
	return data, false
}

// released ends the accounting with the request, once.
func (ttftStage) released(r *request) {
	t := &r.ttft
	if !t.on {
		return
	}
	t.on = false
	t.work.finish()
	if t.answered && r.primary != nil {
		r.primary.Load.ObserveHold(time.Since(t.pickedAt))
	}
}

// peerWork holds the prefill work of other replicas' picks until they
// end, by sender and pick ID.
type peerWork struct {
	m sync.Map // peerKey -> *prefillWork
}

type peerKey struct {
	from string
	id   uint64
}

// peerPicked counts another replica's pick's prefill work on ep, priced
// by this replica's own prediction (made before the pick's blocks are
// recorded), for as long as that prediction says its prefill takes.
func (s *Server) peerPicked(pv *poolView, ep *sched.Endpoint, from string, p peers.Pick, now time.Time) {
	req := sched.Request{Tokens: p.Tokens, Hashes: p.Hashes, BlockTokens: pv.state.hasher.Load().blockTokens, Now: now}
	pred := pv.predictor.Predict(&req, ep)
	w := startPrefill(ep.Load, pred.Uncached, pred.Prefill, now, pred.Total)
	if old, loaded := s.peerWork.m.Swap(peerKey{from, p.ID}, w); loaded {
		old.(*prefillWork).finish()
	}
}

// peerReleased ends a peer pick's prefill work if it has not ended yet.
func (s *Server) peerReleased(from string, id uint64) {
	if w, ok := s.peerWork.m.LoadAndDelete(peerKey{from, id}); ok {
		w.(*prefillWork).finish()
	}
}
