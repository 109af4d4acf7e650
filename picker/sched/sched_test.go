package sched

import (
	"math"
	"testing"
	"time"

	"github.com/switchyard/switchyard/registry"
)

func eps(loads ...[2]int64) []*Endpoint {
	out := make([]*Endpoint, len(loads))
	for i, l := range loads {
		e := &Endpoint{Pool: "p", Address: string(rune('a' + i)), Load: new(Load)}
		e.Load.InFlightRequests.Store(l[0])
		e.Load.InFlightTokens.Store(l[1])
		out[i] = e
	}
	return out
}

func TestLeastInFlightScores(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		desc  string
		loads [][2]int64
		want  []float64
	}{
		{desc: "all idle tie", loads: [][2]int64{{0, 0}, {0, 0}}, want: []float64{1, 1}},
		{desc: "fewest requests best", loads: [][2]int64{{2, 0}, {0, 0}, {1, 0}}, want: []float64{0, 1, 0.5}},
		{desc: "tokens break request ties", loads: [][2]int64{{1, 100}, {1, 10}, {2, 0}}},
		{desc: "tokens never outweigh a request", loads: [][2]int64{{1, 0}, {0, 1 << 40}}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			e := eps(tc.loads...)
			s := make([]float64, len(e))
			leastInFlight{}.Score(&Request{}, e, s)
			for i, v := range s {
				if v < 0 || v > 1 {
					t.Errorf("score %d = %v outside [0,1]", i, v)
				}
				if tc.want != nil && math.Abs(v-tc.want[i]) > 1e-9 {
					t.Errorf("score %d = %v, want %v", i, v, tc.want[i])
				}
			}
			switch tc.desc {
			case "tokens break request ties":
				if !(s[1] > s[0] && s[0] > s[2]) {
					t.Errorf("scores %v: want b > a > c", s)
				}
			case "tokens never outweigh a request":
				if !(s[1] > s[0]) {
					t.Errorf("scores %v: fewer requests must win despite tokens", s)
				}
			}
		})
	}
}

func TestFilters(t *testing.T) {
	t.Parallel()
	e := eps([2]int64{}, [2]int64{}, [2]int64{})
	e[0].Draining = true
	e[1].Models = []string{"m1"}
	e[1].Role = registry.RolePrefill
	e[2].Role = registry.RoleDecode
	for _, tc := range []struct {
		desc string
		f    Filter
		req  Request
		want string
	}{
		{"draining dropped", drainingFilter{}, Request{}, "bc"},
		{"model list honoured", modelFilter{}, Request{Model: "m2", TargetModel: "m2"}, "ac"},
		{"client name matches too", modelFilter{}, Request{Model: "m1", TargetModel: "m1-lora"}, "abc"},
		{"no subset keeps all", subsetFilter{}, Request{}, "abc"},
		{"subset", subsetFilter{}, Request{HasSubset: true, Subset: []string{"c", "zz"}}, "c"},
		{"empty subset keeps none", subsetFilter{}, Request{HasSubset: true}, ""},
		{"role keeps decode and both", RoleFilter{}, Request{}, "ac"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			in := append([]*Endpoint(nil), e...)
			got := ""
			for _, x := range tc.f.Filter(&tc.req, in) {
				got += x.Address
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestMaxScoreOrderAndTies(t *testing.T) {
	t.Parallel()
	e := eps([2]int64{}, [2]int64{}, [2]int64{}, [2]int64{})
	counts := map[string]int{}
	for i := 0; i < 4000; i++ {
		c := append([]*Endpoint(nil), e...)
		scores := []float64{0.2, 0.9, 0.5, 0.9}
		got := maxScore{}.Pick(c, scores, 3, nil)
		if len(got) != 3 || got[2].Address != "c" || got[0] == got[1] {
			t.Fatalf("pick order %v", []string{got[0].Address, got[1].Address, got[2].Address})
		}
		counts[got[0].Address]++
	}
	// b and d tie at the top: each should lead roughly half the time.
	if counts["b"] < 1600 || counts["d"] < 1600 {
		t.Errorf("tie-break not uniform: %v", counts)
	}
}

func TestProfileScheduleAndSaturation(t *testing.T) {
	t.Parallel()
	e := eps([2]int64{3, 0}, [2]int64{1, 0}, [2]int64{2, 0})
	var sc Scratch
	p := DefaultProfile()
	got := p.Schedule(&Request{}, e, 3, &sc)
	if len(got) != 3 || got[0].Address != "b" || got[1].Address != "c" || got[2].Address != "a" {
		t.Errorf("order %v %v %v, want b c a", got[0].Address, got[1].Address, got[2].Address)
	}
	if e[0].Address != "a" {
		t.Error("Schedule must not reorder the caller's pool slice")
	}
	now := time.Now()
	if (inFlightLimit{Max: 1}).Saturated(now, e) != true || (inFlightLimit{Max: 2}).Saturated(now, e) {
		t.Error("saturation: all >= Max saturates, any below does not")
	}
	if (inFlightLimit{Max: 0}).Saturated(now, e) {
		t.Error("Max 0 disables saturation")
	}
}

func BenchmarkSchedule100(b *testing.B) {
	loads := make([][2]int64, 100)
	for i := range loads {
		loads[i] = [2]int64{int64(i % 7), int64(i * 13 % 50)}
	}
	e := eps(loads...)
	p := DefaultProfile()
	var sc Scratch
	req := &Request{Model: "m", TargetModel: "m"}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		p.Schedule(req, e, 3, &sc)
	}
}
