package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/internal/testutil"
)

// tenantUsed reads a tenant's tokens counted this minute from /api/status.
func (f *fleet) tenantUsed(name string) (int64, error) {
	body, err := httpGetString("http://" + f.admin + "/api/status")
	if err != nil {
		return 0, err
	}
	var s struct {
		Tenants []struct {
			Name string           `json:"name"`
			Used map[string]int64 `json:"used"`
		} `json:"tenants"`
	}
	if err := json.Unmarshal([]byte(body), &s); err != nil {
		return 0, fmt.Errorf("/api/status: %w", err)
	}
	for _, tn := range s.Tenants {
		if tn.Name == name {
			return tn.Used["tokens_per_minute"], nil
		}
	}
	return 0, fmt.Errorf("no tenant %q on /api/status", name)
}

// TestE2ERealVLLMTenantLaxJSON: real vLLM accepts "stream": "true" or 1
// (and streams) and "max_tokens": "250", 250.0 or "2_50"; the picker reads
// them the same way, so a tenant can neither stream without its usage
// being asked for and counted, nor pass a cap the picker does not reserve
// and go over its tokens_per_minute.
func TestE2ERealVLLMTenantLaxJSON(t *testing.T) {
	py := realvllm.Require(t)
	m := realvllm.EnsureModel(t, py)
	servers := realvllm.StartFleet(t, py, m, realvllm.Options{Name: "tiny"})
	const tpm = 300
	key, hash, _ := apikey.New()
	f := newFleet(t, fmt.Sprintf(`
pool "tiny" {
  engine    = "vllm"
  endpoints = [%q]
}
model "tiny" {
  pool = "tiny"
}
tenant "lax" {
  api_keys = [%q]
  limits {
    tokens_per_minute = %d
  }
}
`, servers[0].Addr, hash, tpm), fleetOptions{})
	auth := []string{"authorization", "Bearer " + key}
	prompt := words(77, 30)

	// A stream the engine starts for "stream": "true": the picker asks for
	// its usage (and hides that chunk from the client, who did not ask), so
	// its 20 completion tokens are counted.
	r, err := f.post("/v1/completions", fmt.Sprintf(`{"model":"tiny","prompt":%q,"stream":"true","max_tokens":"20","min_tokens":20,"ignore_eos":true}`, prompt), auth...)
	if err != nil || r.status != 200 {
		t.Fatalf("lax stream: %v %+v", err, r)
	}
	if ct := r.header.Get("content-type"); !strings.HasPrefix(ct, "text/event-stream") || !strings.Contains(r.body, "data: [DONE]") {
		t.Fatalf("\"stream\": \"true\" did not stream (content-type %q): %s", ct, truncate(r.body, 300))
	}
	if strings.Contains(r.body, `"usage":{`) && strings.Contains(r.body, `"choices":[]`) {
		t.Errorf("the client sees the usage chunk it did not ask for: %s", truncate(r.body, 300))
	}
	var counted usageTotal
	testutil.Eventually(t, 10*time.Second, "the stream's usage recorded", func() error {
		u, err := usageTotals(f.admin)
		if err != nil {
			return err
		}
		if counted = u["lax/tiny"]; counted.Requests != 1 {
			return fmt.Errorf("usage %+v", u)
		}
		return nil
	})
	if counted.CompletionTokens != 20 || counted.PromptTokens == 0 {
		t.Fatalf("the lax stream's usage was not counted: %+v, want its 20 completion tokens", counted)
	}
	used, err := f.tenantUsed("lax")
	if err != nil {
		t.Fatal(err)
	}
	if used != counted.PromptTokens+counted.CompletionTokens {
		t.Errorf("tokens_per_minute counts %d, the stream used %d", used, counted.PromptTokens+counted.CompletionTokens)
	}

	// Caps the engine honours, written as it accepts them: each would take
	// the tenant over its budget, so each is refused before it runs.
	for _, c := range []struct{ path, body string }{
		{"/v1/completions", fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":"250","min_tokens":250,"ignore_eos":true}`, prompt)},
		{"/v1/completions", fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":250.0,"min_tokens":250,"ignore_eos":true}`, prompt)},
		{"/v1/completions", fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":" 2_50 ","stream":1,"ignore_eos":true}`, prompt)},
		{"/v1/chat/completions", fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":%q}],"max_completion_tokens":"250","max_tokens":1,"ignore_eos":true}`, prompt)},
	} {
		r, err := f.post(c.path, c.body, auth...)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != 429 || !strings.Contains(r.body, "tokens_per_minute") {
			t.Errorf("%s %s: %d %s; want 429 over tokens_per_minute", c.path, truncate(c.body, 80), r.status, truncate(r.body, 200))
		}
	}
	// A small one still fits, and its tokens are counted too.
	r, err = f.post("/v1/completions", fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":"5","stream":1,"ignore_eos":true}`, prompt), auth...)
	if err != nil || r.status != 200 || !strings.Contains(r.body, "data: [DONE]") {
		t.Fatalf("a request within the budget: %v %+v", err, r)
	}
	testutil.Eventually(t, 10*time.Second, "the second stream's usage recorded", func() error {
		u, err := usageTotals(f.admin)
		if err != nil {
			return err
		}
		if got := u["lax/tiny"]; got.CompletionTokens != 25 {
			return fmt.Errorf("usage %+v, want 25 completion tokens", got)
		}
		return nil
	})
	if used, err := f.tenantUsed("lax"); err != nil || used > tpm {
		t.Fatalf("tokens_per_minute counts %d (err %v), over the budget of %d", used, err, tpm)
	} else {
		t.Logf("tenant used %d of its %d tokens per minute; every lax cap that would exceed it was refused", used, tpm)
	}
}
