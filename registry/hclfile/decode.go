package hclfile

import (
	"fmt"
	"math/big"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/switchyard/switchyard/registry"
	"github.com/zclconf/go-cty/cty"
	"github.com/zclconf/go-cty/cty/convert"
)

// Defaults applied to attributes that are left out.
const (
	DefaultEngine       = registry.EngineVLLM
	DefaultFailureMode  = registry.FailClosed
	DefaultMetricsPath  = "/metrics"
	DefaultTargetWeight = 1
)

var rootSchema = &hcl.BodySchema{
	Blocks: []hcl.BlockHeaderSchema{
		{Type: "listener", LabelNames: []string{"name"}},
		{Type: "routing"},
		{Type: "replicas"},
		{Type: "pool", LabelNames: []string{"name"}},
		{Type: "model", LabelNames: []string{"name"}},
		{Type: "consul"},
		{Type: "tls"},
		{Type: "tenant", LabelNames: []string{"name"}},
		{Type: "tenants"},
		{Type: "tracing"},
	},
}

// The attribute tables of every block type, and the block types nested in
// them. Adding an attribute is one entry; its name, type and whether it is
// required make the HCL schema too.
var (
	// agentBody is the top-level consul block: how to reach the Consul
	// agent.
	agentBody = newBody([]attr[*ConsulAgent]{
		strAttr("address", func(a *ConsulAgent, v string) { a.Address = v }, notBlank(agentBlank), consulAddress),
		strAttr("token", func(a *ConsulAgent, v string) { a.Token = v }, notBlank(agentBlank)),
		strAttr("token_file", func(a *ConsulAgent, v string) { a.TokenFile = v }, notBlank(agentBlank)),
	}, hcl.BlockHeaderSchema{Type: "tls"})

	agentTLSBody = newBody([]attr[*ConsulTLS]{
		strAttr("server_name", func(t *ConsulTLS, v string) { t.ServerName = v }, notBlank(agentBlank)),
		strAttr("ca_file", func(t *ConsulTLS, v string) { t.CAFile = v }, notBlank(agentBlank)),
		strAttr("ca_path", func(t *ConsulTLS, v string) { t.CAPath = v }, notBlank(agentBlank)),
		strAttr("cert_file", func(t *ConsulTLS, v string) { t.CertFile = v }, notBlank(agentBlank)),
		strAttr("key_file", func(t *ConsulTLS, v string) { t.KeyFile = v }, notBlank(agentBlank)),
		boolAttr("insecure_skip_verify", func(t *ConsulTLS, v bool) { t.InsecureSkipVerify = v }),
	})

	listenerBody = newBody([]attr[*registry.Listener]{
		{name: "address", isRequired: true, decode: func(d *decoder, f field, l *registry.Listener) {
			if s, ok := d.str(f.at, f.attr.Expr); ok {
				l.Address, _ = d.address(f.at, f.rng(), s, false)
			}
		}},
	})

	// replicasBody is the top-level replicas block: how the switchyard
	// replicas serving this configuration find each other.
	replicasBody = newBody([]attr[*replicasBlock]{
		strAttr("consul_service", func(r *replicasBlock, v string) { r.disc.ConsulService = v }, consulName),
		{name: "peers", decode: func(d *decoder, f field, r *replicasBlock) {
			elems, diags := hcl.ExprList(f.attr.Expr)
			if !d.add(f.at, diags) {
				return
			}
			seen := map[string]bool{}
			for _, e := range elems {
				s, ok := d.str(f.at, e)
				if !ok {
					continue
				}
				canon, ok := d.address(f.at, e.Range(), s, true)
				if !ok {
					continue
				}
				if seen[canon] {
					d.errorAt(f.at, e.Range(), "Duplicate peer", fmt.Sprintf("Replica %s is listed twice.", canon))
					continue
				}
				seen[canon] = true
				r.peers = append(r.peers, registry.Replica{ID: canon, Address: canon})
			}
		}},
	})

	routingBody = newBody([]attr[*registry.Routing]{
		strAttr("default_pool", func(r *registry.Routing, v string) { r.DefaultPool = v }),
	})

	poolBody = newBody([]attr[*registry.Pool]{
		strAttr("engine", func(p *registry.Pool, v string) { p.Engine = registry.Engine(v) }),
		strAttr("failure_mode", func(p *registry.Pool, v string) { p.FailureMode = registry.FailureMode(v) }),
		strAttr("metrics_path", func(p *registry.Pool, v string) { p.MetricsPath = v }),
		{name: "endpoints", decode: (*decoder).poolEndpoints},
		upstreamAttr("upstream_api_key_file"),
		upstreamAttr("upstream_api_key_env"),
	},
		hcl.BlockHeaderSchema{Type: "scheduling"},
		hcl.BlockHeaderSchema{Type: "admission"},
		hcl.BlockHeaderSchema{Type: "endpoint", LabelNames: []string{"address"}},
		hcl.BlockHeaderSchema{Type: "consul"},
		hcl.BlockHeaderSchema{Type: "disaggregation"},
		hcl.BlockHeaderSchema{Type: "kv_events"},
	)

	// kvEventsBody is a pool's (or an endpoint's) kv_events block: the
	// servers publish their KV-cache events (vLLM --kv-events-config).
	kvEventsBody = newBody([]attr[*registry.KVEvents]{
		intAttr("port", func(k *registry.KVEvents, v int) { k.Port = v }).required(),
		intAttr("replay_port", func(k *registry.KVEvents, v int) { k.ReplayPort = v }),
		strAttr("topic", func(k *registry.KVEvents, v string) { k.Topic = v }),
	})

	// disaggregationBody is a pool's or model's disaggregation block: when
	// a request's prefill runs on a prefill server.
	disaggregationBody = newBody([]attr[*registry.Disaggregation]{
		boolAttr("enabled", func(g *registry.Disaggregation, v bool) { g.Disabled = !v }),
		intAttr("uncached_tokens", func(g *registry.Disaggregation, v int) { g.UncachedTokens = v }),
		intAttr("min_prompt_tokens", func(g *registry.Disaggregation, v int) { g.MinPromptTokens = v }),
		intAttr("prefill_queue_threshold", func(g *registry.Disaggregation, v int) { g.PrefillQueueThreshold = v }),
	})

	// consulBody is a pool's consul block: which Consul service instances
	// join the pool, and its discovery guard.
	consulBody = newBody([]attr[*poolConsul]{
		strAttr("service", func(c *poolConsul, v string) { c.sel.Service = v }, consulName).required(),
		strAttr("tag", func(c *poolConsul, v string) { c.sel.Tag = v }, consulName),
		strAttr("datacenter", func(c *poolConsul, v string) { c.sel.Datacenter = v }, consulName),
		boolAttr("passing_only", func(c *poolConsul, v bool) { c.sel.PassingOnly = v }),
		{name: "panic_threshold", decode: func(d *decoder, f field, c *poolConsul) {
			v, ok := d.number(f.at, f.attr.Expr)
			if !ok {
				return
			}
			if v < 0 || v > 1 {
				d.errorAt(f.at, f.rng(), "Invalid panic_threshold",
					fmt.Sprintf("panic_threshold %v is not a share between 0 and 1 (0.5 holds endpoints when more than half fail at once).", v))
				return
			}
			c.guard().Threshold = v
		}},
		{name: "panic_grace", decode: func(d *decoder, f field, c *poolConsul) {
			s, ok := d.str(f.at, f.attr.Expr)
			if !ok {
				return
			}
			dur, err := time.ParseDuration(s)
			if err != nil || dur < 0 {
				d.errorAt(f.at, f.rng(), "Invalid duration",
					fmt.Sprintf("panic_grace %q is not a duration of 0 or more; write it like \"30s\" (\"0s\" turns the guard off).", s))
				return
			}
			c.guard().Grace = dur
		}},
	})

	schedulingBody = newBody([]attr[*registry.Scheduling]{
		strAttr("profile", func(s *registry.Scheduling, v string) { s.Profile = v }),
		strAttr("picker", func(s *registry.Scheduling, v string) { s.Picker = v }),
		durationAttr("scrape_interval", func(s *registry.Scheduling, ms int) { s.ScrapeIntervalMS = ms }),
		durationAttr("idle_scrape_interval", func(s *registry.Scheduling, ms int) { s.IdleScrapeIntervalMS = ms }),
		boolAttr("adapters_on_demand", func(s *registry.Scheduling, v bool) { s.AdaptersOnDemand = v }),
		intAttr("queue_threshold", func(s *registry.Scheduling, v int) { s.QueueThreshold = v }),
		numAttr("kv_threshold", func(s *registry.Scheduling, v float64) { s.KVThreshold = v }),
		strAttr("session_header", func(s *registry.Scheduling, v string) { s.SessionHeader = strings.ToLower(v) }, headerName),
		{name: "scorers", decode: (*decoder).scorers},
		{name: "metrics", decode: (*decoder).metricNames},
	})

	// admissionBody is a pool's admission block: its admission queue.
	admissionBody = newBody([]attr[*registry.Admission]{
		boolAttr("enabled", func(a *registry.Admission, v bool) { a.Disabled = !v }),
		intAttr("max_queued", func(a *registry.Admission, v int) { a.MaxQueued = v }),
		intAttr("max_queued_bytes", func(a *registry.Admission, v int) { a.MaxQueuedBytes = int64(v) }),
		intAttr("band_max_queued", func(a *registry.Admission, v int) { a.BandMaxQueued = v }),
		durationAttr("ttl", func(a *registry.Admission, ms int) { a.TTL = time.Duration(ms) * time.Millisecond }),
		durationAttr("no_endpoint_wait", func(a *registry.Admission, ms int) { a.NoEndpointWait = time.Duration(ms) * time.Millisecond }),
		strAttr("fairness", func(a *registry.Admission, v string) { a.Fairness = v }),
		boolAttr("shed_sheddable", func(a *registry.Admission, v bool) { a.QueueSheddable = !v }),
		strAttr("flow_header", func(a *registry.Admission, v string) { a.FlowHeader = strings.ToLower(v) }, headerName),
		strAttr("priority_header", func(a *registry.Admission, v string) { a.PriorityHeader = strings.ToLower(v) }, headerName),
		intAttr("priority_min", func(a *registry.Admission, v int) { a.PriorityMin = v }),
		intAttr("priority_max", func(a *registry.Admission, v int) { a.PriorityMax = v }),
	})

	endpointBody = newBody([]attr[*registry.Endpoint]{
		boolAttr("draining", func(e *registry.Endpoint, v bool) { e.Draining = v }),
		strAttr("metrics_path", func(e *registry.Endpoint, v string) { e.MetricsPath = v }),
		listAttr("models", func(e *registry.Endpoint, v []string) { e.Models = v }),
		strAttr("role", func(e *registry.Endpoint, v string) { e.Role, _ = registry.ParseRole(v) }, roleName),
	}, hcl.BlockHeaderSchema{Type: "kv_events"})

	modelBody = newBody([]attr[*registry.Model]{
		strAttr("pool", func(m *registry.Model, v string) { m.Pool = v }).required(),
		intAttr("priority", func(m *registry.Model, v int) { m.Priority = v }),
	}, hcl.BlockHeaderSchema{Type: "target", LabelNames: []string{"name"}}, hcl.BlockHeaderSchema{Type: "disaggregation"})

	targetBody = newBody([]attr[*registry.Target]{
		intAttr("weight", func(t *registry.Target, v int) { t.Weight = v }),
	})
)

// poolConsul is what a pool's consul block decodes into: the selector and
// the discovery guard's settings (nil: the defaults).
type poolConsul struct {
	sel registry.ConsulSelector
	g   *registry.Guard
}

// guard returns the block's guard settings, created with the defaults on
// first use so that setting one attribute keeps the other's default.
func (c *poolConsul) guard() *registry.Guard {
	if c.g == nil {
		c.g = &registry.Guard{Threshold: registry.DefaultGuardThreshold, Grace: registry.DefaultGuardGrace}
	}
	return c.g
}

// agentBlank is the detail of an empty attribute in the consul block.
const agentBlank = "The consul block's %s is empty; leave it out to use the environment."

func isBlank(s string) bool { return strings.TrimSpace(s) == "" }

// consulAddress rejects what cannot be a Consul HTTP address.
func consulAddress(_, v string) (string, string) {
	if strings.ContainsAny(v, " \t\r\n") || (!strings.Contains(v, "://") && !strings.Contains(v, ":")) {
		return "Invalid Consul address", fmt.Sprintf("%q is not a Consul HTTP address; write \"host:port\", \"https://host:port\" or \"unix:///path\".", v)
	}
	return "", ""
}

// consulName rejects what cannot be a Consul service, tag or datacenter
// name.
func consulName(name, v string) (string, string) {
	if strings.TrimSpace(v) != v || name == "service" && (v == "" || strings.ContainsAny(v, "/?#")) {
		return "Invalid consul " + name, fmt.Sprintf("%q is not a valid Consul %s name.", v, name)
	}
	return "", ""
}

// headerName rejects what cannot be an HTTP header name.
func headerName(name, v string) (string, string) {
	if v == "" || strings.ContainsAny(v, " \t:\r\n") {
		return "Invalid " + name, fmt.Sprintf("%q is not a valid HTTP header name.", v)
	}
	return "", ""
}

// roleName rejects what is not an endpoint role.
func roleName(_, v string) (string, string) {
	if _, err := registry.ParseRole(v); err != nil || strings.TrimSpace(v) == "" {
		return "Invalid role", fmt.Sprintf("%q is not a role; write %s.", v, strings.Join(quoted(registry.Roles), ", "))
	}
	return "", ""
}

func quoted(xs []string) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = fmt.Sprintf("%q", x)
	}
	return out
}

// disaggregationBlock decodes a pool's or model's disaggregation block
// (obj), reporting a second one at its position.
func (d *decoder) disaggregationBlock(obj loc, what string, b *hcl.Block, first **hcl.Range) *registry.Disaggregation {
	if *first != nil {
		d.errorAt(obj.with("disaggregation"), b.DefRange, "Duplicate disaggregation block",
			fmt.Sprintf("%s already has a disaggregation block at %s.", what, pos(**first)))
		return nil
	}
	*first = b.DefRange.Ptr()
	d.ranges[obj.with("disaggregation")] = b.DefRange
	g := &registry.Disaggregation{DeclRange: pos(b.DefRange)}
	decodeBody(d, b.Body, disaggregationBody, obj.at("disaggregation."), g)
	return g
}

// loc names an object or one of its attributes, matching the Kind, Name,
// Pool and Field of a registry.ValidationError.
type loc struct {
	kind, name, pool, field string
}

// decoder turns parsed files into one registry.Update, remembering where
// every object and attribute was written so that problems found later by
// registry.Validate can be reported at the right file:line:column.
type decoder struct {
	diags  hcl.Diagnostics
	ranges map[loc]hcl.Range
	// tainted marks objects, or single fields of them, that already have a
	// decode error; Validate's view of the same problem is not repeated.
	tainted map[loc]bool

	pools     map[string]*registry.Pool
	models    map[string]*registry.Model
	listeners map[string]*registry.Listener
	routing   *registry.Routing
	replicas  *replicasBlock
	agent     *ConsulAgent
	tls       *TLS
	tenants   map[string]*registry.Tenant
	// tenantSettings is the tenants block (nil: none).
	tenantSettings *registry.TenantSettings
	// upstream says where each pool takes its upstream API key from.
	upstream map[string]*upstreamRef
	// keyFiles are the files holding API keys or their hashes that the
	// configuration names (watched besides the configuration itself).
	keyFiles []string
	tracing  *Tracing
	// first declaration of each object, for "already defined at" details.
	declared map[loc]hcl.Range
	// per pool: canonical endpoint address -> where it was declared.
	endpointAt map[string]map[string]hcl.Range
	// listener names in declaration order.
	listenerOrder []string
}

func newDecoder() *decoder {
	return &decoder{
		ranges:     map[loc]hcl.Range{},
		tainted:    map[loc]bool{},
		pools:      map[string]*registry.Pool{},
		models:     map[string]*registry.Model{},
		listeners:  map[string]*registry.Listener{},
		tenants:    map[string]*registry.Tenant{},
		upstream:   map[string]*upstreamRef{},
		declared:   map[loc]hcl.Range{},
		endpointAt: map[string]map[string]hcl.Range{},
	}
}

// pos formats the start of r as "file:line:column".
func pos(r hcl.Range) string {
	return fmt.Sprintf("%s:%d:%d", r.Filename, r.Start.Line, r.Start.Column)
}

// errorAt reports a problem at r and marks obj (an object, or one field of
// it) as already reported, so that registry.Validate's view of the same
// problem is not reported twice.
func (d *decoder) errorAt(obj loc, r hcl.Range, summary, detail string) {
	d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: summary, Detail: detail, Subject: r.Ptr()})
	d.tainted[obj] = true
}

// add records diags; it reports false (and taints obj) when they hold an
// error.
func (d *decoder) add(obj loc, diags hcl.Diagnostics) bool {
	d.diags = append(d.diags, diags...)
	if diags.HasErrors() {
		d.tainted[obj] = true
		return false
	}
	return true
}

func (l loc) with(field string) loc {
	l.field = field
	return l
}

// declare records a new top-level object and reports a duplicate.
func (d *decoder) declare(kind, name string, b *hcl.Block) bool {
	k := loc{kind: kind, name: name}
	if first, dup := d.declared[k]; dup {
		what := kind
		if name != "" {
			what = fmt.Sprintf("%s %q", kind, name)
		}
		detail := fmt.Sprintf("The %s was already defined at %s. Each %s name may be used only once across all configuration files.", what, pos(first), kind)
		if name == "" {
			detail = fmt.Sprintf("A %s block was already defined at %s. Only one is allowed across all configuration files.", kind, pos(first))
		}
		d.diags = append(d.diags, &hcl.Diagnostic{
			Severity: hcl.DiagError,
			Summary:  "Duplicate " + kind,
			Detail:   detail,
			Subject:  b.DefRange.Ptr(),
		})
		return false
	}
	d.declared[k] = b.DefRange
	d.ranges[k] = b.DefRange
	return true
}

func (d *decoder) file(body hcl.Body) {
	content, diags := body.Content(rootSchema)
	d.diags = append(d.diags, diags...)
	for _, b := range content.Blocks {
		switch b.Type {
		case "listener":
			d.listener(b)
		case "routing":
			d.routingBlock(b)
		case "replicas":
			d.replicasBlock(b)
		case "pool":
			d.pool(b)
		case "model":
			d.model(b)
		case "consul":
			d.agentBlock(b)
		case "tls":
			d.tlsBlock(b)
		case "tenant":
			d.tenant(b)
		case "tenants":
			d.tenantsBlock(b)
		case "tracing":
			d.tracingBlock(b)
		}
	}
}

// ConsulAgent is the top-level consul block: how switchyard reaches the
// Consul HTTP API. Set fields override the CONSUL_HTTP_* environment
// variables; unset ones leave them in force.
type ConsulAgent struct {
	Address   string // "host:port", "http(s)://host:port" or "unix:///path"
	Token     string
	TokenFile string
	TLS       ConsulTLS
}

// ConsulTLS is the consul block's tls block.
type ConsulTLS struct {
	ServerName, CAFile, CAPath, CertFile, KeyFile string
	InsecureSkipVerify                            bool
}

// at returns where the attributes of the block obj (under the field
// prefix, "" for none) are reported.
func (l loc) at(prefix string) func(name string) loc {
	return func(name string) loc { return l.with(prefix + name) }
}

func (d *decoder) agentBlock(b *hcl.Block) {
	const kind = "consul"
	if !d.declare(kind, "", b) {
		return
	}
	obj := loc{kind: kind}
	ag := &ConsulAgent{}
	d.agent = ag
	content := decodeBody(d, b.Body, agentBody, obj.at(""), ag)
	if ag.Token != "" && ag.TokenFile != "" {
		d.errorAt(obj.with("token_file"), content.Attributes["token_file"].Expr.Range(), "Conflicting Consul tokens",
			"Set token or token_file, not both.")
	}
	seenTLS := false
	for _, tb := range content.Blocks {
		if seenTLS {
			d.errorAt(obj.with("tls"), tb.DefRange, "Duplicate tls block", "The consul block may have one tls block.")
			continue
		}
		seenTLS = true
		decodeBody(d, tb.Body, agentTLSBody, obj.at(""), &ag.TLS)
		if (ag.TLS.CertFile == "") != (ag.TLS.KeyFile == "") {
			d.errorAt(obj.with("tls"), tb.DefRange, "Incomplete client certificate", "Set both cert_file and key_file, or neither.")
		}
	}
}

func (d *decoder) checkLabel(kind string, b *hcl.Block) bool {
	if strings.TrimSpace(b.Labels[0]) == "" {
		d.diags = append(d.diags, &hcl.Diagnostic{
			Severity: hcl.DiagError,
			Summary:  "Empty " + kind + " name",
			Detail:   fmt.Sprintf("A %s block needs a non-empty name label.", kind),
			Subject:  b.LabelRanges[0].Ptr(),
		})
		return false
	}
	return true
}

func (d *decoder) listener(b *hcl.Block) {
	name := b.Labels[0]
	if !d.checkLabel("listener", b) || !d.declare(registry.KindListener, name, b) {
		return
	}
	l := &registry.Listener{Name: name, DeclRange: pos(b.DefRange)}
	d.listeners[name] = l
	d.listenerOrder = append(d.listenerOrder, name)
	decodeBody(d, b.Body, listenerBody, loc{kind: registry.KindListener, name: name}.at(""), l)
}

// replicasBlock is what the replicas block decodes into.
type replicasBlock struct {
	disc  registry.ReplicaDiscovery
	peers []registry.Replica
}

func (d *decoder) replicasBlock(b *hcl.Block) {
	if !d.declare(registry.KindReplicas, "", b) {
		return
	}
	d.replicas = &replicasBlock{disc: registry.ReplicaDiscovery{DeclRange: pos(b.DefRange)}}
	decodeBody(d, b.Body, replicasBody, loc{kind: registry.KindReplicas}.at(""), d.replicas)
	if d.replicas.disc.ConsulService == "" && len(d.replicas.peers) == 0 {
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Empty replicas block",
			Detail:  "Say how replicas find each other: consul_service = \"switchyard\" (each registers itself in Consul) and/or peers = [\"ip:port\", ...] (every replica's picker address).",
			Subject: b.DefRange.Ptr()})
	}
}

func (d *decoder) routingBlock(b *hcl.Block) {
	if !d.declare(registry.KindRouting, "", b) {
		return
	}
	d.routing = &registry.Routing{}
	decodeBody(d, b.Body, routingBody, loc{kind: registry.KindRouting}.at(""), d.routing)
}

func (d *decoder) pool(b *hcl.Block) {
	name := b.Labels[0]
	if !d.checkLabel("pool", b) || !d.declare(registry.KindPool, name, b) {
		return
	}
	obj := loc{kind: registry.KindPool, name: name}
	p := &registry.Pool{
		Name:        name,
		Engine:      DefaultEngine,
		FailureMode: DefaultFailureMode,
		MetricsPath: DefaultMetricsPath,
		DeclRange:   pos(b.DefRange),
	}
	d.pools[name] = p
	d.endpointAt[name] = map[string]hcl.Range{}
	content := decodeBody(d, b.Body, poolBody, obj.at(""), p)
	d.upstreamKey(p)
	var schedAt, consulAt, admissionAt, disaggAt, kvAt *hcl.Range
	for _, sb := range content.Blocks {
		switch sb.Type {
		case "disaggregation":
			if g := d.disaggregationBlock(obj, fmt.Sprintf("Pool %q", name), sb, &disaggAt); g != nil {
				p.Disaggregation = g
			}
		case "kv_events":
			if kvAt != nil {
				d.errorAt(obj.with("kv_events"), sb.DefRange, "Duplicate kv_events block",
					fmt.Sprintf("Pool %q already has a kv_events block at %s.", name, pos(*kvAt)))
				continue
			}
			kvAt = sb.DefRange.Ptr()
			p.KVEvents = d.kvEvents(obj, sb)
		case "admission":
			if admissionAt != nil {
				d.errorAt(obj.with("admission"), sb.DefRange, "Duplicate admission block",
					fmt.Sprintf("Pool %q already has an admission block at %s.", name, pos(*admissionAt)))
				continue
			}
			admissionAt = sb.DefRange.Ptr()
			p.Admission = &registry.Admission{}
			decodeBody(d, sb.Body, admissionBody, obj.at("admission."), p.Admission)
		case "scheduling":
			if schedAt != nil {
				d.errorAt(obj.with("scheduling"), sb.DefRange, "Duplicate scheduling block",
					fmt.Sprintf("Pool %q already has a scheduling block at %s.", name, pos(*schedAt)))
				continue
			}
			schedAt = sb.DefRange.Ptr()
			p.Scheduling = &registry.Scheduling{}
			decodeBody(d, sb.Body, schedulingBody, obj.at("scheduling."), p.Scheduling)
		case "endpoint":
			d.endpointBlock(p, obj, sb)
		case "consul":
			if consulAt != nil {
				d.errorAt(obj.with("consul"), sb.DefRange, "Duplicate consul block",
					fmt.Sprintf("Pool %q already has a consul block at %s.", name, pos(*consulAt)))
				continue
			}
			consulAt = sb.DefRange.Ptr()
			pc := &poolConsul{}
			decodeBody(d, sb.Body, consulBody, obj.at("consul."), pc)
			p.Consul, p.Guard = &pc.sel, pc.g
		}
	}
	if p.Disaggregation == nil {
		for _, ep := range p.Endpoints {
			at := loc{kind: registry.KindEndpoint, name: ep.Address, pool: name, field: "role"}
			if r, ok := d.ranges[at]; ok && ep.Role != registry.RoleBoth {
				d.errorAt(at, r, "Role without disaggregation",
					fmt.Sprintf("Endpoint %s has role %q, but pool %q has no disaggregation block: add one (see docs/configuration.md), or remove the role.", ep.Address, ep.Role, name))
			}
		}
	}
}

// poolEndpoints decodes a pool's endpoints list.
func (d *decoder) poolEndpoints(f field, p *registry.Pool) {
	elems, diags := hcl.ExprList(f.attr.Expr)
	if !d.add(f.at, diags) {
		return
	}
	for _, e := range elems {
		if s, ok := d.str(f.at, e); ok {
			d.endpoint(p, f.at, e.Range(), s, registry.Endpoint{})
		}
	}
}

// endpoint canonicalises addr and adds it to p unless it is a duplicate;
// problems are reported at at.
func (d *decoder) endpoint(p *registry.Pool, at loc, r hcl.Range, addr string, ep registry.Endpoint) {
	canon, ok := d.address(at, r, addr, true)
	if !ok {
		return
	}
	if first, dup := d.endpointAt[p.Name][canon]; dup {
		d.errorAt(at, r, "Duplicate endpoint",
			fmt.Sprintf("Endpoint %s of pool %q was already defined at %s.", canon, p.Name, pos(first)))
		return
	}
	d.endpointAt[p.Name][canon] = r
	d.ranges[loc{kind: registry.KindEndpoint, name: canon, pool: p.Name, field: "address"}] = r
	ep.Address = canon
	p.Endpoints = append(p.Endpoints, ep)
}

// address returns the canonical address, or s unchanged and false after
// reporting the problem.
func (d *decoder) address(obj loc, r hcl.Range, s string, endpoint bool) (string, bool) {
	canon, err := registry.CanonicalAddress(s, endpoint)
	if err != nil {
		d.errorAt(obj, r, "Invalid address", capitalize(strings.TrimPrefix(err.Error(), registry.ErrBadAddress.Error()+" "))+".")
		return s, false
	}
	return canon, true
}

// endpointBlock decodes an endpoint block of pool p (at pool).
func (d *decoder) endpointBlock(p *registry.Pool, pool loc, b *hcl.Block) {
	var ep registry.Endpoint
	canon, _ := registry.CanonicalAddress(b.Labels[0], true)
	obj := loc{kind: registry.KindEndpoint, name: canon, pool: p.Name}
	content := decodeBody(d, b.Body, endpointBody, obj.at(""), &ep)
	for i, kb := range content.Blocks {
		if i > 0 {
			d.errorAt(obj.with("kv_events"), kb.DefRange, "Duplicate kv_events block",
				fmt.Sprintf("Endpoint %s already has a kv_events block at %s.", b.Labels[0], pos(content.Blocks[0].DefRange)))
			continue
		}
		ep.KVEvents = d.kvEvents(obj, kb)
	}
	d.endpoint(p, pool.with("endpoints"), b.LabelRanges[0], b.Labels[0], ep)
}

// kvEvents decodes a kv_events block of the pool or endpoint obj.
func (d *decoder) kvEvents(obj loc, b *hcl.Block) *registry.KVEvents {
	kv := &registry.KVEvents{}
	d.ranges[obj.with("kv_events")] = b.DefRange
	decodeBody(d, b.Body, kvEventsBody, obj.at("kv_events."), kv)
	return kv
}

// scorers decodes scheduling.scorers, a map of scorer name to weight.
func (d *decoder) scorers(f field, sc *registry.Scheduling) {
	pairs, diags := hcl.ExprMap(f.attr.Expr)
	if !d.add(f.at, diags) {
		return
	}
	sc.Scorers = map[string]float64{}
	for _, kv := range pairs {
		k, ok := d.str(f.at, kv.Key)
		if !ok {
			continue
		}
		// HCL users write kv_cache as readily as kv-cache.
		k = strings.ReplaceAll(k, "_", "-")
		if v, ok := d.number(f.sub(k), kv.Value); ok {
			sc.Scorers[k] = v
			d.ranges[f.sub(k)] = kv.Value.Range()
		}
	}
}

// metricNames decodes scheduling.metrics, a map of metric to the engine's
// name for it.
func (d *decoder) metricNames(f field, sc *registry.Scheduling) {
	pairs, diags := hcl.ExprMap(f.attr.Expr)
	if !d.add(f.at, diags) {
		return
	}
	sc.Metrics = map[string]string{}
	for _, kv := range pairs {
		k, ok := d.str(f.at, kv.Key)
		if !ok {
			continue
		}
		if v, ok := d.str(f.sub(k), kv.Value); ok {
			sc.Metrics[k] = v
			d.ranges[f.sub(k)] = kv.Key.Range()
		}
	}
}

func (d *decoder) model(b *hcl.Block) {
	name := b.Labels[0]
	if !d.checkLabel("model", b) || !d.declare(registry.KindModel, name, b) {
		return
	}
	obj := loc{kind: registry.KindModel, name: name}
	m := &registry.Model{Name: name, DeclRange: pos(b.DefRange)}
	d.models[name] = m
	content := decodeBody(d, b.Body, modelBody, obj.at(""), m)
	seen := map[string]hcl.Range{}
	var disaggAt *hcl.Range
	for _, tb := range content.Blocks {
		if tb.Type == "disaggregation" {
			if g := d.disaggregationBlock(obj, fmt.Sprintf("Model %q", name), tb, &disaggAt); g != nil {
				m.Disaggregation = g
			}
			continue
		}
		tname := tb.Labels[0]
		if first, dup := seen[tname]; dup {
			d.errorAt(obj.with("target."+tname), tb.DefRange, "Duplicate target",
				fmt.Sprintf("Model %q already has a target %q at %s.", name, tname, pos(first)))
			continue
		}
		seen[tname] = tb.DefRange
		t := registry.Target{Name: tname, Weight: DefaultTargetWeight}
		d.ranges[obj.with("target."+tname)] = tb.DefRange
		decodeBody(d, tb.Body, targetBody, obj.at("target."+tname+"."), &t)
		m.Targets = append(m.Targets, t)
	}
}

// value evaluates a literal expression (no variables or functions) and
// converts it to want.
func (d *decoder) value(obj loc, expr hcl.Expression, want cty.Type) (cty.Value, bool) {
	v, diags := expr.Value(nil)
	if !d.add(obj, diags) {
		return cty.NilVal, false
	}
	if v.IsNull() {
		d.errorAt(obj, expr.Range(), "Missing value", "A value is required here, not null.")
		return cty.NilVal, false
	}
	cv, err := convert.Convert(v, want)
	if err != nil {
		d.errorAt(obj, expr.Range(), "Incorrect value type",
			fmt.Sprintf("Expected a %s, got a %s.", want.FriendlyName(), v.Type().FriendlyName()))
		return cty.NilVal, false
	}
	return cv, true
}

func (d *decoder) str(obj loc, expr hcl.Expression) (string, bool) {
	v, ok := d.value(obj, expr, cty.String)
	if !ok {
		return "", false
	}
	return v.AsString(), true
}

func (d *decoder) boolean(obj loc, expr hcl.Expression) (bool, bool) {
	v, ok := d.value(obj, expr, cty.Bool)
	if !ok {
		return false, false
	}
	return v.True(), true
}

func (d *decoder) number(obj loc, expr hcl.Expression) (float64, bool) {
	v, ok := d.value(obj, expr, cty.Number)
	if !ok {
		return 0, false
	}
	f, _ := v.AsBigFloat().Float64()
	return f, true
}

func (d *decoder) integer(obj loc, expr hcl.Expression) (int, bool) {
	v, ok := d.value(obj, expr, cty.Number)
	if !ok {
		return 0, false
	}
	bf := v.AsBigFloat()
	if !bf.IsInt() {
		d.errorAt(obj, expr.Range(), "Incorrect value type", "Expected a whole number.")
		return 0, false
	}
	i, acc := bf.Int64()
	if acc != big.Exact || i > 1<<31-1 || i < -(1<<31) {
		d.errorAt(obj, expr.Range(), "Incorrect value type", "The number is out of range.")
		return 0, false
	}
	return int(i), true
}

// capitalize upper-cases the first letter of a message, unless its first
// word is an attribute name such as kv_threshold.
func capitalize(s string) string {
	first, _, _ := strings.Cut(s, " ")
	if s == "" || strings.Contains(first, "_") {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}
