package translator

import (
	"fmt"
	"testing"

	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

// BenchmarkBuildAndTranslate measures one full translation of a large
// fleet: 50 pools of 64 endpoints behind 2 listeners.
func BenchmarkBuildAndTranslate(b *testing.B) {
	s := registry.Empty()
	s.Version = 1
	s.Listeners = []registry.Listener{{Name: "a", Address: "0.0.0.0:8080"}, {Name: "b", Address: "0.0.0.0:8081"}}
	for p := 0; p < 50; p++ {
		pool := &registry.Pool{Name: fmt.Sprintf("pool-%02d", p), FailureMode: registry.FailClosed}
		for e := 0; e < 64; e++ {
			pool.Endpoints = append(pool.Endpoints, registry.Endpoint{Address: fmt.Sprintf("10.%d.%d.1:8000", p, e)})
		}
		s.Pools[pool.Name] = pool
	}
	b.ReportAllocs()
	for b.Loop() {
		cfg, err := ir.Build(s, ir.Options{})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := Translate(cfg); err != nil {
			b.Fatal(err)
		}
	}
}
