package picker

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/registry"
)

func TestObserveCountsModelsPoolsAndDecisions(t *testing.T) {
	st := testState()
	st.Models["chat"].Targets = []registry.Target{{Name: "llama-3-8b-instruct", Weight: 1}}
	h := newHarness(t, st, Options{})

	// Two completions of one long prompt: the second finds its blocks on
	// the endpoint the first went to.
	long := strings.Repeat("a shared system prompt that fills many blocks ", 40)
	body := []byte(fmt.Sprintf(`{"model":"llama","prompt":%q}`, long))
	for range 2 {
		s := h.duplex()
		s.send(postHeaders("/v1/completions"))
		s.send(reqBody(body, true))
		decisionOf(t, s.recv())
		s.readStreamedRequestBody()
		s.send(respHeaders(false, ":status", "200"))
		s.recv()
		s.send(respBody([]byte("x"), true))
		s.recv()
	}
	h.waitInFlight(0)
	// One rewritten request left in flight, one rejected (no endpoint in
	// the subset).
	held, _ := openAndPick(t, h, "chat")
	defer held.cancel()
	s := h.duplex()
	s.send(withMetadata(postHeaders("/v1/completions"), SubsetNamespace, MetadataSubset, listValue("10.9.9.9:8000")))
	s.send(reqBody([]byte(`{"model":"llama","prompt":"p"}`), true))
	immediateOf(t, s.recv(), 503)

	o := h.srv.Observe(time.Now())
	if o.Decision.Count != 4 {
		t.Errorf("decision histogram counted %d, want 4", o.Decision.Count)
	}
	if last := o.Decision.Cumulative[len(o.Decision.Cumulative)-1]; last > o.Decision.Count || o.Decision.SumSeconds <= 0 {
		t.Errorf("histogram inconsistent: %+v", o.Decision)
	}
	byKey := map[string]ObjectiveStats{}
	for _, os := range o.Objectives {
		byKey[os.Model+"->"+os.Target] = os
	}
	if got := byKey["llama->llama"]; got.Requests != 3 || got.Errors[503] != 1 {
		t.Errorf("llama: %+v, want 3 requests, one 503", got)
	}
	if got := byKey["chat->llama-3-8b-instruct"]; got.Requests != 1 || len(got.Errors) != 0 {
		t.Errorf("chat: %+v, want 1 request", got)
	}
	if o.Running["chat"] != 1 || o.Running["llama"] != 0 {
		t.Errorf("running %v, want chat 1, llama 0", o.Running)
	}
	var alpha PoolStats
	for _, p := range o.Pools {
		if p.Name == "alpha" {
			alpha = p
		}
	}
	if alpha.PromptBlocks == 0 || alpha.MatchedBlocks*2 < alpha.PromptBlocks-alpha.MatchedBlocks {
		t.Errorf("alpha prefix counters %+v: the second request should match the first's blocks", alpha)
	}
	if alpha.PrefixEntries == 0 || alpha.PrefixBytes == 0 || alpha.Saturated {
		t.Errorf("alpha %+v: want a non-empty index and no saturation (no metrics)", alpha)
	}

	held.cancel()
	h.waitInFlight(0)
	if got := h.srv.Observe(time.Now()).Running["chat"]; got != 0 {
		t.Errorf("chat running %d after the stream ended", got)
	}
}
