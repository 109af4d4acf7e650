package realvllm

import (
	"os"
	"testing"
)

// The counters the real-vLLM tests assert on, read from a page a real
// vLLM 0.32 server produced after eight requests.
func TestParseCountersRecordedPage(t *testing.T) {
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	c := ParseCounters(string(page))
	if c.PrefixQueries <= 0 || c.PrefixHits < 0 || c.PrefixHits > c.PrefixQueries {
		t.Fatalf("prefix queries %v hits %v: want queries > 0 and 0 <= hits <= queries", c.PrefixQueries, c.PrefixHits)
	}
	// Five probes ran to completion (two plain, two streamed, one adapter);
	// the unknown model and the over-long prompt never reached the engine.
	if c.Requests != 5 {
		t.Fatalf("request_success_total sums to %v, want 5", c.Requests)
	}
	d := c.Sub(Counters{PrefixQueries: 1, PrefixHits: 0, Requests: 2})
	if d.Requests != 3 || d.PrefixQueries != c.PrefixQueries-1 {
		t.Fatalf("Sub: %+v", d)
	}
}
