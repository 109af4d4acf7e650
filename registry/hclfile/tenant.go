package hclfile

import (
	"fmt"
	"maps"
	"math/big"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/hcl/v2"
	"github.com/zclconf/go-cty/cty"

	"github.com/switchyard/switchyard/internal/apikey"
	"github.com/switchyard/switchyard/registry"
)

// DefaultCountCached is count_cached when a limits block leaves it out:
// cached prompt tokens count toward the token limits, as usage reports
// them (prompt_tokens includes them).
const DefaultCountCached = true

// The tenant blocks' attribute tables.
var (
	tenantsBody = newBody([]attr[*registry.TenantSettings]{
		boolAttr("hide_forbidden_models", func(s *registry.TenantSettings, v bool) { s.HideForbiddenModels = v }),
	})

	tenantBody = newBody([]attr[*registry.Tenant]{
		{name: "api_keys", decode: func(d *decoder, f field, t *registry.Tenant) {
			elems, diags := hcl.ExprList(f.attr.Expr)
			if !d.add(f.at, diags) {
				return
			}
			for _, e := range elems {
				s, ok := d.str(f.at, e)
				if !ok {
					continue
				}
				h, err := apikey.Canonical(s)
				if err != nil {
					d.errorAt(f.at, e.Range(), "Invalid API key hash", capitalize(err.Error())+".")
					continue
				}
				t.KeyHashes = append(t.KeyHashes, h)
			}
		}},
		strAttr("api_key_file", func(t *registry.Tenant, v string) { t.KeyFile = v }, notBlank("%s is empty; leave it out or name a file of API key hashes.")),
		listAttr("models", func(t *registry.Tenant, v []string) { t.Models = v }),
		intAttr("priority", func(t *registry.Tenant, v int) { t.Priority = &v }),
	}, hcl.BlockHeaderSchema{Type: "limits"})

	limitsBody = newBody([]attr[*registry.Limits]{
		countAttr("requests_per_minute", "unlimited", func(l *registry.Limits, v int64) { l.RequestsPerMinute = v }),
		countAttr("tokens_per_minute", "unlimited", func(l *registry.Limits, v int64) { l.TokensPerMinute = v }),
		countAttr("tokens_per_day", "unlimited", func(l *registry.Limits, v int64) { l.TokensPerDay = v }),
		boolAttr("count_cached", func(l *registry.Limits, v bool) { l.CountCached = v }),
		countAttr("assumed_max_tokens", "the default, "+strconv.Itoa(registry.DefaultAssumedMaxTokens), func(l *registry.Limits, v int64) { l.AssumedMaxTokens = v }),
	})
)

// countAttr decodes a whole number >= 0 (64-bit: a day's tokens exceed
// 32 bits) into x with set; zero says what 0 means, for the error.
func countAttr[T any](name, zero string, set func(x T, v int64)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		v, ok := d.value(f.at, f.attr.Expr, cty.Number)
		if !ok {
			return
		}
		bf := v.AsBigFloat()
		i, acc := bf.Int64()
		if !bf.IsInt() || acc != big.Exact || i < 0 {
			d.errorAt(f.at, f.rng(), "Invalid "+name, fmt.Sprintf("%s must be a whole number of 0 (%s) or more.", name, zero))
			return
		}
		set(x, i)
	}}
}

func (d *decoder) tenantsBlock(b *hcl.Block) {
	if !d.declare(registry.KindTenants, "", b) {
		return
	}
	d.tenantSettings = &registry.TenantSettings{DeclRange: pos(b.DefRange)}
	decodeBody(d, b.Body, tenantsBody, loc{kind: registry.KindTenants}.at(""), d.tenantSettings)
}

func (d *decoder) tenant(b *hcl.Block) {
	name := b.Labels[0]
	if !d.checkLabel("tenant", b) || !d.declare(registry.KindTenant, name, b) {
		return
	}
	obj := loc{kind: registry.KindTenant, name: name}
	t := &registry.Tenant{Name: name, DeclRange: pos(b.DefRange), Limits: registry.Limits{CountCached: DefaultCountCached}}
	d.tenants[name] = t
	content := decodeBody(d, b.Body, tenantBody, obj.at(""), t)
	var limitsAt *hcl.Range
	for _, lb := range content.Blocks {
		if limitsAt != nil {
			d.errorAt(obj.with("limits"), lb.DefRange, "Duplicate limits block",
				fmt.Sprintf("Tenant %q already has a limits block at %s.", name, pos(*limitsAt)))
			continue
		}
		limitsAt = lb.DefRange.Ptr()
		d.ranges[obj.with("limits")] = lb.DefRange
		decodeBody(d, lb.Body, limitsBody, obj.at("limits."), &t.Limits)
	}
	if t.KeyFile != "" {
		d.keyFile(obj.with("api_key_file"), content.Attributes["api_key_file"].Expr.Range(), t)
	}
	slices.Sort(t.KeyHashes)
	t.KeyHashes = slices.Compact(t.KeyHashes)
}

// keyFile reads the tenant's api_key_file into its KeyHashes, reporting
// an unreadable file or bad lines at the attribute.
func (d *decoder) keyFile(at loc, r hcl.Range, t *registry.Tenant) {
	d.keyFiles = append(d.keyFiles, t.KeyFile)
	b, err := os.ReadFile(t.KeyFile)
	if err != nil {
		d.errorAt(at, r, "Cannot read api_key_file", fmt.Sprintf("Reading the API key hashes of tenant %q: %s.", t.Name, err))
		return
	}
	hashes, errs := apikey.ParseFile(b)
	if len(errs) > 0 {
		lines := make([]string, 0, len(errs))
		for _, e := range errs {
			lines = append(lines, fmt.Sprintf("%s:%d: %s", t.KeyFile, e.Line, e.Err))
		}
		d.errorAt(at, r, "Invalid API key hash", strings.Join(lines, "; ")+".")
		return
	}
	t.KeyHashes = append(t.KeyHashes, hashes...)
}

// upstreamRef is where a pool takes its upstream API key from.
type upstreamRef struct {
	file, env string
	at        loc
	r         hcl.Range
}

// upstreamAttr decodes upstream_api_key_file or upstream_api_key_env into
// the pool's upstreamRef.
func upstreamAttr(name string) attr[*registry.Pool] {
	return attr[*registry.Pool]{name: name, decode: func(d *decoder, f field, p *registry.Pool) {
		v, ok := d.str(f.at, f.attr.Expr)
		if !ok {
			return
		}
		if isBlank(v) {
			d.errorAt(f.at, f.rng(), "Empty "+name, fmt.Sprintf("%s is empty; leave it out to send no key.", name))
			return
		}
		ref := d.upstream[p.Name]
		if ref == nil {
			ref = &upstreamRef{}
			d.upstream[p.Name] = ref
		}
		if name == "upstream_api_key_env" {
			ref.env = v
		} else {
			ref.file = v
		}
		ref.at, ref.r = f.at, f.rng()
	}}
}

// upstreamKey resolves a pool's upstream_api_key_file or
// upstream_api_key_env into the key the picker sends the pool's servers.
func (d *decoder) upstreamKey(p *registry.Pool) {
	ref := d.upstream[p.Name]
	if ref == nil {
		return
	}
	file, env, at, r := ref.file, ref.env, ref.at, ref.r
	var key string
	switch {
	case file != "" && env != "":
		d.errorAt(at, r, "Conflicting upstream keys", "Set upstream_api_key_file or upstream_api_key_env, not both.")
		return
	case file != "":
		d.keyFiles = append(d.keyFiles, file)
		b, err := os.ReadFile(file)
		if err != nil {
			d.errorAt(at, r, "Cannot read upstream_api_key_file", fmt.Sprintf("Reading the upstream API key of pool %q: %s.", p.Name, err))
			return
		}
		key = strings.TrimSpace(string(b))
	default:
		v, ok := os.LookupEnv(env)
		if !ok {
			d.errorAt(at, r, "Missing environment variable", fmt.Sprintf("Pool %q takes its upstream API key from $%s, which is not set.", p.Name, env))
			return
		}
		key = strings.TrimSpace(v)
	}
	if key == "" || strings.ContainsAny(key, " \t\r\n") {
		// Never quote the value: it is a secret.
		d.errorAt(at, r, "Invalid upstream API key", fmt.Sprintf("The upstream API key of pool %q is empty or has spaces or several lines; it must be one token.", p.Name))
		return
	}
	p.UpstreamAPIKey = key
}

// tenantWarnings warns about configurations where tenants do less than
// they seem to: a tenants block without tenants, and pools that fail open
// (Envoy serves them without the picker, so without checking keys, while
// the picker is down).
func (d *decoder) tenantWarnings() {
	if d.tenantSettings != nil && len(d.tenants) == 0 {
		r := d.declared[loc{kind: registry.KindTenants}]
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagWarning, Summary: "No tenant",
			Detail:  "The tenants block has no effect without tenant blocks: requests are not authenticated.",
			Subject: r.Ptr()})
	}
	if len(d.tenants) == 0 {
		return
	}
	for _, name := range slices.Sorted(maps.Keys(d.pools)) {
		if d.pools[name].FailureMode != registry.FailOpen {
			continue
		}
		r, ok := d.ranges[loc{kind: registry.KindPool, name: name, field: "failure_mode"}]
		if !ok {
			r = d.ranges[loc{kind: registry.KindPool, name: name}]
		}
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagWarning, Summary: "Tenants and fail_open",
			Detail: fmt.Sprintf("Pool %q fails open: while the picker is unreachable Envoy serves its requests without checking API keys or limits "+
				"(and forwards the client's key). Use fail_closed to require a key at all times.", name),
			Subject: r.Ptr()})
	}
}
