package registry

import (
	"errors"
	"strings"
	"testing"
)

const (
	hashA = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	hashB = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func TestValidateTenants(t *testing.T) {
	t.Parallel()
	prio := 3
	cases := []struct {
		desc   string
		mutate func(s *State)
		field  string
		err    error
	}{
		{"valid", func(s *State) {
			s.Tenants["a"] = &Tenant{Name: "a", KeyHashes: []string{hashA}, Models: []string{"base", "anything-with-default-pool"}, Priority: &prio,
				Limits: Limits{RequestsPerMinute: 10, TokensPerMinute: 1000, TokensPerDay: 1e6}}
			s.Tenants["b"] = &Tenant{Name: "b", KeyHashes: []string{hashB}}
		}, "", nil},
		{"negative limit", func(s *State) {
			s.Tenants["a"] = &Tenant{Name: "a", Limits: Limits{TokensPerDay: -1}}
		}, "limits.tokens_per_day", ErrBadLimit},
		{"shared key", func(s *State) {
			s.Tenants["a"] = &Tenant{Name: "a", KeyHashes: []string{hashA}}
			s.Tenants["b"] = &Tenant{Name: "b", KeyHashes: []string{hashB, hashA}}
		}, "api_keys", ErrDuplicate},
		{"undeclared model without default pool", func(s *State) {
			s.Routing.DefaultPool = ""
			s.Tenants["a"] = &Tenant{Name: "a", Models: []string{"base", "nope"}}
		}, "models", ErrUnknownModel},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			s := validState()
			s.Tenants = map[string]*Tenant{}
			tc.mutate(s)
			err := Validate(s, nil)
			if tc.err == nil {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			ves := ValidationErrors(err)
			if len(ves) != 1 || ves[0].Kind != KindTenant || ves[0].Field != tc.field || !errors.Is(ves[0], tc.err) {
				t.Fatalf("Validate = %v, want one tenant %s problem wrapping %v", err, tc.field, tc.err)
			}
		})
	}
}

func TestMergeTenants(t *testing.T) {
	t.Parallel()
	prio := 5
	a := Update{Source: "file", Tenants: map[string]*Tenant{"a": {KeyHashes: []string{hashA}, Priority: &prio}},
		TenantSettings: &TenantSettings{HideForbiddenModels: true}}
	s, _, err := Merge([]Update{a})
	if err != nil {
		t.Fatal(err)
	}
	got := s.Tenants["a"]
	if got == nil || got.Name != "a" || *got.Priority != 5 || !s.TenantSettings.HideForbiddenModels {
		t.Fatalf("merged %+v %+v", got, s.TenantSettings)
	}
	// The merged state shares no memory with the update.
	prio = 9
	a.Tenants["a"].KeyHashes[0] = hashB
	if *got.Priority != 5 || got.KeyHashes[0] != hashA {
		t.Fatal("merged tenant aliases the update")
	}
	b := Update{Source: "other", Tenants: map[string]*Tenant{"a": {}}, TenantSettings: &TenantSettings{}}
	_, _, err = Merge([]Update{a, b})
	if err == nil || !errors.Is(err, ErrDuplicate) || !strings.Contains(err.Error(), `tenant "a"`) || !strings.Contains(err.Error(), "tenants") {
		t.Fatalf("Merge of a tenant and a tenants block from two sources: %v", err)
	}
}

func TestWithConfigOnly(t *testing.T) {
	t.Parallel()
	persisted := validState()
	persisted.Pools["llama"].UpstreamAPIKey = "stale"
	cfg := validState()
	cfg.Tenants = map[string]*Tenant{"a": {Name: "a", KeyHashes: []string{hashA}}}
	cfg.TenantSettings.HideForbiddenModels = true
	cfg.Pools["qwen"].UpstreamAPIKey = "secret"
	got := persisted.WithConfigOnly(cfg)
	if got.Tenants["a"] == nil || !got.TenantSettings.HideForbiddenModels {
		t.Fatalf("tenants not carried: %+v", got)
	}
	if got.Pools["qwen"].UpstreamAPIKey != "secret" || got.Pools["llama"].UpstreamAPIKey != "" {
		t.Fatalf("upstream keys: llama %q qwen %q", got.Pools["llama"].UpstreamAPIKey, got.Pools["qwen"].UpstreamAPIKey)
	}
	if persisted.Pools["llama"].UpstreamAPIKey != "stale" || persisted.Tenants != nil {
		t.Fatal("WithConfigOnly modified its receiver")
	}
	if len(got.Pools["llama"].Endpoints) != 2 {
		t.Fatal("endpoints lost")
	}
}
