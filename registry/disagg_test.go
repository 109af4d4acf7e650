package registry

import (
	"errors"
	"testing"
)

func TestParseRole(t *testing.T) {
	for in, want := range map[string]Role{"": RoleBoth, "both": RoleBoth, " Prefill ": RolePrefill, "decode": RoleDecode, "prefill-decode": RoleBoth} {
		if got, err := ParseRole(in); err != nil || got != want {
			t.Errorf("ParseRole(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := ParseRole("encode"); !errors.Is(err, ErrBadRole) {
		t.Errorf("ParseRole(encode) = %v, want ErrBadRole", err)
	}
	for _, c := range []struct {
		r                 Role
		prefills, decodes bool
	}{{RoleBoth, true, true}, {RolePrefill, true, false}, {RoleDecode, false, true}} {
		if c.r.Prefills() != c.prefills || c.r.Decodes() != c.decodes {
			t.Errorf("%s: Prefills %v Decodes %v", c.r, c.r.Prefills(), c.r.Decodes())
		}
	}
}

func TestValidateDisaggregation(t *testing.T) {
	s := Empty()
	s.Pools["p"] = &Pool{Name: "p", Engine: EngineVLLM, FailureMode: FailClosed, MetricsPath: "/metrics",
		Endpoints:      []Endpoint{{Address: "10.0.0.1:8000", Role: "Prefill"}, {Address: "10.0.0.2:8000", Role: RoleDecode}},
		Disaggregation: &Disaggregation{UncachedTokens: -5}}
	s.Pools["q"] = &Pool{Name: "q", Engine: EngineVLLM, FailureMode: FailClosed, MetricsPath: "/metrics"}
	s.Models["ok"] = &Model{Name: "ok", Pool: "p", Disaggregation: &Disaggregation{Disabled: true}}
	s.Models["orphan"] = &Model{Name: "orphan", Pool: "q", Disaggregation: &Disaggregation{}}
	got := map[string]bool{}
	for _, ve := range ValidationErrors(Validate(s, nil)) {
		got[ve.Kind+" "+ve.Name+" "+ve.Field] = true
	}
	want := []string{"endpoint 10.0.0.1:8000 role", "pool p disaggregation.uncached_tokens", "model orphan disaggregation"}
	if len(got) != len(want) {
		t.Errorf("problems %v, want %v", got, want)
	}
	for _, w := range want {
		if !got[w] {
			t.Errorf("missing problem %q in %v", w, got)
		}
	}
}
