package picker

import (
	"strings"
	"testing"

	"github.com/switchyard/switchyard/registry"
)

// TestSessionAffinity keeps a session on its endpoint while it has
// requests in flight (least-request alone would spread them), with the
// default header and a pool-configured one.
func TestSessionAffinity(t *testing.T) {
	for _, tc := range []struct{ desc, header string }{
		{"default header", ""},
		{"configured header", "x-conversation"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			st := testState()
			st.Pools["alpha"].Scheduling = &registry.Scheduling{SessionHeader: tc.header}
			h := newHarness(t, st, Options{})
			name := tc.header
			if name == "" {
				name = "x-session-id"
			}
			var first string
			for i := range 3 {
				s := h.duplex()
				s.send(postHeaders("/v1/completions", name, "conv-1"))
				s.send(reqBody([]byte(`{"model":"llama","prompt":"p"}`), true))
				d := decisionOf(t, s.recv())
				s.readStreamedRequestBody() // stays in flight
				primary, _, _ := strings.Cut(d.dest, ",")
				if i == 0 {
					first = primary
				} else if primary != first {
					t.Fatalf("request %d of the session went to %s, first to %s", i, primary, first)
				}
			}
			// Another session avoids the busy endpoint.
			_, d := openAndPick(t, h, "llama")
			if d[0] == first {
				t.Errorf("sessionless request went to the busy endpoint %s", first)
			}
		})
	}
}
