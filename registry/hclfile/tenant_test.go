package hclfile

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

const tenantBase = tlsListener + `
pool "p" {
  endpoints = ["127.0.0.1:8001"]
}
model "m" { pool = "p" }
model "n" { pool = "p" }
`

func TestTenantBlocks(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "team-a.keys")
	if err := os.WriteFile(keyFile, []byte("# revoked keys are deleted from here\n"+apikey.Hash("k2")+"\n\n"+apikey.Hash("k1")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	upFile := filepath.Join(dir, "vllm.key")
	if err := os.WriteFile(upFile, []byte("upstream-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	src := strings.Replace(tenantBase, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  upstream_api_key_file = "`+upFile+`"`, 1) + `
tenants {
  hide_forbidden_models = true
}
tenant "team-a" {
  api_keys     = ["` + strings.ToUpper(apikey.Hash("k1")[7:]) + `"]
  api_key_file = "` + keyFile + `"
  models       = ["m"]
  priority     = 7
  limits {
    requests_per_minute = 600
    tokens_per_minute   = 100000
    tokens_per_day      = 5000000000
    count_cached        = false
    assumed_max_tokens  = 256
  }
}
tenant "team-b" {
  api_keys = ["` + apikey.Hash("k3") + `"]
}
`
	// The upper-case hex without its scheme is not a hash: fix it so the
	// good configuration parses, then check the bad one below.
	src = strings.Replace(src, `["`+strings.ToUpper(apikey.Hash("k1")[7:])+`"]`, `["sha256:`+strings.ToUpper(apikey.Hash("k1")[7:])+`"]`, 1)
	cfg, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	s := cfg.State
	seven := 7
	want := &registry.Tenant{Name: "team-a", KeyHashes: sortedHashes("k1", "k2"), KeyFile: keyFile, Models: []string{"m"}, Priority: &seven,
		Limits: registry.Limits{RequestsPerMinute: 600, TokensPerMinute: 100000, TokensPerDay: 5000000000, AssumedMaxTokens: 256}, DeclRange: s.Tenants["team-a"].DeclRange}
	if got := s.Tenants["team-a"]; !reflect.DeepEqual(got, want) {
		t.Fatalf("team-a = %+v\nwant     %+v", got, want)
	}
	if b := s.Tenants["team-b"]; b == nil || b.Priority != nil || !b.Limits.CountCached || b.Limits.Any() || len(b.KeyHashes) != 1 {
		t.Fatalf("team-b = %+v: want defaults (no priority, count_cached, no limits)", b)
	}
	if !s.TenantSettings.HideForbiddenModels {
		t.Fatal("hide_forbidden_models not set")
	}
	if got := s.Pools["p"].UpstreamAPIKey; got != "upstream-secret" {
		t.Fatalf("upstream key %q", got)
	}
	if !reflect.DeepEqual(cfg.KeyFiles, []string{upFile, keyFile}) {
		t.Fatalf("KeyFiles %q", cfg.KeyFiles)
	}
	if !strings.HasPrefix(s.Tenants["team-a"].DeclRange, "c.hcl:") {
		t.Fatalf("DeclRange %q", s.Tenants["team-a"].DeclRange)
	}
}

func sortedHashes(keys ...string) []string {
	var out []string
	for _, k := range keys {
		out = append(out, apikey.Hash(k))
	}
	if out[0] > out[1] {
		out[0], out[1] = out[1], out[0]
	}
	return out
}

func TestUpstreamKeyFromEnvironment(t *testing.T) {
	t.Setenv("SWITCHYARD_TEST_UPSTREAM_KEY", " from-env ")
	src := strings.Replace(tenantBase, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  upstream_api_key_env = "SWITCHYARD_TEST_UPSTREAM_KEY"`, 1)
	cfg, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatal(FormatDiagnostics(diags))
	}
	if got := cfg.State.Pools["p"].UpstreamAPIKey; got != "from-env" {
		t.Fatalf("upstream key %q", got)
	}
}

func TestTenantErrors(t *testing.T) {
	dir := t.TempDir()
	badFile := filepath.Join(dir, "bad.keys")
	if err := os.WriteFile(badFile, []byte(apikey.Hash("ok")+"\nsy-pasted-a-key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	secretFile := filepath.Join(dir, "two-lines.key")
	if err := os.WriteFile(secretFile, []byte("secret-one\nsecret-two\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h := apikey.Hash("k")
	for _, c := range []struct{ desc, body, want string }{
		{"key instead of hash", `tenant "a" { api_keys = ["sy-abc"] }`, `c.hcl:11:26: error: Invalid API key hash: Not an API key hash: this is a key, not its hash`},
		{"short hash", `tenant "a" { api_keys = ["sha256:abcd"] }`, `c.hcl:11:26: error: Invalid API key hash: Not an API key hash: 4 hex digits`},
		{"missing key file", `tenant "a" { api_key_file = "` + filepath.Join(dir, "nope") + `" }`, `c.hcl:11:29: error: Cannot read api_key_file`},
		{"bad key file line", `tenant "a" { api_key_file = "` + badFile + `" }`, `c.hcl:11:29: error: Invalid API key hash: ` + badFile + `:2: not an API key hash`},
		{"negative limit", "tenant \"a\" {\n  limits {\n    tokens_per_day = -5\n  }\n}", `c.hcl:13:22: error: Invalid tokens_per_day`},
		{"negative assumed_max_tokens", "tenant \"a\" {\n  limits {\n    assumed_max_tokens = -1\n  }\n}", `assumed_max_tokens must be a whole number of 0 (the default, 1024) or more`},
		{"fractional limit", "tenant \"a\" {\n  limits {\n    requests_per_minute = 1.5\n  }\n}", `Invalid requests_per_minute`},
		{"two limits blocks", `tenant "a" {
  limits {}
  limits {}
}`, `c.hcl:13:3: error: Duplicate limits block`},
		{"unknown limit", "tenant \"a\" {\n  limits {\n    tokens_per_hour = 5\n  }\n}", `Unsupported argument`},
		{"same key twice", `tenant "a" { api_keys = ["` + h + `"] }
tenant "b" { api_keys = ["` + h + `"] }`, `c.hcl:12:25: error: Duplicate API key: An API key hash of tenant "b" is also one of tenant "a"'s`},
		{"duplicate tenant", `tenant "a" {}
tenant "a" {}`, `Duplicate tenant`},
		{"unknown model", `tenant "a" { models = ["m", "zzz"] }`, `c.hcl:11:23: error: Unknown model: Model "zzz" is not declared`},
		{"both upstream sources", "", `Conflicting upstream keys`},
		{"missing env", "", `Missing environment variable`},
		{"two-line upstream key", "", `Invalid upstream API key`},
	} {
		t.Run(c.desc, func(t *testing.T) {
			src := tenantBase + "\n" + c.body + "\n"
			switch c.desc {
			case "both upstream sources":
				src = strings.Replace(src, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  upstream_api_key_file = "x"
  upstream_api_key_env = "Y"`, 1)
			case "missing env":
				src = strings.Replace(src, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  upstream_api_key_env = "SWITCHYARD_TEST_SURELY_UNSET"`, 1)
			case "two-line upstream key":
				src = strings.Replace(src, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  upstream_api_key_file = "`+secretFile+`"`, 1)
			}
			_, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
			got := FormatDiagnostics(diags)
			if !diags.HasErrors() || !strings.Contains(got, c.want) {
				t.Fatalf("want %q, got:\n%s", c.want, got)
			}
			if strings.Contains(got, "secret-one") || strings.Contains(got, "sy-pasted-a-key") {
				t.Fatalf("a diagnostic quotes a secret:\n%s", got)
			}
		})
	}
}

func TestTenantWarnings(t *testing.T) {
	t.Parallel()
	src := strings.Replace(tenantBase, `endpoints = ["127.0.0.1:8001"]`, `endpoints = ["127.0.0.1:8001"]
  failure_mode = "fail_open"`, 1) + "tenant \"a\" {}\n"
	_, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() || !strings.Contains(FormatDiagnostics(diags), `c.hcl:7:18: warning: Tenants and fail_open: Pool "p" fails open`) {
		t.Fatalf("want a fail_open warning, got:\n%s", FormatDiagnostics(diags))
	}
	_, diags = Parse([]Input{{Name: "c.hcl", Src: []byte(tenantBase + "tenants {}\n")}}, sched.Rules)
	if diags.HasErrors() || !strings.Contains(FormatDiagnostics(diags), "warning: No tenant") {
		t.Fatalf("want a no-tenant warning, got:\n%s", FormatDiagnostics(diags))
	}
}
