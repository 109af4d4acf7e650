package picker

import (
	"context"
	"slices"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/picker/tracing"
	"github.com/switchyard/switchyard/registry"
)

// decisionServer is BenchmarkScheduleDecision's picker (100 endpoints
// with fresh metrics, an idle admission queue) with opts.
func decisionServer(b *testing.B, opts Options) *Server {
	opts.DisableMetrics = true
	srv := New(registry.NewPublisher(benchState(100)), opts, nil)
	far := time.Now().Add(time.Hour)
	i := 0
	snap := buildSnapshot(benchState(100), &srv.loads, buildDeps{handle: func(metrics.Key) sched.MetricsSource {
		i++
		return freshSource{&metrics.Snapshot{Values: metrics.Values{Waiting: i % 4, Running: 10 + i%7, KVUsage: float64(i%10) / 10,
			BlockSize: 16, NumBlocks: 26000}, LastSuccess: far, MaxAge: 2 * time.Hour}}
	}})
	srv.buildChains(snap)
	srv.snap.Store(snap)
	ctx, cancel := context.WithCancel(context.Background())
	srv.runCtx = ctx
	srv.syncQueues(benchState(100), snap, nil)
	b.Cleanup(func() { cancel(); srv.queues.Wait() })
	return srv
}

// BenchmarkDecisionOverhead measures what issue 15 adds to a decision:
// BenchmarkScheduleDecision's decision (100 endpoints, 8k-token prompts,
// default profile) with the request's notes opened when its headers
// arrive and closed when its stream ends, on four pickers that differ only
// in what is on: nothing (baseline: the latency clock), tracing at 100 %
// sampling (spans batched to an exporter that drops them, so the export's
// network cost is left out), decision records of every request, and both.
// Decisions alternate between the four pickers, so a busy moment of the
// machine slows all four alike; it reports each one's p50 and the added
// p50 against the baseline. Run:
//
//	go test -run '^$' -bench DecisionOverhead -benchtime 40000x -count 5 ./picker/
func BenchmarkDecisionOverhead(b *testing.B) {
	tr := tracing.NewWithExporter(tracing.Config{SampleRatio: 1}, tracetest.NewNoopExporter())
	b.Cleanup(func() { _ = tr.Shutdown(context.Background()) })
	cases := []struct {
		name string
		srv  *Server
	}{
		{"baseline", decisionServer(b, Options{})},
		{"traced", decisionServer(b, Options{Tracer: tr})},
		{"recorded", decisionServer(b, Options{Decisions: decisions.New(decisions.Options{})})},
		{"both", decisionServer(b, Options{Tracer: tr, Decisions: decisions.New(decisions.Options{})})},
	}
	bodies := benchBodies()
	decide := func(srv *Server, body []byte) {
		st := srv.newStream(context.Background())
		st.path, st.method, st.body = []byte("/v1/chat/completions"), []byte("POST"), body
		st.begin()
		if rep := st.pick(); rep.code != 0 {
			b.Fatalf("%d %s", rep.code, rep.msg)
		}
		st.release()
		st.finish()
		srv.freeStream(st)
	}
	for _, c := range cases {
		for _, body := range bodies {
			decide(c.srv, body)
		}
	}
	durs := make([][]time.Duration, len(cases))
	b.ReportAllocs()
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		k := n % len(cases)
		t0 := time.Now()
		decide(cases[k].srv, bodies[(n/len(cases))%len(bodies)])
		durs[k] = append(durs[k], time.Since(t0))
	}
	b.StopTimer()
	if b.N < len(cases) {
		return
	}
	p50 := make([]float64, len(cases))
	for k, d := range durs {
		slices.Sort(d)
		p50[k] = float64(d[len(d)/2].Nanoseconds())
		b.ReportMetric(p50[k], cases[k].name+"-p50-ns")
	}
	for k := 1; k < len(cases); k++ {
		b.ReportMetric(p50[k]-p50[0], cases[k].name+"-added-p50-ns")
	}
}

// BenchmarkRecordDecision measures a decision record alone: copying a
// 100-candidate, 6-scorer breakdown into a record, completing it and
// adding it to the ring. Run:
//
//	go test -run '^$' -bench RecordDecision -benchmem ./picker/
func BenchmarkRecordDecision(b *testing.B) {
	benchNotePick(b, decisionServer(b, Options{Decisions: decisions.New(decisions.Options{})}))
}

// benchNotePick schedules one request on srv's 100-endpoint pool "big"
// and measures noting that pick on a fresh stream, as a request's
// decision record and span see it, and finishing the stream.
func benchNotePick(b *testing.B, srv *Server) {
	pv := srv.snap.Load().pools["big"]
	sc := new(sched.Scratch)
	req := &sched.Request{Model: "llama", TargetModel: "llama", Record: true, Now: time.Now()}
	pv.profile.Schedule(req, pv.eps, 3, sc)
	if bd := sc.Breakdown(); len(bd.Candidates) != 100 || len(bd.Scorers) < 5 {
		b.Fatalf("breakdown of %d candidates, %d scorers", len(bd.Candidates), len(bd.Scorers))
	}
	dest := []byte("10.1.0.1:8000,10.1.0.2:8000,10.1.0.3:8000")
	b.ReportAllocs()
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		st := srv.newStream(context.Background())
		st.begin()
		st.clientModel = "llama"
		st.outcome = pickOutcome{pool: pv, target: "llama", req: req, sc: sc, dest: dest}
		st.noteDecided(&st.outcome)
		st.finish()
		srv.freeStream(st)
	}
}

// BenchmarkTraceDecision measures a traced request's span alone at 100 %
// sampling: start, the breakdown's events and attributes for a
// 100-candidate decision, end, batched to an exporter that drops it. Run:
//
//	go test -run '^$' -bench TraceDecision -benchmem ./picker/
func BenchmarkTraceDecision(b *testing.B) {
	tr := tracing.NewWithExporter(tracing.Config{SampleRatio: 1}, tracetest.NewNoopExporter())
	b.Cleanup(func() { _ = tr.Shutdown(context.Background()) })
	benchNotePick(b, decisionServer(b, Options{Tracer: tr}))
}
