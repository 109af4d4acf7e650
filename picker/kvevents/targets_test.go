package kvevents

import (
	"reflect"
	"testing"

	"github.com/switchyard/switchyard/registry"
)

func TestTargetsFromState(t *testing.T) {
	st := registry.Empty()
	st.Pools["chat"] = &registry.Pool{Name: "chat", Engine: registry.EngineVLLM,
		KVEvents: &registry.KVEvents{Port: 5557, ReplayPort: 5558, Topic: "kv@"},
		Endpoints: []registry.Endpoint{
			{Address: "10.0.0.1:8000"},
			{Address: "[fd00::2]:8000", KVEvents: &registry.KVEvents{Port: 6000}},
			{Address: "10.0.0.3:8000", Draining: true},
		}}
	st.Pools["plain"] = &registry.Pool{Name: "plain", Engine: registry.EngineVLLM, Endpoints: []registry.Endpoint{
		{Address: "10.0.1.1:8000"},
		{Address: "10.0.1.2:8000", KVEvents: &registry.KVEvents{Port: 7000}},
	}}
	want := []Target{
		{Pool: "chat", Address: "10.0.0.1:8000", Endpoint: "tcp://10.0.0.1:5557", Replay: "tcp://10.0.0.1:5558", Topic: "kv@"},
		{Pool: "chat", Address: "[fd00::2]:8000", Endpoint: "tcp://[fd00::2]:6000"},
		{Pool: "plain", Address: "10.0.1.2:8000", Endpoint: "tcp://10.0.1.2:7000"},
	}
	if got := TargetsFromState(st); !reflect.DeepEqual(got, want) {
		t.Fatalf("targets\n got %+v\nwant %+v", got, want)
	}
	if TargetsFromState(nil) != nil {
		t.Fatal("nil state has targets")
	}
}
