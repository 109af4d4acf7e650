package quality

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
	"github.com/switchyard/switchyard/internal/realvllm"
)

// firstTokens is a slog handler that keeps the picker's "first token"
// debug records: what each streamed request's TTFT was predicted to be at
// its pick, and what the picker then saw.
type firstTokens struct {
	mu   sync.Mutex
	recs []firstToken
}

type firstToken struct {
	endpoint            string
	observed, predicted float64 // ms
}

func (h *firstTokens) Enabled(context.Context, slog.Level) bool { return true }
func (h *firstTokens) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *firstTokens) WithGroup(string) slog.Handler            { return h }

func (h *firstTokens) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "first token" {
		return nil
	}
	var ft firstToken
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "endpoint":
			ft.endpoint = a.Value.String()
		case "ttft_ms":
			ft.observed = a.Value.Float64()
		case "predicted_ms":
			ft.predicted = a.Value.Float64()
		}
		return true
	})
	h.mu.Lock()
	h.recs = append(h.recs, ft)
	h.mu.Unlock()
	return nil
}

func (h *firstTokens) all() []firstToken {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.recs)
}

// errorStats summarises observed - predicted over records (positive:
// slower than predicted).
type errorStats struct {
	n                                int
	meanErr, meanAbs, p50Abs, p90Abs float64 // ms
	p50Rel, p90Rel                   float64 // |error| / observed
	meanObserved                     float64
}

func summarise(recs []firstToken) errorStats {
	var s errorStats
	if len(recs) == 0 {
		return s
	}
	abs := make([]float64, len(recs))
	rel := make([]float64, len(recs))
	for i, r := range recs {
		e := r.observed - r.predicted
		s.meanErr += e
		abs[i] = math.Abs(e)
		s.meanAbs += abs[i]
		rel[i] = abs[i] / max(r.observed, 1e-3)
		s.meanObserved += r.observed
	}
	n := float64(len(recs))
	s.n, s.meanErr, s.meanAbs, s.meanObserved = len(recs), s.meanErr/n, s.meanAbs/n, s.meanObserved/n
	slices.Sort(abs)
	slices.Sort(rel)
	q := func(x []float64, p float64) float64 { return x[min(int(p*float64(len(x))), len(x)-1)] }
	s.p50Abs, s.p90Abs, s.p50Rel, s.p90Rel = q(abs, 0.5), q(abs, 0.9), q(rel, 0.5), q(rel, 0.9)
	return s
}

func (s errorStats) String() string {
	return fmt.Sprintf("%d requests, observed TTFT mean %.1f ms; error (observed - predicted) mean %+.1f ms, |error| mean %.1f / p50 %.1f / p90 %.1f ms, relative |error| p50 %.0f%% / p90 %.0f%%",
		s.n, s.meanObserved, s.meanErr, s.meanAbs, s.p50Abs, s.p90Abs, 100*s.p50Rel, 100*s.p90Rel)
}

// TestRealVLLMTTFTPrediction holds the predicted-ttft profile's model to
// real vLLM (the CPU build, two servers, the tiny generated model): a
// streamed shared-prefix chat workload through the picker, each request's
// prediction at its pick compared with the TTFT the picker then saw. It
// asserts that every server's first tokens were seen and compared and
// that the predictions are loosely right (bias within 60 % of the mean
// observed TTFT, median relative error at most 150 %), and reports the
// error (the second half of the run, once the model has learned the
// servers, separately). SWITCHYARD_QUALITY=1 runs longer.
func TestRealVLLMTTFTPrediction(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	servers := realvllm.StartFleet(t, py, m, realvllm.Options{Name: modelName}, realvllm.Options{Name: modelName})
	var addrs []string
	for _, s := range servers {
		addrs = append(addrs, s.Addr)
	}
	rec := &firstTokens{}
	f := startPickers(t, addrs, 50*time.Millisecond, 1, false, false, slog.New(rec))
	f.use("predicted-ttft")

	secs, rate := 30.0, 2.0
	if os.Getenv("SWITCHYARD_QUALITY") != "" {
		secs, rate = envFloat("SWITCHYARD_QUALITY_SECONDS", 120), envFloat("SWITCHYARD_QUALITY_VLLM_RATE", 3)
	}
	// Six ~300-word system prompts (about 1,000 tokens with the tiny
	// model's tokenizer), four users each, short answers.
	w := load.Workload{Kind: load.WorkloadSharedPrefix, Groups: 6, UsersPerGroup: 4, SystemLen: 300, QuestionLen: 30, Output: load.Fixed(16)}
	half := time.Duration(secs / 2 * float64(time.Second))
	reps := f.runStages("predicted-ttft", w, load.ArrivalPoisson, []load.Stage{{Rate: rate, Duration: half}, {Rate: rate, Duration: half}}, 42)
	all := rec.all()
	var completed int64
	for _, r := range reps {
		completed += r.Completed
		if r.Failed > 0 {
			t.Errorf("%d requests failed", r.Failed)
		}
	}
	if completed == 0 || int64(len(all)) < completed*8/10 {
		t.Fatalf("%d first tokens compared for %d completed requests", len(all), completed)
	}
	for _, a := range addrs {
		if !slices.ContainsFunc(all, func(r firstToken) bool { return r.endpoint == a }) {
			t.Errorf("no first token compared on %s", a)
		}
	}
	late := all[len(all)/2:]
	t.Logf("real vLLM, 2 servers, %.1f req/s for %.0f s (TTFT p50 %.0f ms, p90 %.0f ms in the second half)", rate, secs, reps[1].TTFT.P50Ms, reps[1].TTFT.P90Ms)
	sum := summarise(all)
	t.Logf("all:         %s", sum)
	t.Logf("second half: %s", summarise(late))
	// Loose: CPU vLLM on a shared 2-core machine is noisy (|error| p50
	// 55 % and bias +36 ms on a 133 ms mean in the run README reports),
	// but a model that is off by its units or its sign fails this.
	if math.Abs(sum.meanErr) > 0.6*sum.meanObserved || sum.p50Rel > 1.5 {
		t.Errorf("predictions too far from observed TTFT: bias %+.1f ms on a %.1f ms mean (want within 60 %%), relative |error| p50 %.0f%% (want <= 150 %%)",
			sum.meanErr, sum.meanObserved, 100*sum.p50Rel)
	}
	for _, e := range f.srvs[0].Stats().Endpoints {
		t.Logf("%s learned: base %v, prefill %v per 1k tokens (%.0f observations); page: prefill %.1f µs/token, server TTFT %.1f ms",
			e.Address, e.TTFT.Base.Round(time.Microsecond*100), e.TTFT.PerToken.Round(time.Microsecond*100), e.TTFT.Observed,
			1e6*e.Metrics.Perf.PrefillPerToken, 1e3*e.Metrics.Perf.TTFT)
	}
}
