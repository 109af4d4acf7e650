package status

import (
	tenantusage "github.com/switchyard/switchyard/internal/usage"
	"github.com/switchyard/switchyard/picker"
)

// Tenant is one tenant in /api/status: its budgets (configured,
// this replica's share, what this replica counts now) and its usage since
// midnight UTC per model. No key material.
type Tenant struct {
	Name     string `json:"name"`
	Priority *int   `json:"priority,omitempty"`
	// Limits and Local: requests_per_minute, tokens_per_minute,
	// tokens_per_day (absent: unlimited); count_cached.
	Limits      Limits           `json:"limits"`
	Local       Limits           `json:"local"`
	Replicas    int              `json:"replicas"`
	Used        map[string]int64 `json:"used"`
	UsageToday  []Usage          `json:"usage_today"`
	CountCached bool             `json:"count_cached"`
}

// Limits are a tenant's budgets (absent: unlimited).
type Limits struct {
	RequestsPerMinute int64 `json:"requests_per_minute,omitempty"`
	TokensPerMinute   int64 `json:"tokens_per_minute,omitempty"`
	TokensPerDay      int64 `json:"tokens_per_day,omitempty"`
}

// Usage is a tenant's usage of one model since midnight UTC.
type Usage struct {
	Model            string `json:"model"`
	Requests         int64  `json:"requests"`
	Errors           int64  `json:"errors"`
	PromptTokens     int64  `json:"prompt_tokens"`
	CachedTokens     int64  `json:"cached_tokens"`
	CompletionTokens int64  `json:"completion_tokens"`
}

// tenants lists the tenants (nil without tenants): the picker's budgets
// joined with today's usage from the ledger.
func tenants(ts []picker.TenantStatus, today []tenantusage.Total) []Tenant {
	if ts == nil {
		return nil
	}
	byTenant := map[string][]tenantusage.Total{}
	for _, t := range today {
		byTenant[t.Tenant] = append(byTenant[t.Tenant], t)
	}
	out := make([]Tenant, 0, len(ts))
	for _, t := range ts {
		s := Tenant{Name: t.Name, Priority: t.Priority, Replicas: t.Replicas, Used: t.Used, CountCached: t.Limits.CountCached,
			Limits:     Limits{t.Limits.RequestsPerMinute, t.Limits.TokensPerMinute, t.Limits.TokensPerDay},
			Local:      Limits{t.Local.RequestsPerMinute, t.Local.TokensPerMinute, t.Local.TokensPerDay},
			UsageToday: []Usage{}}
		for _, u := range byTenant[t.Name] {
			s.UsageToday = append(s.UsageToday, Usage{Model: u.Model, Requests: u.Requests, Errors: u.Errors,
				PromptTokens: u.PromptTokens, CachedTokens: u.CachedTokens, CompletionTokens: u.CompletionTokens})
		}
		out = append(out, s)
	}
	return out
}
