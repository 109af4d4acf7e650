package picker

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/switchyard/switchyard/picker/openai"
	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/registry"
)

// tenantStage is the picker's side of tenants (picker/tenant owns keys
// and budgets), in the chain only when the configuration has tenants:
// authenticating a request's headers, the model and budget checks of the
// decision, the rate-limit headers of every answer, and the usage read
// from the response, settled and recorded (Options.Usage) when the
// request ends. Its per-request state is request.ten; a request it did
// not authenticate (tenants came with a reload) it leaves alone.
type tenantStage struct {
	tab   *tenant.Table
	usage tenant.Recorder
}

var (
	_ requestHeadersStage  = (*tenantStage)(nil)
	_ resolvedStage        = (*tenantStage)(nil)
	_ modelsStage          = (*tenantStage)(nil)
	_ replyStage           = (*tenantStage)(nil)
	_ responseHeadersStage = (*tenantStage)(nil)
	_ responseBodyStage    = (*tenantStage)(nil)
	_ releasedStage        = (*tenantStage)(nil)
)

// tenantStageFor is in the chain when the state has tenants.
func tenantStageFor(s *Server, snap *snapshot, _ *poolView) any {
	if snap.tenants != nil {
		return &tenantStage{tab: snap.tenants, usage: s.opts.Usage}
	}
	return nil
}

// usageDocBytes bounds the response document (or stream event) kept to
// read its usage; a larger JSON document is read from its tail.
const usageDocBytes = 1 << 20

// tenantReq is one request's tenant state.
type tenantReq struct {
	tab *tenant.Table
	t   *tenant.Tenant
	// label is the model name usage is recorded under: the client's name
	// when it is declared (or in the tenant's models list), "other" for
	// any other name, "" when the request names none (bounded by the
	// configuration, like the metrics it feeds).
	label string
	// Admission: what was reserved, and the prompt estimate charged when
	// a response reports no usage.
	admitted bool
	res      tenant.Reservation
	estimate int64
	// retryAfter is set when a budget refused the request (429).
	retryAfter time.Duration
	// strip: the picker asked the server for the stream's usage chunk,
	// which the client must not see.
	strip bool
	// Response side.
	status  int
	tap     *openai.UsageTap
	errored bool
	// skip: not accounted (the picker's own /v1/models answers); done:
	// settled and recorded.
	skip, done bool
}

// requestHeaders authenticates: it finds the request's tenant from its
// API key (401 without a known one), marks the key headers for removal
// (the client's key never reaches a model server) and sets r.tenant.
func (ts *tenantStage) requestHeaders(r *request) reply {
	var c tenant.Credentials
	for _, hv := range r.headers {
		if k := strings.ToLower(hv.GetKey()); c.Add(k, headerBytes(hv)) && !containsStr(r.remove, k) {
			r.remove = append(r.remove, k)
		}
	}
	key, err := c.Key()
	var t *tenant.Tenant
	if err == nil {
		if t = ts.tab.Authenticate(key); t == nil {
			err = tenant.ErrUnknownKey
		}
	}
	if err != nil {
		return reply{code: 401, msg: err.Error()}
	}
	r.ten = tenantReq{tab: ts.tab, t: t}
	r.tenant = t.Name
	return reply{}
}

// resolved is the tenant's part of the decision (tenantAdmit); the
// tenant's priority, if it has one, is the request's default.
func (ts *tenantStage) resolved(r *request) reply {
	if r.ten.t == nil {
		return reply{}
	}
	if code, msg := r.tenantAdmit(r.snap, &r.upstream); code != 0 {
		return reply{code: code, msg: msg}
	}
	if p := r.ten.t.Priority; p != nil {
		r.priority = *p
	}
	return reply{}
}

// listModels narrows the picker's model list to the models the tenant
// may use; listing is not accounted.
func (ts *tenantStage) listModels(r *request, ids []string) []string {
	tr := &r.ten
	if tr.t == nil {
		return ids
	}
	tr.skip = true
	return slices.DeleteFunc(ids, func(id string) bool { return !tr.t.Allows(id) })
}

func containsStr(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// tenantAdmit is the tenant's part of the decision, once the model is
// known: the model must be one the tenant may use (403, or 404 when the
// configuration hides forbidden models), and the request must fit its
// budgets (429), which reserve the request and its estimated tokens:
// prompt, plus the output cap the engine applies (max_tokens and the
// like, times n; see openai.Generation.OutputCap), or, for a generation
// that sets none, the tenant's assumed_max_tokens. A streaming chat or
// completion that did not ask for usage is made to (body is rewritten),
// so that its tokens can be counted. The body is read as the engine
// reads it ("stream": "true" streams, "max_tokens": "5" caps). A request
// picked again (after waiting in an admission queue) gets its body
// rewritten again but is reserved once.
func (r *request) tenantAdmit(snap *snapshot, body *[]byte) (int, string) {
	tr := &r.ten
	model := r.clientModel
	tr.label = tr.labelFor(snap, model)
	if model != "" && !tr.t.Allows(model) {
		if tr.tab.Hide {
			return 404, fmt.Sprintf("model %q does not exist", model)
		}
		return 403, fmt.Sprintf("tenant %q may not use model %q", tr.t.Name, model)
	}
	var gen openai.Generation
	if len(*body) > 0 {
		gen = openai.ParseGeneration(*body)
		tr.estimate = openai.EstimateTokens(*body)
		if gen.Stream && !gen.IncludeUsage && usagePath(string(r.path)) {
			*body = openai.WithIncludeUsage(*body, gen)
			r.bodyRewritten, tr.strip = true, true
		}
	}
	if tr.admitted {
		return 0, ""
	}
	path := string(r.path)
	out, capped := gen.OutputCap(path)
	if !capped && openai.Generates(path) {
		if out = tr.t.Limits.AssumedMaxTokens; out <= 0 {
			out = registry.DefaultAssumedMaxTokens
		}
	}
	now := time.Now()
	res, denied := tr.t.Admit(now, tr.estimate+out)
	if denied != nil {
		tr.retryAfter = denied.RetryAfter
		return 429, fmt.Sprintf("tenant %q is over its %s limit (%d; this replica's share %d, used %d, this request %d); retry in %s",
			tr.t.Name, denied.Limit, denied.Configured, denied.Local, denied.Used, denied.Need, tenant.FormatReset(denied.RetryAfter))
	}
	tr.admitted, tr.res = true, res
	return 0, ""
}

// labelFor is the name usage of a request for model is recorded under
// (see tenantReq.label).
func (tr *tenantReq) labelFor(snap *snapshot, model string) string {
	switch _, declared := snap.models[model]; {
	case model == "":
		return ""
	case declared || tr.t.Lists(model):
		return model
	}
	return "other"
}

// usagePath reports whether path is an endpoint whose streams take
// stream_options (chat and text completions).
func usagePath(path string) bool {
	path, _, _ = strings.Cut(path, "?")
	path = strings.TrimSuffix(path, "/")
	return path == "/v1/chat/completions" || path == "/v1/completions"
}

// replied adds the tenant's rate-limit headers (and retry-after after a
// 429) to a local reply. A request for a model nobody declared, answered
// 404 before any pool is chosen, has its usage filed under the name's
// label.
func (ts *tenantStage) replied(r *request, rep reply, resp *extprocv3.ProcessingResponse) {
	tr := &r.ten
	if tr.t == nil {
		return
	}
	if r.missing {
		tr.label = tr.labelFor(r.snap, r.clientModel)
	}
	code := rep.code
	tr.errored, tr.status = true, code
	ir := resp.GetImmediateResponse()
	if ir == nil {
		return
	}
	if ir.Headers == nil {
		ir.Headers = &extprocv3.HeaderMutation{}
	}
	ir.Headers.SetHeaders = appendRateHeaders(ir.Headers.SetHeaders, tr)
	if code == 429 && tr.retryAfter > 0 {
		ir.Headers.SetHeaders = append(ir.Headers.SetHeaders, setHeader("retry-after", tenant.RetryAfterSeconds(tr.retryAfter)))
	}
}

// rateBlock holds a request's rate-limit headers as Envoy header
// mutations, in one allocation.
type rateBlock struct {
	h    tenant.Headers
	buf  [tenant.MaxHeaders * 12]byte
	opts [tenant.MaxHeaders]corev3.HeaderValueOption
	vals [tenant.MaxHeaders]corev3.HeaderValue
}

// appendRateHeaders appends the tenant's rate-limit headers to set.
func appendRateHeaders(set []*corev3.HeaderValueOption, tr *tenantReq) []*corev3.HeaderValueOption {
	b := new(rateBlock)
	b.h.SetBuffer(b.buf[:0])
	tr.t.Headers(time.Now(), tr.tab.Replicas, &b.h)
	for i := range b.h.Len() {
		b.vals[i] = corev3.HeaderValue{Key: b.h.Key(i), RawValue: b.h.Value(i)}
		b.opts[i] = corev3.HeaderValueOption{Header: &b.vals[i], AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
		set = append(set, &b.opts[i])
	}
	return set
}

// responseHeaders notes the response status, adds the rate-limit
// headers and, for JSON and event-stream bodies that are not compressed,
// starts reading the usage (dropping content-length when the usage chunk
// is removed).
func (ts *tenantStage) responseHeaders(r *request, h *extprocv3.HttpHeaders, resp *extprocv3.ProcessingResponse) {
	tr := &r.ten
	if tr.t == nil {
		return
	}
	ct, encoded := "", false
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch strings.ToLower(hv.GetKey()) {
		case ":status":
			tr.status, _ = strconv.Atoi(headerValue(hv))
		case "content-type":
			ct = headerValue(hv)
		case "content-encoding":
			v := strings.TrimSpace(headerValue(hv))
			encoded = v != "" && !strings.EqualFold(v, "identity")
		}
	}
	cr := resp.GetResponseHeaders().GetResponse()
	if cr.HeaderMutation == nil {
		cr.HeaderMutation = &extprocv3.HeaderMutation{}
	}
	hm := cr.HeaderMutation
	hm.SetHeaders = appendRateHeaders(hm.SetHeaders, tr)
	if h.GetEndOfStream() || !r.respBody || encoded || tr.status >= 300 {
		return
	}
	if kind := openai.KindOf(ct); kind != openai.Passthrough {
		tr.tap = openai.NewUsageTap(kind, tr.strip, usageDocBytes)
		if tr.tap.Strips() && !containsStr(hm.RemoveHeaders, "content-length") {
			hm.RemoveHeaders = append(hm.RemoveHeaders, "content-length")
		}
	}
}

// responseBody runs a response body chunk through the usage tap. At the
// end of the body the request is settled first, so what was counted is
// recorded before the response completes.
func (ts *tenantStage) responseBody(r *request, data []byte, eos bool) (out []byte, changed bool) {
	tr := &r.ten
	out = data
	if tr.tap != nil {
		out, changed = tr.tap.Write(out, eos), true
	}
	if eos {
		ts.finish(r)
	}
	return out, changed
}

// released settles the request if its response did not (it ended
// without one, or was answered locally).
func (ts *tenantStage) released(r *request) { ts.finish(r) }

// finish settles the request's reservation with what it used and
// records its usage, once. Used tokens are the response's usage (cached
// prompt tokens left out unless the tenant counts them); a successful
// response without usage is charged its prompt estimate, a failed or
// locally answered one nothing.
func (ts *tenantStage) finish(r *request) {
	tr := &r.ten
	if tr.t == nil || tr.done || tr.skip {
		return
	}
	tr.done = true
	now := time.Now()
	var u openai.Usage
	found := false
	if tr.tap != nil {
		u, found = tr.tap.Usage()
	}
	// No response seen (the client or Envoy gave up first) counts as
	// failed too.
	failed := tr.errored || tr.status == 0 || tr.status >= 400
	if tr.admitted {
		var used int64
		switch {
		case found:
			used = u.Prompt + u.Completion
			if !tr.t.Limits.CountCached {
				used -= min(u.Cached, u.Prompt)
			}
		case !failed:
			used = tr.estimate
		}
		tr.t.Settle(now, tr.res, used)
	}
	rec := tenant.Usage{Time: now, Tenant: tr.t.Name, Model: tr.label, Requests: 1}
	if failed {
		rec.Errors = 1
	}
	if found {
		rec.PromptTokens, rec.CachedTokens, rec.CompletionTokens = u.Prompt, u.Cached, u.Completion
	}
	if ts.usage != nil {
		ts.usage.Record(rec)
	}
}

// TenantStatus is one tenant's budgets as this replica sees them.
type TenantStatus struct {
	Name     string
	Priority *int
	// Limits are the configured (fleet-wide) budgets, Local this
	// replica's share of them (split among Replicas).
	Limits, Local registry.Limits
	Replicas      int
	// Used is what this replica counts now per budget
	// ("requests_per_minute", "tokens_per_minute", "tokens_per_day").
	Used map[string]int64
}

// Tenants returns every configured tenant's budgets (sorted by name);
// nil without tenants.
func (s *Server) Tenants(now time.Time) []TenantStatus {
	tab := s.snap.Load().tenants
	names := tab.Names()
	slices.Sort(names)
	out := make([]TenantStatus, 0, len(names))
	for _, n := range names {
		t := tab.Tenant(n)
		out = append(out, TenantStatus{Name: n, Priority: t.Priority, Limits: t.Limits, Local: t.Local(), Replicas: tab.Replicas, Used: t.Used(now)})
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
