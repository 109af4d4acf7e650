package consul

import (
	"reflect"
	"strings"
	"testing"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/registry"
)

// inst builds a service entry; status is the single check's status
// ("" means no checks at all).
func inst(node, id, nodeAddr, svcAddr string, port int, meta map[string]string, status string) *api.ServiceEntry {
	e := &api.ServiceEntry{
		Node:    &api.Node{Node: node, Address: nodeAddr},
		Service: &api.AgentService{ID: id, Service: "vllm", Address: svcAddr, Port: port, Meta: meta},
	}
	if status != "" {
		checkID := "service:" + id
		if status == api.HealthMaint {
			checkID, status = api.ServiceMaintPrefix+id, api.HealthCritical
		}
		e.Checks = api.HealthChecks{
			{Node: node, CheckID: "serfHealth", Status: api.HealthPassing},
			{Node: node, CheckID: checkID, ServiceID: id, Status: status},
		}
	}
	return e
}

// nodeDown marks e's node unreachable: its serfHealth check critical, as
// Consul's servers do when gossip cannot reach the agent.
func nodeDown(e *api.ServiceEntry) *api.ServiceEntry {
	checks := api.HealthChecks{{Node: e.Node.Node, CheckID: "serfHealth", Status: api.HealthCritical}}
	for _, c := range e.Checks {
		if c.CheckID != "serfHealth" {
			checks = append(checks, c)
		}
	}
	e.Checks = checks
	return e
}

func TestConvert(t *testing.T) {
	t.Parallel()
	sel := registry.ConsulSelector{Service: "vllm"}
	ep := func(addr string, models ...string) registry.Endpoint {
		return registry.Endpoint{Address: addr, Source: SourceName, Models: models}
	}
	cases := []struct {
		desc    string
		engine  registry.Engine
		passing bool // the selector's passing_only
		entries []*api.ServiceEntry
		want    []registry.Endpoint
		// warnings lists substrings, one per expected warning, in order.
		warnings []string
	}{
		{
			desc: "no instances gives an empty, non-nil list",
			want: []registry.Endpoint{},
		},
		{
			desc: "service address wins over node address; sorted by address",
			entries: []*api.ServiceEntry{
				inst("n2", "b", "10.0.0.9", "10.0.0.2", 8000, nil, api.HealthPassing),
				inst("n1", "a", "10.0.0.9", "10.0.0.1", 8000, nil, api.HealthPassing),
			},
			want: []registry.Endpoint{ep("10.0.0.1:8000"), ep("10.0.0.2:8000")},
		},
		{
			desc:    "node address when the service has none",
			entries: []*api.ServiceEntry{inst("n1", "a", "10.0.0.9", "", 8001, nil, "")},
			want:    []registry.Endpoint{ep("10.0.0.9:8001")},
		},
		{
			desc: "IPv6 is bracketed and compressed; IPv4-mapped becomes IPv4",
			entries: []*api.ServiceEntry{
				inst("n1", "a", "", "2001:DB8:0:0::1", 8000, nil, ""),
				inst("n1", "b", "", "[fd00::2]", 8000, nil, ""),
				inst("n1", "c", "", "::ffff:10.1.2.3", 8000, nil, ""),
			},
			want: []registry.Endpoint{ep("10.1.2.3:8000"), ep("[2001:db8::1]:8000"), ep("[fd00::2]:8000")},
		},
		{
			desc: "hostnames, missing addresses, bad ports and unspecified IPs are left out with a warning",
			entries: []*api.ServiceEntry{
				inst("n1", "host", "", "vllm-1.internal", 8000, nil, ""),
				inst("n1", "noaddr", "", "", 8000, nil, ""),
				inst("n1", "port0", "", "10.0.0.1", 0, nil, ""),
				inst("n1", "bigport", "", "10.0.0.1", 70000, nil, ""),
				inst("n1", "zero", "", "0.0.0.0", 8000, nil, ""),
				inst("n1", "ok", "", "10.0.0.1", 8000, nil, ""),
			},
			want: []registry.Endpoint{ep("10.0.0.1:8000")},
			warnings: []string{
				`instance n1/host: left out: address "vllm-1.internal" is not an IP literal`,
				"instance n1/noaddr: left out: no service or node address",
				"instance n1/port0: left out: port 0 is not in 1-65535",
				"instance n1/bigport: left out: port 70000",
				"instance n1/zero: left out",
			},
		},
		{
			desc: "health: critical marked Critical silently, warning kept, maintenance drains",
			entries: []*api.ServiceEntry{
				inst("n1", "crit", "", "10.0.0.1", 8000, nil, api.HealthCritical),
				inst("n1", "warn", "", "10.0.0.2", 8000, nil, api.HealthWarning),
				inst("n1", "maint", "", "10.0.0.3", 8000, nil, api.HealthMaint),
			},
			want: []registry.Endpoint{{Address: "10.0.0.1:8000", Source: SourceName, Critical: true}, ep("10.0.0.2:8000"), {Address: "10.0.0.3:8000", Source: SourceName, Draining: true}},
		},
		{
			desc:    "node unreachable (serfHealth critical): judged by its own checks as last reported",
			passing: true,
			entries: []*api.ServiceEntry{
				nodeDown(inst("n1", "pass", "", "10.0.0.1", 8000, nil, api.HealthPassing)),
				nodeDown(inst("n2", "crit", "", "10.0.0.2", 8000, nil, api.HealthCritical)),
				nodeDown(inst("n3", "warn", "", "10.0.0.3", 8000, nil, api.HealthWarning)),
				nodeDown(inst("n4", "maint", "", "10.0.0.4", 8000, nil, api.HealthMaint)),
				nodeDown(&api.ServiceEntry{Node: &api.Node{Node: "n5"}, Service: &api.AgentService{ID: "nochecks", Address: "10.0.0.5", Port: 8000}}),
			},
			want: []registry.Endpoint{
				{Address: "10.0.0.1:8000", Source: SourceName, NodeUnreachable: true},
				{Address: "10.0.0.2:8000", Source: SourceName, Critical: true, NodeUnreachable: true},
				{Address: "10.0.0.3:8000", Source: SourceName, Critical: true, NodeUnreachable: true},
				{Address: "10.0.0.4:8000", Source: SourceName, Draining: true},
				{Address: "10.0.0.5:8000", Source: SourceName, NodeUnreachable: true},
			},
		},
		{
			desc: "another node check critical is not the node being unreachable",
			entries: []*api.ServiceEntry{func() *api.ServiceEntry {
				e := inst("n1", "disk", "", "10.0.0.1", 8000, nil, api.HealthPassing)
				e.Checks = append(e.Checks, &api.HealthCheck{Node: "n1", CheckID: "disk-full", Status: api.HealthCritical})
				return e
			}()},
			want: []registry.Endpoint{{Address: "10.0.0.1:8000", Source: SourceName, Critical: true}},
		},
		{
			desc:    "health with passing_only: warning is Critical too",
			passing: true,
			entries: []*api.ServiceEntry{
				inst("n1", "pass", "", "10.0.0.1", 8000, nil, api.HealthPassing),
				inst("n1", "warn", "", "10.0.0.2", 8000, nil, api.HealthWarning),
			},
			want: []registry.Endpoint{ep("10.0.0.1:8000"), {Address: "10.0.0.2:8000", Source: SourceName, Critical: true}},
		},
		{
			desc: "meta: models trimmed, de-duplicated and sorted; metrics_path",
			entries: []*api.ServiceEntry{
				inst("n1", "a", "", "10.0.0.1", 8000, map[string]string{
					MetaModels: " sql-lora, meta-llama/Llama-3.1-8B-Instruct,,sql-lora ", MetaMetricsPath: "/vllm/metrics",
				}, api.HealthPassing),
				inst("n1", "b", "", "10.0.0.2", 8000, map[string]string{MetaModels: " , ", MetaMetricsPath: "metrics"}, api.HealthPassing),
			},
			want: []registry.Endpoint{
				{Address: "10.0.0.1:8000", Source: SourceName, Models: []string{"meta-llama/Llama-3.1-8B-Instruct", "sql-lora"}, MetricsPath: "/vllm/metrics"},
				ep("10.0.0.2:8000"),
			},
			warnings: []string{`instance n1/b: meta metrics_path ignored: bad metrics_path "metrics"`},
		},
		{
			desc:   "meta: kv_events ports and topic; bad ones ignored with a warning",
			engine: registry.EngineVLLM,
			entries: []*api.ServiceEntry{
				inst("n1", "a", "", "10.0.0.1", 8000, map[string]string{MetaKVEventsPort: "5557", MetaKVEventsReplayPort: " 5558 ", MetaKVEventsTopic: "kv@a"}, api.HealthPassing),
				inst("n1", "b", "", "10.0.0.2", 8000, map[string]string{MetaKVEventsPort: "5557"}, api.HealthPassing),
				inst("n1", "c", "", "10.0.0.3", 8000, map[string]string{MetaKVEventsPort: "zmq"}, api.HealthPassing),
				inst("n1", "d", "", "10.0.0.4", 8000, map[string]string{MetaKVEventsPort: "5557", MetaKVEventsReplayPort: "5557"}, api.HealthPassing),
			},
			want: []registry.Endpoint{
				{Address: "10.0.0.1:8000", Source: SourceName, KVEvents: &registry.KVEvents{Port: 5557, ReplayPort: 5558, Topic: "kv@a"}},
				{Address: "10.0.0.2:8000", Source: SourceName, KVEvents: &registry.KVEvents{Port: 5557}},
				ep("10.0.0.3:8000"), ep("10.0.0.4:8000"),
			},
			warnings: []string{
				`instance n1/c: meta kv_events_port ignored: kv_events_port "zmq" is not a port number`,
				`instance n1/d: meta kv_events_port ignored: replay_port 5557 is the event port too`,
			},
		},
		{
			desc:   "meta engine must match the pool's engine",
			engine: registry.EngineSGLang,
			entries: []*api.ServiceEntry{
				inst("n1", "v", "", "10.0.0.1", 8000, map[string]string{MetaEngine: "vllm"}, ""),
				inst("n1", "s", "", "10.0.0.2", 8000, map[string]string{MetaEngine: "sglang"}, ""),
				inst("n1", "none", "", "10.0.0.3", 8000, nil, ""),
			},
			want:     []registry.Endpoint{ep("10.0.0.2:8000"), ep("10.0.0.3:8000")},
			warnings: []string{`instance n1/v: left out: meta engine="vllm" but the pool's engine is "sglang"`},
		},
		{
			desc: "meta role: prefill, decode, both and llm-d's prefill-decode; unknown left out",
			entries: []*api.ServiceEntry{
				inst("n1", "p", "", "10.0.0.1", 8000, map[string]string{MetaRole: "prefill"}, ""),
				inst("n1", "d", "", "10.0.0.2", 8000, map[string]string{MetaRole: " Decode "}, ""),
				inst("n1", "b", "", "10.0.0.3", 8000, map[string]string{MetaRole: "both"}, ""),
				inst("n1", "pd", "", "10.0.0.4", 8000, map[string]string{MetaRole: "prefill-decode"}, ""),
				inst("n1", "x", "", "10.0.0.5", 8000, map[string]string{MetaRole: "encode"}, ""),
			},
			want: []registry.Endpoint{
				{Address: "10.0.0.1:8000", Source: SourceName, Role: registry.RolePrefill},
				{Address: "10.0.0.2:8000", Source: SourceName, Role: registry.RoleDecode},
				ep("10.0.0.3:8000"), ep("10.0.0.4:8000"),
			},
			warnings: []string{`instance n1/x: left out: meta role: bad role "encode"`},
		},
		{
			desc: "two instances on one address: the smaller node/ID wins",
			entries: []*api.ServiceEntry{
				inst("n2", "z", "", "10.0.0.1", 8000, map[string]string{MetaModels: "second"}, ""),
				inst("n1", "y", "", "10.0.0.1", 8000, map[string]string{MetaModels: "first"}, ""),
			},
			want:     []registry.Endpoint{ep("10.0.0.1:8000", "first")},
			warnings: []string{"instance n2/z: left out: address 10.0.0.1:8000 is already used by instance n1/y"},
		},
		{
			desc:    "nil entries and services are skipped",
			entries: []*api.ServiceEntry{nil, {Node: &api.Node{Node: "n"}}},
			want:    []registry.Endpoint{},
		},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			engine := tc.engine
			if engine == "" {
				engine = registry.EngineVLLM
			}
			sel := sel
			sel.PassingOnly = tc.passing
			got, warnings := convert(tc.entries, sel, engine)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("endpoints:\n got %+v\nwant %+v", got, tc.want)
			}
			if len(warnings) != len(tc.warnings) {
				t.Fatalf("warnings: got %q, want %d matching %q", warnings, len(tc.warnings), tc.warnings)
			}
			for i, w := range tc.warnings {
				if !strings.Contains(warnings[i], w) || !strings.HasPrefix(warnings[i], `consul service "vllm" `) {
					t.Errorf("warning %d = %q, want it to contain %q", i, warnings[i], w)
				}
			}
		})
	}
}
