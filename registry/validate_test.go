package registry

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
)

// validState returns a small valid state tests mutate.
func validState() *State {
	s := Empty()
	s.Pools["llama"] = &Pool{Name: "llama", Engine: EngineVLLM, FailureMode: FailClosed, MetricsPath: "/metrics",
		Endpoints: []Endpoint{{Address: "127.0.0.1:8001"}, {Address: "127.0.0.1:8002"}}}
	s.Pools["qwen"] = &Pool{Name: "qwen", Engine: EngineSGLang, FailureMode: FailOpen, MetricsPath: "/metrics"}
	s.Models["base"] = &Model{Name: "base", Pool: "llama"}
	s.Models["small"] = &Model{Name: "small", Pool: "qwen", Priority: -1}
	s.Models["chat"] = &Model{Name: "chat", Pool: "llama", Targets: []Target{{Name: "base", Weight: 90}, {Name: "v2", Weight: 10}}}
	s.Listeners = []Listener{{Name: "public", Address: "0.0.0.0:8080"}}
	s.Routing.DefaultPool = "llama"
	return s
}

func TestValidateAcceptsValidState(t *testing.T) {
	t.Parallel()
	if err := Validate(validState(), fakeRules); err != nil {
		t.Fatalf("Validate: %v", err)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	type problem struct {
		kind, name, field string
		err               error
	}
	cases := []struct {
		desc   string
		mutate func(s *State)
		want   []problem
	}{
		{"unknown pool", func(s *State) { s.Models["base"].Pool = "nope" }, []problem{{KindModel, "base", "pool", ErrUnknownPool}}},
		{"unknown default pool", func(s *State) { s.Routing.DefaultPool = "nope" }, []problem{{KindRouting, "", "default_pool", ErrUnknownPool}}},
		{"unknown engine", func(s *State) { s.Pools["qwen"].Engine = "tgi" }, []problem{{KindPool, "qwen", "engine", ErrUnknownEngine}}},
		{"unknown failure mode", func(s *State) { s.Pools["qwen"].FailureMode = "open" }, []problem{{KindPool, "qwen", "failure_mode", ErrUnknownFailureMode}}},
		{"relative metrics path", func(s *State) { s.Pools["qwen"].MetricsPath = "metrics" }, []problem{{KindPool, "qwen", "metrics_path", ErrBadMetricsPath}}},
		{"bad endpoint", func(s *State) { s.Pools["llama"].Endpoints[0].Address = "localhost:1" }, []problem{{KindEndpoint, "localhost:1", "address", ErrBadAddress}}},
		{"non-canonical endpoint", func(s *State) { s.Pools["llama"].Endpoints[0].Address = "[::ffff:127.0.0.1]:1" }, []problem{{KindEndpoint, "[::ffff:127.0.0.1]:1", "address", ErrBadAddress}}},
		{"duplicate endpoint", func(s *State) { s.Pools["llama"].Endpoints[1].Address = "127.0.0.1:8001" }, []problem{{KindEndpoint, "127.0.0.1:8001", "", ErrDuplicate}}},
		{"self target", func(s *State) { s.Models["chat"].Targets[1].Name = "chat" }, []problem{{KindModel, "chat", "target.chat", ErrSelfTarget}}},
		{"duplicate target", func(s *State) { s.Models["chat"].Targets[1].Name = "base" }, []problem{{KindModel, "chat", "target.base", ErrDuplicate}}},
		{"negative weight", func(s *State) { s.Models["chat"].Targets[1].Weight = -1 }, []problem{{KindModel, "chat", "target.v2.weight", ErrBadWeights}}},
		{"zero weights", func(s *State) {
			s.Models["chat"].Targets[0].Weight = 0
			s.Models["chat"].Targets[1].Weight = 0
		}, []problem{{KindModel, "chat", "", ErrBadWeights}}},
		{"target model in other pool", func(s *State) { s.Models["chat"].Targets[1].Name = "small" }, []problem{{KindModel, "chat", "target.small", ErrUnknownPool}}},
		{"listener hostname", func(s *State) { s.Listeners[0].Address = "example.com:80" }, []problem{{KindListener, "public", "address", ErrBadAddress}}},
		{"duplicate listener address", func(s *State) {
			s.Listeners = append(s.Listeners, Listener{Name: "second", Address: "0.0.0.0:8080"})
		}, []problem{{KindListener, "second", "address", ErrDuplicate}}},
		{"scheduling", func(s *State) {
			s.Pools["llama"].Scheduling = &Scheduling{Profile: "fast", Picker: "best", QueueThreshold: -1, KVThreshold: 2,
				Scorers: map[string]float64{"queue": -1}, Metrics: map[string]string{"bogus": "x", "waiting": ""}}
		}, []problem{
			{KindPool, "llama", "scheduling.profile", ErrBadScheduling},
			{KindPool, "llama", "scheduling.picker", ErrBadScheduling},
			{KindPool, "llama", "scheduling.queue_threshold", ErrBadScheduling},
			{KindPool, "llama", "scheduling.kv_threshold", ErrBadScheduling},
			{KindPool, "llama", "scheduling.scorers.queue", ErrBadScheduling},
			{KindPool, "llama", "scheduling.metrics.bogus", ErrBadScheduling},
			{KindPool, "llama", "scheduling.metrics.waiting", ErrBadScheduling},
		}},
		{"all problems reported", func(s *State) {
			s.Models["base"].Pool = "nope"
			s.Routing.DefaultPool = "gone"
		}, []problem{{KindModel, "base", "pool", ErrUnknownPool}, {KindRouting, "", "default_pool", ErrUnknownPool}}},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			s := validState()
			tc.mutate(s)
			err := Validate(s, fakeRules)
			var got []problem
			for _, ve := range ValidationErrors(err) {
				got = append(got, problem{ve.Kind, ve.Name, ve.Field, ve.Err})
				if !errors.Is(err, ve.Err) {
					t.Errorf("errors.Is(err, %v) = false", ve.Err)
				}
			}
			str := func(ps []problem) []string {
				var out []string
				for _, p := range ps {
					out = append(out, fmt.Sprintf("%s %q %s: %v", p.kind, p.name, p.field, p.err))
				}
				return out
			}
			if !slices.Equal(str(got), str(tc.want)) {
				t.Fatalf("Validate problems:\n got %q\nwant %q\nerr: %v", str(got), str(tc.want), err)
			}
		})
	}
}

func TestValidationErrorMessage(t *testing.T) {
	t.Parallel()
	s := validState()
	s.Models["base"].Pool = "nope"
	s.Models["base"].DeclRange = "a.hcl:3:1"
	err := Validate(s, fakeRules)
	want := `a.hcl:3:1: model "base" pool: pool "nope" is not defined (defined pools: "llama", "qwen")`
	if err == nil || err.Error() != want {
		t.Fatalf("error = %v\nwant %s", err, want)
	}
}

// fakeRules stands in for the picker's sched.Rules (which imports this
// package): it flags what the "scheduling" case breaks, so the test checks
// how Validate reports rules' problems, not the rules themselves.
func fakeRules(sc *Scheduling) []Problem {
	var out []Problem
	flag := func(bad bool, field string) {
		if bad {
			out = append(out, Problem{Field: field, Msg: field + " is wrong"})
		}
	}
	flag(sc.Profile != "" && sc.Profile != "default", "profile")
	flag(sc.Picker != "" && sc.Picker != "max-score", "picker")
	flag(sc.QueueThreshold < 0, "queue_threshold")
	flag(sc.KVThreshold < 0 || sc.KVThreshold > 1, "kv_threshold")
	for _, k := range slices.Sorted(maps.Keys(sc.Scorers)) {
		flag(sc.Scorers[k] < 0, "scorers."+k)
	}
	for _, k := range slices.Sorted(maps.Keys(sc.Metrics)) {
		flag(k == "bogus" || sc.Metrics[k] == "", "metrics."+k)
	}
	return out
}
