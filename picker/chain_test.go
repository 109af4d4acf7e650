package picker

import (
	"slices"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/registry"
)

// A capability is one stage, in the chain by one entry of stages():
// decision records built out of the chains (the entry deleted) leave a
// picker whose Options ask for records routing as before (the pick, the
// served endpoint, the release) and recording nothing, while the same
// picker with every stage records the request.
func TestChainWithoutDecisionRecords(t *testing.T) {
	for _, withRecords := range []bool{true, false} {
		rec := decisions.New(decisions.Options{})
		pub := registry.NewPublisher(testState())
		srv := New(pub, Options{Decisions: rec, DisableMetrics: true}, nil)
		if !withRecords {
			srv.stages = slices.DeleteFunc(stages(), func(d stageDef) bool { return d.name == "decisions" })
		}
		h := serveHarness(t, srv, pub)
		inChain := false
		for _, pv := range srv.snap.Load().pools {
			for _, st := range pv.chain.done {
				if _, ok := st.(*recordStage); ok {
					inChain = true
				}
			}
		}
		if inChain != withRecords {
			t.Fatalf("records stage in the chain: %v, want %v", inChain, withRecords)
		}

		// streamedExchange ends the stream: its notes are closed when it
		// returns.
		dest := streamedExchange(t, h, nil, "chat", "10.0.0.2:8000", 0)
		parts := strings.Split(dest, ",")
		if len(parts) != 3 || !alpha[parts[0]] {
			t.Fatalf("destination %q: want 3 endpoints of pool alpha", dest)
		}
		h.waitInFlight(0)
		st := h.srv.Stats()
		if st.Requests != 1 || st.Picked != 1 || st.Rewritten != 1 {
			t.Errorf("stats %+v: want one request picked and rewritten", st)
		}
		served := false
		for _, e := range st.Endpoints {
			served = served || e.Address == "10.0.0.2:8000" && e.Served == 1
		}
		if !served {
			t.Errorf("served endpoint not counted: %+v", st.Endpoints)
		}
		got := rec.Stats().Recorded
		if withRecords {
			if r := latestRecord(t, rec); r.Picked != parts[0] || r.Served != "10.0.0.2:8000" {
				t.Errorf("record: picked %q served %q, destination %q", r.Picked, r.Served, dest)
			}
		} else if got != 0 {
			t.Errorf("%d records without the records stage", got)
		}
	}
}
