package sched

import (
	"testing"
)

// A recorded decision keeps every filter's count and every scorer's score
// of every candidate, in the order scored, and the weighted totals agree
// with the scores; a second decision on the same Scratch allocates nothing.
func TestBreakdown(t *testing.T) {
	p, err := BuildProfile(nil, Deps{Sessions: NewSessions(0, 0)})
	if err != nil {
		t.Fatal(err)
	}
	e := mkEps(m{waiting: 3, kv: 0.5}, m{waiting: 0, kv: 0.1}, m{waiting: 1, kv: 0.9})
	e[2].Draining = true
	var sc Scratch
	req := &Request{Model: "m", TargetModel: "m", Now: now, Record: true}
	got := p.Schedule(req, e, 2, &sc)
	if len(got) == 0 || got[0].Address != "b" {
		t.Fatalf("picked %v, want b first", got)
	}
	b := sc.Breakdown()
	if b.Pool != 3 || !b.Ranked {
		t.Fatalf("pool %d ranked %v", b.Pool, b.Ranked)
	}
	if len(b.Filters) == 0 {
		t.Fatal("no filter recorded")
	}
	drained := false
	for _, f := range b.Filters {
		if f.Name == filterNotDraining && f.Left == 2 {
			drained = true
		}
	}
	if !drained {
		t.Errorf("filters %+v: want %s leaving 2", b.Filters, filterNotDraining)
	}
	if len(b.Candidates) != 2 || len(b.Totals) != 2 {
		t.Fatalf("candidates %d totals %d, want 2", len(b.Candidates), len(b.Totals))
	}
	if len(b.Scorers) == 0 || len(b.Scores) != len(b.Scorers) {
		t.Fatalf("%d scorers, %d score rows", len(b.Scorers), len(b.Scores))
	}
	for i := range b.Candidates {
		sum := 0.0
		for j, ws := range b.Scorers {
			s := b.Scores[j][i]
			if s < 0 || s > 1 {
				t.Errorf("%s score of %s = %v, outside [0,1]", ws.Scorer.Name(), b.Candidates[i].Address, s)
			}
			sum += ws.Weight * s
		}
		if d := sum - b.Totals[i]; d > 1e-9 || d < -1e-9 {
			t.Errorf("%s: total %v, scores sum to %v", b.Candidates[i].Address, b.Totals[i], sum)
		}
	}
	allocs := testing.AllocsPerRun(50, func() { p.Schedule(req, e, 2, &sc) })
	if allocs != 0 {
		t.Errorf("a recorded decision on a grown Scratch allocates %v times", allocs)
	}

	// Without Record nothing is kept.
	req.Record = false
	p.Schedule(req, e, 2, &sc)
	if b := sc.Breakdown(); b.Ranked || b.Filters != nil {
		t.Errorf("breakdown without Record: %+v", b)
	}
}
