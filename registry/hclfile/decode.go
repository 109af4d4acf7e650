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
		{Type: "pool", LabelNames: []string{"name"}},
		{Type: "model", LabelNames: []string{"name"}},
		{Type: "consul"},
		{Type: "tls"},
	},
}

// agentSchema is the top-level consul block: how to reach the Consul agent.
var agentSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "address"},
		{Name: "token"},
		{Name: "token_file"},
	},
	Blocks: []hcl.BlockHeaderSchema{{Type: "tls"}},
}

var agentTLSSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "server_name"},
		{Name: "ca_file"},
		{Name: "ca_path"},
		{Name: "cert_file"},
		{Name: "key_file"},
		{Name: "insecure_skip_verify"},
	},
}

var listenerSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{{Name: "address", Required: true}},
}

var routingSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{{Name: "default_pool"}},
}

var poolSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "endpoints"},
		{Name: "engine"},
		{Name: "failure_mode"},
		{Name: "metrics_path"},
	},
	Blocks: []hcl.BlockHeaderSchema{
		{Type: "scheduling"},
		{Type: "endpoint", LabelNames: []string{"address"}},
		{Type: "consul"},
	},
}

var consulSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "service", Required: true},
		{Name: "tag"},
		{Name: "datacenter"},
		{Name: "passing_only"},
		{Name: "panic_threshold"},
		{Name: "panic_grace"},
	},
}

var schedulingSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "profile"},
		{Name: "picker"},
		{Name: "scrape_interval"},
		{Name: "queue_threshold"},
		{Name: "kv_threshold"},
		{Name: "session_header"},
		{Name: "adapters_on_demand"},
		{Name: "scorers"},
		{Name: "metrics"},
	},
}

var endpointSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "draining"},
		{Name: "metrics_path"},
		{Name: "models"},
	},
}

var modelSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{
		{Name: "pool", Required: true},
		{Name: "priority"},
	},
	Blocks: []hcl.BlockHeaderSchema{
		{Type: "target", LabelNames: []string{"name"}},
	},
}

var targetSchema = &hcl.BodySchema{
	Attributes: []hcl.AttributeSchema{{Name: "weight"}},
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
	agent     *ConsulAgent
	tls       *TLS
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

// required taints obj's field when a required attribute is missing (the
// schema already reported it).
func (d *decoder) required(obj loc, attrs hcl.Attributes, name string) {
	if _, ok := attrs[name]; !ok {
		obj.field = name
		d.tainted[obj] = true
	}
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
		case "pool":
			d.pool(b)
		case "model":
			d.model(b)
		case "consul":
			d.agentBlock(b)
		case "tls":
			d.tlsBlock(b)
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

func (d *decoder) agentBlock(b *hcl.Block) {
	const kind = "consul"
	if !d.declare(kind, "", b) {
		return
	}
	obj := loc{kind: kind}
	ag := &ConsulAgent{}
	d.agent = ag
	content, diags := b.Body.Content(agentSchema)
	d.diags = append(d.diags, diags...)
	strAttr := func(attrs hcl.Attributes, name string, dst *string) {
		a, ok := attrs[name]
		if !ok {
			return
		}
		v, ok := d.str(obj.with(name), a.Expr)
		if !ok {
			return
		}
		if strings.TrimSpace(v) == "" {
			d.errorAt(obj.with(name), a.Expr.Range(), "Empty "+name, fmt.Sprintf("The consul block's %s is empty; leave it out to use the environment.", name))
			return
		}
		*dst = v
	}
	attrs := content.Attributes
	strAttr(attrs, "address", &ag.Address)
	strAttr(attrs, "token", &ag.Token)
	strAttr(attrs, "token_file", &ag.TokenFile)
	if a, ok := attrs["address"]; ok && ag.Address != "" {
		if strings.ContainsAny(ag.Address, " \t\r\n") || (!strings.Contains(ag.Address, "://") && !strings.Contains(ag.Address, ":")) {
			d.errorAt(obj.with("address"), a.Expr.Range(), "Invalid Consul address",
				fmt.Sprintf("%q is not a Consul HTTP address; write \"host:port\", \"https://host:port\" or \"unix:///path\".", ag.Address))
		}
	}
	if ag.Token != "" && ag.TokenFile != "" {
		d.errorAt(obj.with("token_file"), attrs["token_file"].Expr.Range(), "Conflicting Consul tokens",
			"Set token or token_file, not both.")
	}
	seenTLS := false
	for _, tb := range content.Blocks {
		if seenTLS {
			d.errorAt(obj.with("tls"), tb.DefRange, "Duplicate tls block", "The consul block may have one tls block.")
			continue
		}
		seenTLS = true
		tc, diags := tb.Body.Content(agentTLSSchema)
		d.diags = append(d.diags, diags...)
		ta := tc.Attributes
		strAttr(ta, "server_name", &ag.TLS.ServerName)
		strAttr(ta, "ca_file", &ag.TLS.CAFile)
		strAttr(ta, "ca_path", &ag.TLS.CAPath)
		strAttr(ta, "cert_file", &ag.TLS.CertFile)
		strAttr(ta, "key_file", &ag.TLS.KeyFile)
		if a, ok := ta["insecure_skip_verify"]; ok {
			if v, ok := d.boolean(obj.with("insecure_skip_verify"), a.Expr); ok {
				ag.TLS.InsecureSkipVerify = v
			}
		}
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
	obj := loc{kind: registry.KindListener, name: name}
	l := &registry.Listener{Name: name, DeclRange: pos(b.DefRange)}
	d.listeners[name] = l
	d.listenerOrder = append(d.listenerOrder, name)
	content, diags := b.Body.Content(listenerSchema)
	d.diags = append(d.diags, diags...)
	d.required(obj, content.Attributes, "address")
	if a, ok := content.Attributes["address"]; ok {
		if s, ok := d.str(obj.with("address"), a.Expr); ok {
			l.Address, _ = d.address(obj.with("address"), a.Expr.Range(), s, false)
			d.ranges[loc{kind: registry.KindListener, name: name, field: "address"}] = a.Expr.Range()
		}
	}
}

func (d *decoder) routingBlock(b *hcl.Block) {
	if !d.declare(registry.KindRouting, "", b) {
		return
	}
	obj := loc{kind: registry.KindRouting}
	d.routing = &registry.Routing{}
	content, diags := b.Body.Content(routingSchema)
	d.diags = append(d.diags, diags...)
	if a, ok := content.Attributes["default_pool"]; ok {
		if s, ok := d.str(obj.with("default_pool"), a.Expr); ok {
			d.routing.DefaultPool = s
			d.ranges[loc{kind: registry.KindRouting, field: "default_pool"}] = a.Expr.Range()
		}
	}
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
	content, diags := b.Body.Content(poolSchema)
	d.diags = append(d.diags, diags...)
	field := func(f string, a *hcl.Attribute) {
		d.ranges[loc{kind: registry.KindPool, name: name, field: f}] = a.Expr.Range()
	}
	if a, ok := content.Attributes["engine"]; ok {
		if s, ok := d.str(obj.with("engine"), a.Expr); ok {
			p.Engine = registry.Engine(s)
			field("engine", a)
		}
	}
	if a, ok := content.Attributes["failure_mode"]; ok {
		if s, ok := d.str(obj.with("failure_mode"), a.Expr); ok {
			p.FailureMode = registry.FailureMode(s)
			field("failure_mode", a)
		}
	}
	if a, ok := content.Attributes["metrics_path"]; ok {
		if s, ok := d.str(obj.with("metrics_path"), a.Expr); ok {
			p.MetricsPath = s
			field("metrics_path", a)
		}
	}
	if a, ok := content.Attributes["endpoints"]; ok {
		elems, diags := hcl.ExprList(a.Expr)
		if d.add(obj.with("endpoints"), diags) {
			for _, e := range elems {
				if s, ok := d.str(obj.with("endpoints"), e); ok {
					d.endpoint(p, obj, e.Range(), s, registry.Endpoint{})
				}
			}
		}
	}
	var schedAt, consulAt *hcl.Range
	for _, sb := range content.Blocks {
		switch sb.Type {
		case "scheduling":
			if schedAt != nil {
				d.errorAt(obj.with("scheduling"), sb.DefRange, "Duplicate scheduling block",
					fmt.Sprintf("Pool %q already has a scheduling block at %s.", name, pos(*schedAt)))
				continue
			}
			schedAt = sb.DefRange.Ptr()
			p.Scheduling = d.scheduling(obj, sb)
		case "endpoint":
			d.endpointBlock(p, obj, sb)
		case "consul":
			if consulAt != nil {
				d.errorAt(obj.with("consul"), sb.DefRange, "Duplicate consul block",
					fmt.Sprintf("Pool %q already has a consul block at %s.", name, pos(*consulAt)))
				continue
			}
			consulAt = sb.DefRange.Ptr()
			p.Consul, p.Guard = d.consul(obj, sb)
		}
	}
}

// consul decodes a pool's consul block: which Consul service instances
// join the pool, and the discovery guard's settings (nil: defaults).
func (d *decoder) consul(obj loc, b *hcl.Block) (*registry.ConsulSelector, *registry.Guard) {
	sel := &registry.ConsulSelector{}
	content, diags := b.Body.Content(consulSchema)
	d.diags = append(d.diags, diags...)
	at := func(f string) loc { return obj.with("consul." + f) }
	if _, ok := content.Attributes["service"]; !ok {
		d.tainted[at("service")] = true // the schema reported it
	}
	strAttr := func(name string, dst *string) {
		if a, ok := content.Attributes[name]; ok {
			if s, ok := d.str(at(name), a.Expr); ok {
				if strings.TrimSpace(s) != s || name == "service" && (s == "" || strings.ContainsAny(s, "/?#")) {
					d.errorAt(at(name), a.Expr.Range(), "Invalid consul "+name,
						fmt.Sprintf("%q is not a valid Consul %s name.", s, name))
					return
				}
				*dst = s
			}
		}
	}
	strAttr("service", &sel.Service)
	strAttr("tag", &sel.Tag)
	strAttr("datacenter", &sel.Datacenter)
	if a, ok := content.Attributes["passing_only"]; ok {
		if v, ok := d.boolean(at("passing_only"), a.Expr); ok {
			sel.PassingOnly = v
		}
	}
	var guard *registry.Guard
	if a, ok := content.Attributes["panic_threshold"]; ok {
		if f, ok := d.number(at("panic_threshold"), a.Expr); ok {
			if f < 0 || f > 1 {
				d.errorAt(at("panic_threshold"), a.Expr.Range(), "Invalid panic_threshold",
					fmt.Sprintf("panic_threshold %v is not a share between 0 and 1 (0.5 holds endpoints when more than half fail at once).", f))
			} else {
				guard = &registry.Guard{Threshold: f, Grace: registry.DefaultGuardGrace}
			}
		}
	}
	if a, ok := content.Attributes["panic_grace"]; ok {
		if s, ok := d.str(at("panic_grace"), a.Expr); ok {
			dur, err := time.ParseDuration(s)
			if err != nil || dur < 0 {
				d.errorAt(at("panic_grace"), a.Expr.Range(), "Invalid duration",
					fmt.Sprintf("panic_grace %q is not a duration of 0 or more; write it like \"30s\" (\"0s\" turns the guard off).", s))
			} else {
				if guard == nil {
					guard = &registry.Guard{Threshold: registry.DefaultGuardThreshold}
				}
				guard.Grace = dur
			}
		}
	}
	return sel, guard
}

// endpoint canonicalises addr and adds it to p unless it is a duplicate.
func (d *decoder) endpoint(p *registry.Pool, obj loc, r hcl.Range, addr string, ep registry.Endpoint) {
	canon, ok := d.address(obj.with("endpoints"), r, addr, true)
	if !ok {
		return
	}
	if first, dup := d.endpointAt[p.Name][canon]; dup {
		d.errorAt(obj.with("endpoints"), r, "Duplicate endpoint",
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

func (d *decoder) endpointBlock(p *registry.Pool, obj loc, b *hcl.Block) {
	content, diags := b.Body.Content(endpointSchema)
	d.diags = append(d.diags, diags...)
	var ep registry.Endpoint
	canon, _ := registry.CanonicalAddress(b.Labels[0], true)
	at := func(f string, a *hcl.Attribute) {
		d.ranges[loc{kind: registry.KindEndpoint, name: canon, pool: p.Name, field: f}] = a.Expr.Range()
	}
	if a, ok := content.Attributes["draining"]; ok {
		if v, ok := d.boolean(obj, a.Expr); ok {
			ep.Draining = v
		}
	}
	if a, ok := content.Attributes["metrics_path"]; ok {
		if s, ok := d.str(obj.with("metrics_path"), a.Expr); ok {
			ep.MetricsPath = s
			at("metrics_path", a)
		}
	}
	if a, ok := content.Attributes["models"]; ok {
		elems, diags := hcl.ExprList(a.Expr)
		if d.add(obj, diags) {
			for _, e := range elems {
				if s, ok := d.str(obj, e); ok {
					ep.Models = append(ep.Models, s)
				}
			}
		}
	}
	d.endpoint(p, obj, b.LabelRanges[0], b.Labels[0], ep)
}

func (d *decoder) scheduling(obj loc, b *hcl.Block) *registry.Scheduling {
	sc := &registry.Scheduling{}
	content, diags := b.Body.Content(schedulingSchema)
	d.diags = append(d.diags, diags...)
	at := func(f string) loc { return obj.with("scheduling." + f) }
	field := func(f string, r hcl.Range) {
		d.ranges[loc{kind: obj.kind, name: obj.name, field: "scheduling." + f}] = r
	}
	field("", b.DefRange)
	attrs := content.Attributes
	if a, ok := attrs["profile"]; ok {
		if s, ok := d.str(at("profile"), a.Expr); ok {
			sc.Profile = s
			field("profile", a.Expr.Range())
		}
	}
	if a, ok := attrs["picker"]; ok {
		if s, ok := d.str(at("picker"), a.Expr); ok {
			sc.Picker = s
			field("picker", a.Expr.Range())
		}
	}
	if a, ok := attrs["session_header"]; ok {
		if s, ok := d.str(at("session_header"), a.Expr); ok {
			sc.SessionHeader = strings.ToLower(s)
			if s == "" || strings.ContainsAny(s, " \t:\r\n") {
				d.errorAt(at("session_header"), a.Expr.Range(), "Invalid session_header", fmt.Sprintf("%q is not a valid HTTP header name.", s))
			}
		}
	}
	if a, ok := attrs["adapters_on_demand"]; ok {
		if v, ok := d.boolean(at("adapters_on_demand"), a.Expr); ok {
			sc.AdaptersOnDemand = v
			field("adapters_on_demand", a.Expr.Range())
		}
	}
	if a, ok := attrs["scrape_interval"]; ok {
		if s, ok := d.str(at("scrape_interval"), a.Expr); ok {
			dur, err := time.ParseDuration(s)
			switch {
			case err != nil:
				d.errorAt(at("scrape_interval"), a.Expr.Range(), "Invalid duration",
					fmt.Sprintf("scrape_interval %q is not a duration; write it like \"50ms\" or \"1s\".", s))
			case dur < time.Millisecond:
				d.errorAt(at("scrape_interval"), a.Expr.Range(), "Invalid duration",
					fmt.Sprintf("scrape_interval %q must be at least 1ms.", s))
			default:
				sc.ScrapeIntervalMS = int(dur / time.Millisecond)
			}
			field("scrape_interval", a.Expr.Range())
		}
	}
	if a, ok := attrs["queue_threshold"]; ok {
		if n, ok := d.integer(at("queue_threshold"), a.Expr); ok {
			sc.QueueThreshold = n
			field("queue_threshold", a.Expr.Range())
		}
	}
	if a, ok := attrs["kv_threshold"]; ok {
		if f, ok := d.number(at("kv_threshold"), a.Expr); ok {
			sc.KVThreshold = f
			field("kv_threshold", a.Expr.Range())
		}
	}
	if a, ok := attrs["scorers"]; ok {
		field("scorers", a.Expr.Range())
		pairs, diags := hcl.ExprMap(a.Expr)
		if d.add(at("scorers"), diags) {
			sc.Scorers = map[string]float64{}
			for _, kv := range pairs {
				k, ok := d.str(at("scorers"), kv.Key)
				if !ok {
					continue
				}
				// HCL users write kv_cache as readily as kv-cache.
				k = strings.ReplaceAll(k, "_", "-")
				if f, ok := d.number(at("scorers."+k), kv.Value); ok {
					sc.Scorers[k] = f
					field("scorers."+k, kv.Value.Range())
				}
			}
		}
	}
	if a, ok := attrs["metrics"]; ok {
		field("metrics", a.Expr.Range())
		pairs, diags := hcl.ExprMap(a.Expr)
		if d.add(at("metrics"), diags) {
			sc.Metrics = map[string]string{}
			for _, kv := range pairs {
				k, ok := d.str(at("metrics"), kv.Key)
				if !ok {
					continue
				}
				if s, ok := d.str(at("metrics."+k), kv.Value); ok {
					sc.Metrics[k] = s
					field("metrics."+k, kv.Key.Range())
				}
			}
		}
	}
	return sc
}

func (d *decoder) model(b *hcl.Block) {
	name := b.Labels[0]
	if !d.checkLabel("model", b) || !d.declare(registry.KindModel, name, b) {
		return
	}
	obj := loc{kind: registry.KindModel, name: name}
	m := &registry.Model{Name: name, DeclRange: pos(b.DefRange)}
	d.models[name] = m
	content, diags := b.Body.Content(modelSchema)
	d.diags = append(d.diags, diags...)
	d.required(obj, content.Attributes, "pool")
	if a, ok := content.Attributes["pool"]; ok {
		if s, ok := d.str(obj.with("pool"), a.Expr); ok {
			m.Pool = s
			d.ranges[loc{kind: registry.KindModel, name: name, field: "pool"}] = a.Expr.Range()
		}
	}
	if a, ok := content.Attributes["priority"]; ok {
		if n, ok := d.integer(obj.with("priority"), a.Expr); ok {
			m.Priority = n
		}
	}
	seen := map[string]hcl.Range{}
	for _, tb := range content.Blocks {
		tname := tb.Labels[0]
		if first, dup := seen[tname]; dup {
			d.errorAt(obj.with("target."+tname), tb.DefRange, "Duplicate target",
				fmt.Sprintf("Model %q already has a target %q at %s.", name, tname, pos(first)))
			continue
		}
		seen[tname] = tb.DefRange
		t := registry.Target{Name: tname, Weight: DefaultTargetWeight}
		d.ranges[loc{kind: registry.KindModel, name: name, field: "target." + tname}] = tb.DefRange
		tc, diags := tb.Body.Content(targetSchema)
		d.diags = append(d.diags, diags...)
		if a, ok := tc.Attributes["weight"]; ok {
			if n, ok := d.integer(obj.with("target."+tname+".weight"), a.Expr); ok {
				t.Weight = n
				d.ranges[loc{kind: registry.KindModel, name: name, field: "target." + tname + ".weight"}] = a.Expr.Range()
			}
		}
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
