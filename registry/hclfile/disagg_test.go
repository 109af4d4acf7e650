package hclfile

import (
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

func TestDisaggregationAndRoles(t *testing.T) {
	src := `
pool "big" {
  endpoint "10.0.0.1:8000" { role = "prefill" }
  endpoint "10.0.0.2:8000" { role = "decode" }
  endpoint "10.0.0.3:8000" { role = "both" }
  endpoint "10.0.0.4:8000" {}
  disaggregation {
    uncached_tokens         = 1024
    min_prompt_tokens       = 2048
    prefill_queue_threshold = 3
  }
}
pool "small" {
  endpoints = ["10.0.1.1:8000"]
}
model "llama-70b" { pool = "big" }
model "llama-70b-short" {
  pool = "big"
  disaggregation { enabled = false }
}
model "llama-8b" { pool = "small" }
`
	cfg, diags := Parse([]Input{{Name: "pd.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics: %s", FormatDiagnostics(diags))
	}
	big := cfg.State.Pools["big"]
	roles := map[string]registry.Role{}
	for _, ep := range big.Endpoints {
		roles[ep.Address] = ep.Role
	}
	want := map[string]registry.Role{"10.0.0.1:8000": registry.RolePrefill, "10.0.0.2:8000": registry.RoleDecode,
		"10.0.0.3:8000": registry.RoleBoth, "10.0.0.4:8000": registry.RoleBoth}
	for a, r := range want {
		if roles[a] != r {
			t.Errorf("%s: role %q, want %q", a, roles[a], r)
		}
	}
	g := big.Disaggregation
	if g == nil || g.Disabled || g.UncachedTokens != 1024 || g.MinPromptTokens != 2048 || g.PrefillQueueThreshold != 3 || g.DeclRange != "pd.hcl:7:3" {
		t.Fatalf("pool disaggregation %+v", g)
	}
	if d := registry.DisaggregationFor(big, cfg.State.Models["llama-70b"]); d != g {
		t.Errorf("llama-70b policy %+v, want the pool's", d)
	}
	if d := registry.DisaggregationFor(big, cfg.State.Models["llama-70b-short"]); d != nil {
		t.Errorf("llama-70b-short policy %+v, want none (disabled for the model)", d)
	}
	if d := registry.DisaggregationFor(cfg.State.Pools["small"], cfg.State.Models["llama-8b"]); d != nil {
		t.Errorf("a pool without a block has policy %+v", d)
	}
	if (&registry.Disaggregation{}).EffectiveUncachedTokens() != registry.DefaultUncachedTokens {
		t.Error("the default threshold is not applied")
	}
}

func TestDisaggregationErrors(t *testing.T) {
	for _, c := range []struct {
		desc, src, want string
	}{
		{"unknown role", `pool "p" {
  endpoint "10.0.0.1:8000" { role = "encode" }
  disaggregation {}
}`, `bad.hcl:2:37: error: Invalid role: "encode" is not a role; write "prefill", "decode", "both"`},
		{"role without a disaggregation block", `pool "p" {
  endpoint "10.0.0.1:8000" { role = "prefill" }
}`, `bad.hcl:2:37: error: Role without disaggregation: Endpoint 10.0.0.1:8000 has role "prefill", but pool "p" has no disaggregation block`},
		{"negative threshold", `pool "p" {
  endpoints = ["10.0.0.1:8000"]
  disaggregation {
    uncached_tokens = -1
  }
}`, `bad.hcl:4:23: error: `},
		{"two blocks", `pool "p" {
  endpoints = ["10.0.0.1:8000"]
  disaggregation {}
  disaggregation {}
}`, `bad.hcl:4:3: error: Duplicate disaggregation block: Pool "p" already has a disaggregation block at bad.hcl:3:3`},
		{"model block on a pool without one", `pool "p" { endpoints = ["10.0.0.1:8000"] }
model "m" {
  pool = "p"
  disaggregation { uncached_tokens = 64 }
}`, `bad.hcl:4:3: error: `},
		{"unknown attribute", `pool "p" {
  endpoints = ["10.0.0.1:8000"]
  disaggregation { threshold = 5 }
}`, `bad.hcl:3:20: error: Unsupported argument`},
	} {
		cfg, diags := Parse([]Input{{Name: "bad.hcl", Src: []byte(c.src)}}, sched.Rules)
		if !diags.HasErrors() {
			t.Errorf("%s: no error", c.desc)
			continue
		}
		var b strings.Builder
		_ = WriteDiagnostics(&b, cfg.Files, diags)
		if !strings.Contains(b.String(), c.want) {
			t.Errorf("%s: got\n%s\nwant it to contain %q", c.desc, b.String(), c.want)
		}
	}
}
