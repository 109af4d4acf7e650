package main

import (
	"time"

	tenantusage "github.com/switchyard/switchyard/internal/usage"
)

// tenantStatus is one tenant in /api/status: its budgets (configured,
// this replica's share, what this replica counts now) and its usage since
// midnight UTC per model. No key material.
type tenantStatus struct {
	Name     string `json:"name"`
	Priority *int   `json:"priority,omitempty"`
	// Limits and Local: requests_per_minute, tokens_per_minute,
	// tokens_per_day (absent: unlimited); count_cached.
	Limits      limitsStatus     `json:"limits"`
	Local       limitsStatus     `json:"local"`
	Replicas    int              `json:"replicas"`
	Used        map[string]int64 `json:"used"`
	UsageToday  []usageStatus    `json:"usage_today"`
	CountCached bool             `json:"count_cached"`
}

type limitsStatus struct {
	RequestsPerMinute int64 `json:"requests_per_minute,omitempty"`
	TokensPerMinute   int64 `json:"tokens_per_minute,omitempty"`
	TokensPerDay      int64 `json:"tokens_per_day,omitempty"`
}

type usageStatus struct {
	Model            string `json:"model"`
	Requests         int64  `json:"requests"`
	Errors           int64  `json:"errors"`
	PromptTokens     int64  `json:"prompt_tokens"`
	CachedTokens     int64  `json:"cached_tokens"`
	CompletionTokens int64  `json:"completion_tokens"`
}

// tenantsStatus lists the tenants for /api/status (nil without tenants).
func (a *app) tenantsStatus(now time.Time) []tenantStatus {
	ts := a.picker.Tenants(now)
	if ts == nil {
		return nil
	}
	today, err := a.usage.Today()
	if err != nil {
		a.log.Warn("usage: today's totals unavailable", "err", err)
	}
	byTenant := map[string][]tenantusage.Total{}
	for _, t := range today {
		byTenant[t.Tenant] = append(byTenant[t.Tenant], t)
	}
	out := make([]tenantStatus, 0, len(ts))
	for _, t := range ts {
		s := tenantStatus{Name: t.Name, Priority: t.Priority, Replicas: t.Replicas, Used: t.Used, CountCached: t.Limits.CountCached,
			Limits:     limitsStatus{t.Limits.RequestsPerMinute, t.Limits.TokensPerMinute, t.Limits.TokensPerDay},
			Local:      limitsStatus{t.Local.RequestsPerMinute, t.Local.TokensPerMinute, t.Local.TokensPerDay},
			UsageToday: []usageStatus{}}
		for _, u := range byTenant[t.Name] {
			s.UsageToday = append(s.UsageToday, usageStatus{Model: u.Model, Requests: u.Requests, Errors: u.Errors,
				PromptTokens: u.PromptTokens, CachedTokens: u.CachedTokens, CompletionTokens: u.CompletionTokens})
		}
		out = append(out, s)
	}
	return out
}
