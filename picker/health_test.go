package picker

import (
	"testing"

	"github.com/switchyard/switchyard/picker/metrics"
)

func TestEndpointHealthUnknownIsNotHealthy(t *testing.T) {
	h := newEndpointHealth()
	h.setTargets([]metrics.Target{{Pool: "p", Address: "10.0.0.1:8000"}, {Pool: "p", Address: "10.0.0.2:8000"}})
	a := metrics.Key{Pool: "p", Address: "10.0.0.1:8000"}
	b := metrics.Key{Pool: "p", Address: "10.0.0.2:8000"}

	// a fails before b was ever scraped: b is unknown, so a stays in EDS.
	h.set(a, true)
	if h.Unhealthy("p", a.Address) {
		t.Fatal("a withheld while its only peer is unscraped")
	}
	// b fails too: the whole pool fails, nothing is withheld.
	h.set(b, true)
	if got := h.UnhealthyEndpoints(); len(got) != 0 {
		t.Fatalf("whole pool failing, withheld %v", got)
	}
	// b answers: now a is withheld.
	ch := h.Changed()
	h.set(b, false)
	select {
	case <-ch:
	default:
		t.Fatal("recovery did not wake watchers")
	}
	if !h.Unhealthy("p", a.Address) || h.Unhealthy("p", b.Address) {
		t.Fatalf("after b recovered: unhealthy %v", h.UnhealthyEndpoints())
	}
	// A repeated report is not a change.
	ch = h.Changed()
	h.set(b, false)
	select {
	case <-ch:
		t.Fatal("a repeated report woke watchers")
	default:
	}
	// b leaves the target set: a has no answering peer left.
	h.setTargets([]metrics.Target{{Pool: "p", Address: a.Address}})
	if h.Unhealthy("p", a.Address) {
		t.Fatal("a withheld after its only answering peer left")
	}
}
