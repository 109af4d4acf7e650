package registry

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// Update is one source's full contribution to the registry. Every Update
// replaces that source's previous one; an Update with nothing in it
// withdraws everything the source contributed. The source must not modify
// an Update after sending it.
type Update struct {
	// Source is the source's name. The Manager overwrites it with the name
	// the source was registered under.
	Source string
	// Pools are the pools this source declares, keyed by name.
	Pools map[string]*Pool
	// Endpoints adds endpoints to pools declared by any source, keyed by
	// pool name (for example Consul registrations joining an HCL pool).
	// Endpoints for a pool no source declares are dropped with a warning.
	Endpoints map[string][]Endpoint
	// Models are the models this source declares, keyed by name.
	Models map[string]*Model
	// Listeners are the Envoy listeners this source declares.
	Listeners []Listener
	// Routing, when non-nil, is this source's routing block; at most one
	// source may set it.
	Routing *Routing
	// Replicas are switchyard replicas this source knows (a static list
	// in the configuration, or those registered in Consul).
	Replicas []Replica
	// ReplicaDiscovery, when non-nil, is this source's replicas block; at
	// most one source may set it.
	ReplicaDiscovery *ReplicaDiscovery
	// Tenants are the tenants this source declares, keyed by name.
	Tenants map[string]*Tenant
	// TenantSettings, when non-nil, is this source's tenants block; at
	// most one source may set it.
	TenantSettings *TenantSettings
	// ScrapeFailing is the health input: pool name -> addresses of
	// endpoints whose metrics scrapes are failing. It marks endpoints that
	// other sources supply (Endpoint.ScrapeFailing); addresses no pool has
	// are ignored.
	ScrapeFailing map[string][]string
	// Err, when non-nil, means the source failed to refresh: the Manager
	// keeps the source's previous contribution in force (stale beats
	// partial) and reports Err through LastError until the source sends a
	// good Update. The other fields are ignored.
	Err error
}

// Source is a provider of pools, models, endpoints and listeners.
//
// Run sends the source's full contribution on up as soon as it has one,
// then a new full contribution whenever it changes, and returns once ctx is
// cancelled. It must not close up, and every send must also select on
// ctx.Done() so that Run can return while the Manager stops reading.
type Source interface {
	Run(ctx context.Context, up chan<- Update)
}

// Reloader is implemented by sources that can re-read their input on demand
// (the file source on SIGHUP).
type Reloader interface {
	Reload()
}

// Merge combines the contributions of several sources, in priority order,
// into one State (with Version 0). Conflicts that make the result
// ambiguous (a pool, model, listener or routing block declared by two
// sources) are returned as errors wrapping ErrDuplicate. Endpoints that
// cannot be placed (their pool is not declared) or that an earlier source
// already supplied are dropped and reported in warnings. Merge copies
// everything it keeps, so the result shares no memory with the updates
// except the pools' Scheduling, Consul, Guard, Admission, Disaggregation
// and KVEvents blocks, the models' Disaggregation blocks and the endpoints'
// KVEvents (which both sides treat as
// read-only).
func Merge(updates []Update) (s *State, warnings []string, err error) {
	s = Empty()
	var errs []error
	poolFrom := map[string]string{}
	modelFrom := map[string]string{}
	listenerFrom := map[string]string{}
	routingFrom := ""
	replicasFrom := ""
	tenantsFrom := ""
	tenantFrom := map[string]string{}
	replicaAt := map[string]int{}
	epFrom := map[string]map[string]string{} // pool -> address -> source

	dupErr := func(kind, name, where, src, first string) {
		errs = append(errs, &ValidationError{Kind: kind, Name: name, Where: where, Err: ErrDuplicate,
			Msg: fmt.Sprintf("declared by source %q and again by source %q", first, src)})
	}
	for _, u := range updates {
		for _, name := range sortedKeys(u.Pools) {
			p := u.Pools[name]
			if first, dup := poolFrom[name]; dup {
				dupErr(KindPool, name, p.DeclRange, u.Source, first)
				continue
			}
			poolFrom[name] = u.Source
			cp := *p
			cp.Name = name
			cp.Endpoints = nil
			s.Pools[name] = &cp
			epFrom[name] = map[string]string{}
		}
	}
	addEndpoints := func(src, pool string, eps []Endpoint) {
		p, ok := s.Pools[pool]
		if !ok {
			for _, ep := range eps {
				warnings = append(warnings, fmt.Sprintf("source %q: endpoint %s dropped: pool %q is not declared", src, ep.Address, pool))
			}
			return
		}
		for _, ep := range eps {
			if first, dup := epFrom[pool][ep.Address]; dup {
				if first != src {
					warnings = append(warnings, fmt.Sprintf("source %q: endpoint %s of pool %q dropped: source %q already supplies it", src, ep.Address, pool, first))
				} else {
					errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: pool, Where: p.DeclRange, Err: ErrDuplicate,
						Msg: fmt.Sprintf("endpoint %s is listed twice by source %q", ep.Address, src)})
				}
				continue
			}
			epFrom[pool][ep.Address] = src
			if ep.Source == "" {
				ep.Source = src
			}
			// Derived by the registry, never taken from a source.
			ep.Held, ep.ScrapeFailing = false, false
			ep.Models = slices.Clone(ep.Models)
			p.Endpoints = append(p.Endpoints, ep)
		}
	}
	for _, u := range updates {
		for _, name := range sortedKeys(u.Pools) {
			if poolFrom[name] == u.Source {
				addEndpoints(u.Source, name, u.Pools[name].Endpoints)
			}
		}
	}
	for _, u := range updates {
		for _, pool := range sortedKeys(u.Endpoints) {
			addEndpoints(u.Source, pool, u.Endpoints[pool])
		}
	}
	for _, p := range s.Pools {
		if p.Endpoints == nil {
			p.Endpoints = []Endpoint{}
		}
		sort.Slice(p.Endpoints, func(i, j int) bool { return p.Endpoints[i].Address < p.Endpoints[j].Address })
	}
	for _, u := range updates {
		for pool, addrs := range u.ScrapeFailing {
			p, ok := s.Pools[pool]
			if !ok {
				continue
			}
			for _, a := range addrs {
				if i, ok := slices.BinarySearchFunc(p.Endpoints, a, func(e Endpoint, a string) int { return strings.Compare(e.Address, a) }); ok {
					p.Endpoints[i].ScrapeFailing = true
				}
			}
		}
	}

	for _, u := range updates {
		for _, name := range sortedKeys(u.Models) {
			m := u.Models[name]
			if first, dup := modelFrom[name]; dup {
				dupErr(KindModel, name, m.DeclRange, u.Source, first)
				continue
			}
			modelFrom[name] = u.Source
			cp := *m
			cp.Name = name
			cp.Targets = slices.Clone(m.Targets)
			s.Models[name] = &cp
		}
		for _, l := range u.Listeners {
			if first, dup := listenerFrom[l.Name]; dup {
				dupErr(KindListener, l.Name, l.DeclRange, u.Source, first)
				continue
			}
			listenerFrom[l.Name] = u.Source
			s.Listeners = append(s.Listeners, l)
		}
		if u.ReplicaDiscovery != nil {
			if replicasFrom != "" {
				dupErr(KindReplicas, "", u.ReplicaDiscovery.DeclRange, u.Source, replicasFrom)
			} else {
				replicasFrom = u.Source
				rd := *u.ReplicaDiscovery
				s.ReplicaDiscovery = &rd
			}
		}
		for _, r := range u.Replicas {
			if _, dup := replicaAt[r.Address]; dup {
				continue // the same replica from two sources: the first wins
			}
			if r.Source == "" {
				r.Source = u.Source
			}
			replicaAt[r.Address] = len(s.Replicas)
			s.Replicas = append(s.Replicas, r)
		}
		for _, name := range sortedKeys(u.Tenants) {
			t := u.Tenants[name]
			if first, dup := tenantFrom[name]; dup {
				dupErr(KindTenant, name, t.DeclRange, u.Source, first)
				continue
			}
			tenantFrom[name] = u.Source
			cp := cloneTenant(t)
			cp.Name = name
			if s.Tenants == nil {
				s.Tenants = map[string]*Tenant{}
			}
			s.Tenants[name] = cp
		}
		if u.TenantSettings != nil {
			if tenantsFrom != "" {
				dupErr(KindTenants, "", u.TenantSettings.DeclRange, u.Source, tenantsFrom)
			} else {
				tenantsFrom = u.Source
				s.TenantSettings = *u.TenantSettings
			}
		}
		if u.Routing != nil {
			if routingFrom != "" {
				dupErr(KindRouting, "", "", u.Source, routingFrom)
				continue
			}
			routingFrom = u.Source
			s.Routing = *u.Routing
		}
	}
	sort.Slice(s.Listeners, func(i, j int) bool { return s.Listeners[i].Name < s.Listeners[j].Name })
	sort.Slice(s.Replicas, func(i, j int) bool { return s.Replicas[i].Address < s.Replicas[j].Address })
	return s, warnings, errors.Join(errs...)
}

// Summary describes a state in one line: "2 pools, 3 models, 1 listener"
// (and ", 2 tenants" when it has tenants).
func (s *State) Summary() string {
	plural := func(n int, word string) string {
		if n == 1 {
			return fmt.Sprintf("%d %s", n, word)
		}
		return fmt.Sprintf("%d %ss", n, word)
	}
	parts := []string{
		plural(len(s.Pools), "pool"),
		plural(len(s.Models), "model"),
		plural(len(s.Listeners), "listener"),
	}
	if len(s.Tenants) > 0 {
		parts = append(parts, plural(len(s.Tenants), "tenant"))
	}
	return strings.Join(parts, ", ")
}
