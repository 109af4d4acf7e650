package metrics

import (
	"time"

	"github.com/switchyard/switchyard/registry"
)

// TargetsFromState lists the scrape targets of every pool in s: one per
// endpoint that is not draining, with the pool's engine, scrape intervals
// and metric overrides, and the endpoint's metrics path if it sets one.
// Feed the result to Manager.Sync on every new registry state.
func TargetsFromState(s *registry.State) []Target {
	if s == nil {
		return nil
	}
	var out []Target
	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		var interval, idle time.Duration
		var overrides map[string]string
		if p.Scheduling != nil {
			interval = time.Duration(p.Scheduling.ScrapeIntervalMS) * time.Millisecond
			idle = time.Duration(p.Scheduling.IdleScrapeIntervalMS) * time.Millisecond
			overrides = p.Scheduling.Metrics
		}
		for _, ep := range p.Endpoints {
			if ep.Draining {
				continue
			}
			path := p.MetricsPath
			if ep.MetricsPath != "" {
				path = ep.MetricsPath
			}
			out = append(out, Target{Pool: p.Name, Address: ep.Address, MetricsPath: path,
				Engine: p.Engine, Interval: interval, IdleInterval: idle, Overrides: overrides, APIKey: p.UpstreamAPIKey})
		}
	}
	return out
}
