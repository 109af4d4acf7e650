package registry

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestMerge(t *testing.T) {
	t.Parallel()
	file := Update{
		Source: "file",
		Pools: map[string]*Pool{"llama": {Engine: EngineVLLM, FailureMode: FailClosed, MetricsPath: "/metrics",
			Endpoints: []Endpoint{{Address: "127.0.0.1:8002"}, {Address: "127.0.0.1:8001", Draining: true}}}},
		Models:    map[string]*Model{"m": {Pool: "llama", Targets: []Target{{Name: "x", Weight: 1}}}},
		Listeners: []Listener{{Name: "b", Address: "127.0.0.1:8081"}, {Name: "a", Address: "127.0.0.1:8080"}},
		Routing:   &Routing{DefaultPool: "llama"},
	}
	consul := Update{
		Source: "consul",
		Endpoints: map[string][]Endpoint{
			"llama":   {{Address: "127.0.0.1:8003", Models: []string{"sql-lora"}}, {Address: "127.0.0.1:8001"}},
			"missing": {{Address: "127.0.0.1:9000"}},
		},
	}
	s, warnings, err := Merge([]Update{file, consul})
	if err != nil {
		t.Fatalf("Merge: %v", err)
	}
	want := []Endpoint{
		{Address: "127.0.0.1:8001", Source: "file", Draining: true},
		{Address: "127.0.0.1:8002", Source: "file"},
		{Address: "127.0.0.1:8003", Source: "consul", Models: []string{"sql-lora"}},
	}
	if got := s.Pools["llama"].Endpoints; !reflect.DeepEqual(got, want) {
		t.Errorf("endpoints:\n got %+v\nwant %+v", got, want)
	}
	if s.Pools["llama"].Name != "llama" || s.Models["m"].Name != "m" {
		t.Errorf("names not filled from keys: pool %q model %q", s.Pools["llama"].Name, s.Models["m"].Name)
	}
	if got := []string{s.Listeners[0].Name, s.Listeners[1].Name}; got[0] != "a" || got[1] != "b" {
		t.Errorf("listeners not sorted: %v", got)
	}
	if s.Routing.DefaultPool != "llama" {
		t.Errorf("routing = %+v", s.Routing)
	}
	wantWarn := []string{
		`source "consul": endpoint 127.0.0.1:8001 of pool "llama" dropped: source "file" already supplies it`,
		`source "consul": endpoint 127.0.0.1:9000 dropped: pool "missing" is not declared`,
	}
	if !reflect.DeepEqual(warnings, wantWarn) {
		t.Errorf("warnings:\n got %q\nwant %q", warnings, wantWarn)
	}
	// The merged state must not share mutable memory with the updates.
	s.Models["m"].Targets[0].Weight = 7
	if file.Models["m"].Targets[0].Weight != 1 {
		t.Error("merged model shares its targets with the update")
	}
}

func TestMergeConflicts(t *testing.T) {
	t.Parallel()
	a := Update{Source: "a", Pools: map[string]*Pool{"p": {DeclRange: "a.hcl:1:1"}}, Models: map[string]*Model{"m": {Pool: "p"}},
		Listeners: []Listener{{Name: "l", Address: "127.0.0.1:1"}}, Routing: &Routing{}}
	b := Update{Source: "b", Pools: map[string]*Pool{"p": {DeclRange: "b.hcl:2:1"}}, Models: map[string]*Model{"m": {Pool: "p"}},
		Listeners: []Listener{{Name: "l", Address: "127.0.0.1:2"}}, Routing: &Routing{}}
	_, _, err := Merge([]Update{a, b})
	if !errors.Is(err, ErrDuplicate) {
		t.Fatalf("Merge error = %v, want ErrDuplicate", err)
	}
	got := ValidationErrors(err)
	if len(got) != 4 {
		t.Fatalf("got %d problems, want 4 (pool, model, listener, routing): %v", len(got), err)
	}
	if msg := got[0].Error(); !strings.Contains(msg, `b.hcl:2:1: pool "p": declared by source "a" and again by source "b"`) {
		t.Errorf("pool conflict message = %q", msg)
	}
}

func TestSummary(t *testing.T) {
	t.Parallel()
	if got, want := validState().Summary(), "2 pools, 3 models, 1 listener"; got != want {
		t.Fatalf("Summary = %q, want %q", got, want)
	}
	if got, want := Empty().Summary(), "0 pools, 0 models, 0 listeners"; got != want {
		t.Fatalf("Summary = %q, want %q", got, want)
	}
}
