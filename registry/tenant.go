package registry

import "slices"

// Tenant is a client of the gateway (a team, an application): the API
// keys it authenticates with, the models it may use, its default
// admission priority and its limits. When a State has any tenant, every
// request must carry one of their keys; without tenants nothing is
// authenticated. Tenants come from configuration files only.
type Tenant struct {
	Name string
	// KeyHashes are the hashes of the tenant's API keys in canonical
	// form ("sha256:<64 lower-case hex>", internal/apikey), sorted: those
	// written in the configuration and those read from KeyFile. The keys
	// themselves are never configured.
	KeyHashes []string
	// KeyFile is the file the tenant's api_key_file names ("" none); its
	// hashes are in KeyHashes, read again on every configuration load.
	KeyFile string
	// Models are the client-visible model names the tenant may request;
	// empty means every model.
	Models []string
	// Priority, when set, is the default priority of the tenant's
	// requests in the admission queue.
	Priority *int
	// Limits are the tenant's budgets (zero: unlimited).
	Limits Limits
	// DeclRange is where the tenant was declared ("file:line:column").
	DeclRange string
}

// Limits are a tenant's budgets over sliding windows; 0 means unlimited.
// Tokens are prompt plus completion tokens as the responses' usage reports
// them, cached prompt tokens included only with CountCached.
type Limits struct {
	RequestsPerMinute int64
	TokensPerMinute   int64
	TokensPerDay      int64
	// CountCached counts prompt tokens the server served from its prefix
	// cache toward the token limits.
	CountCached bool
	// AssumedMaxTokens is the output a request that sets no max_tokens
	// (max_completion_tokens, max_output_tokens) is assumed to generate
	// when its tokens are reserved at admission; 0 means
	// DefaultAssumedMaxTokens.
	AssumedMaxTokens int64
}

// DefaultAssumedMaxTokens is Limits.AssumedMaxTokens when unset.
const DefaultAssumedMaxTokens = 1024

// Any reports whether any budget is set.
func (l Limits) Any() bool {
	return l.RequestsPerMinute > 0 || l.TokensPerMinute > 0 || l.TokensPerDay > 0
}

// TenantSettings is the configuration's tenants block: how tenants are
// treated as a whole.
type TenantSettings struct {
	// HideForbiddenModels answers a request for a model the tenant may not
	// use with 404 (as if the model did not exist) instead of 403.
	HideForbiddenModels bool
	// DeclRange is where the block was declared ("file:line:column").
	DeclRange string
}

// TenantNames returns the tenant names in sorted order.
func (s *State) TenantNames() []string { return sortedKeys(s.Tenants) }

// cloneTenant returns a deep copy of t.
func cloneTenant(t *Tenant) *Tenant {
	cp := *t
	cp.KeyHashes = slices.Clone(t.KeyHashes)
	cp.Models = slices.Clone(t.Models)
	if t.Priority != nil {
		p := *t.Priority
		cp.Priority = &p
	}
	return &cp
}

// validateTenants checks tenants: names, limits, key hashes unique across
// tenants (one key, one tenant), and models that can be requested.
func validateTenants(s *State, add func(kind, name, field, where string, sentinel error, format string, args ...any)) {
	owner := map[string]string{}
	for _, name := range s.TenantNames() {
		t := s.Tenants[name]
		if name == "" || t.Name != name {
			add(KindTenant, name, "", t.DeclRange, ErrEmptyName, "tenant name %q does not match its key %q", t.Name, name)
		}
		for field, v := range map[string]int64{
			"limits.requests_per_minute": t.Limits.RequestsPerMinute,
			"limits.tokens_per_minute":   t.Limits.TokensPerMinute,
			"limits.tokens_per_day":      t.Limits.TokensPerDay,
			"limits.assumed_max_tokens":  t.Limits.AssumedMaxTokens,
		} {
			if v < 0 {
				add(KindTenant, name, field, t.DeclRange, ErrBadLimit, "%s is %d; want 0 or more", field[len("limits."):], v)
			}
		}
		for _, h := range t.KeyHashes {
			if other, dup := owner[h]; dup && other != name {
				add(KindTenant, name, "api_keys", t.DeclRange, ErrDuplicate,
					"an API key hash of tenant %q is also one of tenant %q's; each key must belong to one tenant", name, other)
				continue
			}
			owner[h] = name
		}
		for _, m := range t.Models {
			if _, ok := s.Models[m]; !ok && s.Routing.DefaultPool == "" {
				add(KindTenant, name, "models", t.DeclRange, ErrUnknownModel,
					"model %q is not declared and there is no routing.default_pool, so no request could use it", m)
			}
		}
	}
}

// WithConfigOnly returns a copy of s carrying what only the configuration
// files hold and the store does not persist, taken from cfg: the tenants,
// the tenants block and the pools' upstream API keys (secrets never
// written to disk). serve applies it to the persisted state it starts
// from, so that no request is served without authentication, or sent
// upstream without its key, before the configuration source answers.
func (s *State) WithConfigOnly(cfg *State) *State {
	cp := *s
	cp.Tenants = nil
	for name, t := range cfg.Tenants {
		if cp.Tenants == nil {
			cp.Tenants = map[string]*Tenant{}
		}
		cp.Tenants[name] = cloneTenant(t)
	}
	cp.TenantSettings = cfg.TenantSettings
	cp.Pools = make(map[string]*Pool, len(s.Pools))
	for name, p := range s.Pools {
		pc := *p
		pc.UpstreamAPIKey = ""
		if c, ok := cfg.Pools[name]; ok {
			pc.UpstreamAPIKey = c.UpstreamAPIKey
		}
		cp.Pools[name] = &pc
	}
	return &cp
}
