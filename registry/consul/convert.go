package consul

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/registry"
)

// The service-meta keys a model server sets on its Consul registration.
const (
	// MetaModels is a comma-separated list of the model names and LoRA
	// adapters the instance serves ("llama-3-8b,sql-lora").
	MetaModels = "models"
	// MetaEngine names the instance's engine (vllm, sglang, trtllm-serve,
	// triton-tensorrt-llm). When set it must equal the pool's engine.
	MetaEngine = "engine"
	// MetaMetricsPath overrides the pool's metrics path for the instance.
	MetaMetricsPath = "metrics_path"
	// MetaRole is the instance's part in a disaggregated pool: prefill,
	// decode or both (llm-d's prefill-decode is read as both). An unknown
	// value leaves the instance out.
	MetaRole = "role"
	// MetaKVEventsPort says the instance publishes its KV-cache events on
	// this ZMQ PUB port (vLLM --kv-events-config endpoint tcp://*:PORT);
	// MetaKVEventsReplayPort is its replay socket's port and
	// MetaKVEventsTopic its topic. They override the pool's kv_events
	// block for the instance.
	MetaKVEventsPort       = "kv_events_port"
	MetaKVEventsReplayPort = "kv_events_replay_port"
	MetaKVEventsTopic      = "kv_events_topic"
)

// convert turns the instances one health query returned into the endpoints
// of a pool whose engine is engine. It never fails: an instance that
// cannot be used is left out and described in warnings.
//
// Rules (see the package documentation for the reasoning):
//   - address: the service address, else the node address, which must be an
//     IP literal; the port must be 1-65535. The result is canonical
//     "ip:port" ("[v6]:port").
//   - health (aggregated over the instance's checks): passing and warning
//     instances are endpoints; maintenance makes them Draining; critical
//     ones are endpoints marked Critical (and so are warning ones with
//     sel.PassingOnly), which the registry leaves out unless its discovery
//     guard holds them (registry.Guard): an instance that is registered but
//     failing is told apart from one that left. An instance whose only
//     critical check is its node's serfHealth (Consul cannot reach the
//     agent: a partition, or a dead host) is judged by its other checks
//     as last reported, and marked NodeUnreachable: the picker's metrics
//     scrapes, which reach the server directly, decide whether it serves.
//   - meta "engine", when set, must equal engine; meta "models" fills
//     Models (trimmed, de-duplicated, sorted); meta "metrics_path" must pass
//     registry.CheckMetricsPath, else it is ignored; meta "kv_events_port"
//     (with "kv_events_replay_port" and "kv_events_topic") sets the
//     instance's KV-events stream, ignored when registry.CheckKVEvents
//     refuses it.
//   - two instances on the same address: the one with the smaller
//     node/service ID wins.
//
// The result is sorted by Address and never nil.
func convert(entries []*api.ServiceEntry, sel registry.ConsulSelector, engine registry.Engine) (eps []registry.Endpoint, warnings []string) {
	type cand struct {
		ep  registry.Endpoint
		key string // node/service-id, to pick a stable winner for duplicates
	}
	var cands []cand
	for _, e := range entries {
		if e == nil || e.Service == nil {
			continue
		}
		id := instanceID(e)
		warn := func(format string, args ...any) {
			warnings = append(warnings, fmt.Sprintf("consul service %q instance %s: ", sel.Service, id)+fmt.Sprintf(format, args...))
		}
		addr, err := instanceAddress(e)
		if err != nil {
			warn("left out: %v", err)
			continue
		}
		ep := registry.Endpoint{Address: addr, Source: SourceName}
		status := e.Checks.AggregatedStatus()
		if own, ok := unreachableNode(e.Checks); ok && status == api.HealthCritical {
			// Consul cannot reach the agent that runs the instance's
			// checks: their results are stale, not failing. The
			// instance's own checks decide (as last reported), and the
			// picker's scrapes judge it from here on.
			status, ep.NodeUnreachable = own, true
		}
		switch status {
		case api.HealthCritical:
			ep.Critical = true
		case api.HealthWarning:
			ep.Critical = sel.PassingOnly
		case api.HealthMaint:
			ep.Draining = true
		}
		meta := e.Service.Meta
		if eng := strings.TrimSpace(meta[MetaEngine]); eng != "" && registry.Engine(eng) != engine {
			warn("left out: meta %s=%q but the pool's engine is %q", MetaEngine, eng, engine)
			continue
		}
		role, err := registry.ParseRole(meta[MetaRole])
		if err != nil {
			warn("left out: meta %s: %v", MetaRole, err)
			continue
		}
		ep.Role = role
		ep.Models = parseModels(meta[MetaModels])
		if mp := strings.TrimSpace(meta[MetaMetricsPath]); mp != "" {
			if err := registry.CheckMetricsPath(mp); err != nil {
				warn("meta %s ignored: %v", MetaMetricsPath, err)
			} else {
				ep.MetricsPath = mp
			}
		}
		if kv, err := parseKVEvents(meta, engine); err != nil {
			warn("meta %s ignored: %v", MetaKVEventsPort, err)
		} else {
			ep.KVEvents = kv
		}
		cands = append(cands, cand{ep: ep, key: id})
	}
	sort.Slice(cands, func(i, j int) bool {
		if cands[i].ep.Address != cands[j].ep.Address {
			return cands[i].ep.Address < cands[j].ep.Address
		}
		return cands[i].key < cands[j].key
	})
	eps = make([]registry.Endpoint, 0, len(cands))
	for i, c := range cands {
		if i > 0 && cands[i-1].ep.Address == c.ep.Address {
			warnings = append(warnings, fmt.Sprintf("consul service %q instance %s: left out: address %s is already used by instance %s",
				sel.Service, c.key, c.ep.Address, cands[i-1].key))
			continue
		}
		eps = append(eps, c.ep)
	}
	return eps, warnings
}

// serfHealthCheck is the ID of the node check Consul's servers keep for
// every agent from gossip: critical when no member can reach the agent.
const serfHealthCheck = "serfHealth"

// unreachableNode reports whether checks include a critical serfHealth
// check, and if so the aggregated status of the other checks (passing
// when there are none): what the instance's own checks said last, before
// Consul lost its agent.
func unreachableNode(checks api.HealthChecks) (own string, ok bool) {
	var rest api.HealthChecks
	for _, c := range checks {
		if c == nil {
			continue
		}
		if c.CheckID == serfHealthCheck && c.ServiceID == "" && c.Status == api.HealthCritical {
			ok = true
			continue
		}
		rest = append(rest, c)
	}
	if !ok {
		return "", false
	}
	return rest.AggregatedStatus(), true
}

// parseKVEvents reads an instance's KV-events meta: nil without
// kv_events_port.
func parseKVEvents(meta map[string]string, engine registry.Engine) (*registry.KVEvents, error) {
	port := strings.TrimSpace(meta[MetaKVEventsPort])
	if port == "" {
		return nil, nil
	}
	kv := &registry.KVEvents{Topic: meta[MetaKVEventsTopic]}
	var err error
	if kv.Port, err = strconv.Atoi(port); err != nil {
		return nil, fmt.Errorf("%s %q is not a port number", MetaKVEventsPort, port)
	}
	if rp := strings.TrimSpace(meta[MetaKVEventsReplayPort]); rp != "" {
		if kv.ReplayPort, err = strconv.Atoi(rp); err != nil {
			return nil, fmt.Errorf("%s %q is not a port number", MetaKVEventsReplayPort, rp)
		}
	}
	if probs := registry.CheckKVEvents(kv, engine); len(probs) > 0 {
		return nil, errors.New(probs[0].Msg)
	}
	return kv, nil
}

// instanceID names an instance in messages: "node/service-id".
func instanceID(e *api.ServiceEntry) string {
	node := ""
	if e.Node != nil {
		node = e.Node.Node
	}
	return node + "/" + e.Service.ID
}

// instanceAddress returns the canonical "ip:port" of an instance.
func instanceAddress(e *api.ServiceEntry) (string, error) {
	host := strings.TrimSpace(e.Service.Address)
	if host == "" && e.Node != nil {
		host = strings.TrimSpace(e.Node.Address)
	}
	if host == "" {
		return "", fmt.Errorf("no service or node address")
	}
	// Tolerate an address written as "[v6]".
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return "", fmt.Errorf("address %q is not an IP literal (register the service with an IP address)", host)
	}
	if e.Service.Port <= 0 || e.Service.Port > 65535 {
		return "", fmt.Errorf("port %d is not in 1-65535", e.Service.Port)
	}
	return registry.CanonicalAddress(net.JoinHostPort(ip.String(), strconv.Itoa(e.Service.Port)), true)
}

// parseModels splits a "models" meta value: comma-separated, blanks
// trimmed and dropped, duplicates removed, sorted. Nil when empty.
func parseModels(v string) []string {
	var out []string
	for _, m := range strings.Split(v, ",") {
		if m = strings.TrimSpace(m); m != "" {
			out = append(out, m)
		}
	}
	if len(out) == 0 {
		return nil
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Service-meta keys a switchyard replica sets on its own registration
// (see Registration).
const (
	// MetaAdmin is the replica's admin "ip:port".
	MetaAdmin = "admin"
	// MetaXDS is the replica's ADS "ip:port".
	MetaXDS = "xds"
)

// convertReplicas turns the passing instances of the replicas' service into
// replicas: the service address and port are the replica's picker address,
// meta admin and xds its other ports. Failing instances are left out: a
// replica whose readiness check fails takes no traffic.
func convertReplicas(entries []*api.ServiceEntry) (reps []registry.Replica, warnings []string) {
	for _, e := range entries {
		if e == nil || e.Service == nil || e.Checks.AggregatedStatus() != api.HealthPassing {
			continue
		}
		addr, err := instanceAddress(e)
		if err != nil {
			warnings = append(warnings, fmt.Sprintf("switchyard replica %s left out: %v", instanceID(e), err))
			continue
		}
		reps = append(reps, registry.Replica{ID: e.Service.ID, Address: addr,
			Admin: e.Service.Meta[MetaAdmin], XDS: e.Service.Meta[MetaXDS], Source: SourceName})
	}
	sort.Slice(reps, func(i, j int) bool { return reps[i].Address < reps[j].Address })
	return reps, warnings
}
