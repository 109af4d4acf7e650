package registry

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Sentinel errors wrapped by the problems Validate reports; test with
// errors.Is.
var (
	ErrUnknownPool        = errors.New("unknown pool")
	ErrDuplicate          = errors.New("duplicate definition")
	ErrUnknownEngine      = errors.New("unknown engine")
	ErrUnknownFailureMode = errors.New("unknown failure_mode")
	ErrBadMetricsPath     = errors.New("bad metrics_path")
	ErrBadScheduling      = errors.New("bad scheduling")
	ErrBadWeights         = errors.New("bad target weights")
	ErrSelfTarget         = errors.New("model targets itself")
	ErrEmptyName          = errors.New("empty name")
	ErrBadAdmission       = errors.New("bad admission")
	ErrBadLimit           = errors.New("bad limit")
	ErrUnknownModel       = errors.New("unknown model")
	ErrBadKVEvents        = errors.New("bad kv_events")
)

// Object kinds named by ValidationError.Kind.
const (
	KindPool     = "pool"
	KindModel    = "model"
	KindListener = "listener"
	KindRouting  = "routing"
	KindReplicas = "replicas"
	KindEndpoint = "endpoint"
	KindTenant   = "tenant"
	KindTenants  = "tenants"
)

// ValidationError is one problem found in a State. Kind, Name and Field say
// which object and attribute is wrong so a source can map the problem back
// onto its own input (the HCL source turns it into a diagnostic pointing at
// that attribute).
type ValidationError struct {
	// Kind is one of the Kind* constants.
	Kind string
	// Name is the object's name (pool, model, listener name; the endpoint
	// address for KindEndpoint; "" for routing).
	Name string
	// Pool is the pool an endpoint belongs to (KindEndpoint only).
	Pool string
	// Field is the attribute at fault: "pool", "address", "default_pool",
	// "engine", "failure_mode", "metrics_path", "scheduling.<attr>",
	// "scheduling.scorers.<key>", "scheduling.metrics.<key>",
	// "target.<name>" (a target block), "target.<name>.weight", for
	// tenants "api_keys", "models" and "limits.<attr>", or ""
	// (the whole object).
	Field string
	// Where is the object's declaration ("file:line:column"), when known.
	Where string
	// Err is one of the sentinel errors above.
	Err error
	// Msg is the human explanation.
	Msg string
}

func (e *ValidationError) Error() string {
	var b strings.Builder
	if e.Where != "" {
		b.WriteString(e.Where)
		b.WriteString(": ")
	}
	b.WriteString(e.Kind)
	if e.Name != "" {
		fmt.Fprintf(&b, " %q", e.Name)
	}
	if e.Pool != "" {
		fmt.Fprintf(&b, " in pool %q", e.Pool)
	}
	if e.Field != "" {
		b.WriteString(" ")
		b.WriteString(e.Field)
	}
	b.WriteString(": ")
	b.WriteString(e.Msg)
	return b.String()
}

func (e *ValidationError) Unwrap() error { return e.Err }

// ValidationErrors splits an error returned by Validate into its problems.
func ValidationErrors(err error) []*ValidationError {
	if err == nil {
		return nil
	}
	var out []*ValidationError
	var walk func(error)
	walk = func(err error) {
		if ve, ok := err.(*ValidationError); ok {
			out = append(out, ve)
			return
		}
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
		}
	}
	walk(err)
	return out
}

// SchedulingRules judges a pool's scheduling block: its profile, picker,
// scorer and metric names, weights and thresholds, whose meaning the picker
// owns (the picker's sched.Rules). The registry carries the block and
// reports each Problem as a ValidationError on the block's field, so a
// configuration file shows it at its line and column. Nil rules leave
// scheduling blocks unjudged (the picker still refuses what it cannot
// build); switchyard serve and validate always pass the picker's.
type SchedulingRules func(*Scheduling) []Problem

// Problem is one thing SchedulingRules found wrong: Field is the path in
// the scheduling block ("profile", "scorers.prefix", "metrics.waiting",
// "queue_threshold"), Msg says what is wrong and what is wanted.
type Problem struct {
	Field string
	Msg   string
}

// CheckEngine reports whether e names a supported engine.
func CheckEngine(e Engine) error {
	if slices.Contains(Engines, e) {
		return nil
	}
	return fmt.Errorf("%w %q: want one of %s", ErrUnknownEngine, e, quoteList(Engines))
}

// CheckFailureMode reports whether f is fail_closed or fail_open.
func CheckFailureMode(f FailureMode) error {
	if f == FailClosed || f == FailOpen {
		return nil
	}
	return fmt.Errorf("%w %q: want %q or %q", ErrUnknownFailureMode, f, FailClosed, FailOpen)
}

// CheckMetricsPath reports whether p is an absolute HTTP path.
func CheckMetricsPath(p string) error {
	if strings.HasPrefix(p, "/") && !strings.ContainsAny(p, " \t\r\n?#") {
		return nil
	}
	return fmt.Errorf("%w %q: want an absolute path such as \"/metrics\"", ErrBadMetricsPath, p)
}

func quoteList[T ~string](xs []T) string {
	q := make([]string, len(xs))
	for i, x := range xs {
		q[i] = fmt.Sprintf("%q", x)
	}
	return strings.Join(q, ", ")
}

// Validate checks a merged State and returns every problem found, joined
// with errors.Join (nil when the state is valid). Each problem is a
// *ValidationError wrapping one of the sentinel errors. It is the one place
// the rules below live; every source's output passes through it:
//
//   - names are non-empty; listener names and addresses are unique;
//   - addresses are canonical ip:port (CanonicalAddress);
//   - engines, failure modes and metrics paths are known;
//   - scheduling blocks pass rules (the picker's names, weights and
//     thresholds; see SchedulingRules);
//   - endpoint addresses are unique within a pool;
//   - every model's pool and routing.default_pool exist;
//   - target weights are >= 0 and sum to more than 0, target names are
//     unique, no model targets itself, and a target that is itself a model
//     must be served by the same pool;
//   - tenant limits are >= 0, an API key hash belongs to one tenant, and a
//     tenant's models are declared (or a default pool may serve them);
//   - endpoint roles are known, disaggregation settings are >= 0, and a
//     model's disaggregation block belongs to a disaggregated pool.
func Validate(s *State, rules SchedulingRules) error {
	var errs []error
	add := func(kind, name, field, where string, sentinel error, format string, args ...any) {
		errs = append(errs, &ValidationError{Kind: kind, Name: name, Field: field, Where: where, Err: sentinel, Msg: fmt.Sprintf(format, args...)})
	}
	addErr := func(kind, name, field, where string, err error) {
		sentinel := err
		for u := errors.Unwrap(sentinel); u != nil; u = errors.Unwrap(u) {
			sentinel = u
		}
		errs = append(errs, &ValidationError{Kind: kind, Name: name, Field: field, Where: where, Err: sentinel, Msg: err.Error()})
	}

	for _, name := range s.PoolNames() {
		p := s.Pools[name]
		if name == "" || p.Name != name {
			add(KindPool, name, "", p.DeclRange, ErrEmptyName, "pool name %q does not match its key %q", p.Name, name)
		}
		if err := CheckEngine(p.Engine); err != nil {
			addErr(KindPool, name, "engine", p.DeclRange, err)
		}
		if err := CheckFailureMode(p.FailureMode); err != nil {
			addErr(KindPool, name, "failure_mode", p.DeclRange, err)
		}
		if err := CheckMetricsPath(p.MetricsPath); err != nil {
			addErr(KindPool, name, "metrics_path", p.DeclRange, err)
		}
		if sc := p.Scheduling; sc != nil && rules != nil {
			for _, pr := range rules(sc) {
				add(KindPool, name, "scheduling."+pr.Field, p.DeclRange, ErrBadScheduling, "%s", pr.Msg)
			}
		}
		if a := p.Admission; a != nil {
			validateAdmission(name, p.DeclRange, a, add)
		}
		if kv := p.KVEvents; kv != nil {
			for _, pr := range CheckKVEvents(kv, p.Engine) {
				add(KindPool, name, "kv_events"+pr.Field, p.DeclRange, ErrBadKVEvents, "%s", pr.Msg)
			}
		}
		seen := map[string]bool{}
		for _, ep := range p.Endpoints {
			canon, err := CanonicalAddress(ep.Address, true)
			if err != nil {
				errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: name, Field: "address", Where: p.DeclRange, Err: ErrBadAddress, Msg: err.Error()})
			} else if canon != ep.Address {
				errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: name, Field: "address", Where: p.DeclRange, Err: ErrBadAddress, Msg: fmt.Sprintf("address %q is not canonical (want %q)", ep.Address, canon)})
			}
			if seen[ep.Address] {
				errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: name, Where: p.DeclRange, Err: ErrDuplicate, Msg: fmt.Sprintf("endpoint %s is listed twice", ep.Address)})
			}
			seen[ep.Address] = true
			if ep.MetricsPath != "" {
				if err := CheckMetricsPath(ep.MetricsPath); err != nil {
					errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: name, Field: "metrics_path", Where: p.DeclRange, Err: ErrBadMetricsPath, Msg: err.Error()})
				}
			}
			if kv := ep.KVEvents; kv != nil {
				for _, pr := range CheckKVEvents(kv, p.Engine) {
					errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: ep.Address, Pool: name, Field: "kv_events" + pr.Field, Where: p.DeclRange, Err: ErrBadKVEvents, Msg: pr.Msg})
				}
			}
		}
	}

	for _, name := range s.ModelNames() {
		m := s.Models[name]
		if name == "" || m.Name != name {
			add(KindModel, name, "", m.DeclRange, ErrEmptyName, "model name %q does not match its key %q", m.Name, name)
		}
		pool, ok := s.Pools[m.Pool]
		if !ok {
			add(KindModel, name, "pool", m.DeclRange, ErrUnknownPool, "pool %q is not defined%s", m.Pool, knownHint(s.PoolNames()))
		}
		if len(m.Targets) == 0 {
			continue
		}
		sum := 0
		names := map[string]bool{}
		for _, t := range m.Targets {
			field := "target." + t.Name
			switch {
			case t.Name == "":
				add(KindModel, name, field, m.DeclRange, ErrEmptyName, "target name is empty")
			case t.Name == name:
				add(KindModel, name, field, m.DeclRange, ErrSelfTarget, "target %q is the model itself; a rewrite must name a different model", t.Name)
			case names[t.Name]:
				add(KindModel, name, field, m.DeclRange, ErrDuplicate, "target %q is listed twice", t.Name)
			}
			names[t.Name] = true
			if t.Weight < 0 {
				add(KindModel, name, field+".weight", m.DeclRange, ErrBadWeights, "target %q has negative weight %d", t.Name, t.Weight)
			} else {
				sum += t.Weight
			}
			if other, isModel := s.Models[t.Name]; isModel && ok && t.Name != name && other.Pool != pool.Name && s.Pools[other.Pool] != nil {
				add(KindModel, name, field, m.DeclRange, ErrUnknownPool, "target %q is a model served by pool %q, but model %q routes to pool %q", t.Name, other.Pool, name, m.Pool)
			}
		}
		if sum == 0 {
			add(KindModel, name, "", m.DeclRange, ErrBadWeights, "target weights sum to 0; at least one target needs a positive weight")
		}
	}

	names := map[string]bool{}
	addrs := map[string]string{}
	for _, l := range s.Listeners {
		if l.Name == "" {
			add(KindListener, l.Name, "", l.DeclRange, ErrEmptyName, "listener has no name")
		}
		if names[l.Name] {
			add(KindListener, l.Name, "", l.DeclRange, ErrDuplicate, "listener %q is defined twice", l.Name)
		}
		names[l.Name] = true
		canon, err := CanonicalAddress(l.Address, false)
		switch {
		case err != nil:
			addErr(KindListener, l.Name, "address", l.DeclRange, err)
		case canon != l.Address:
			add(KindListener, l.Name, "address", l.DeclRange, ErrBadAddress, "address %q is not canonical (want %q)", l.Address, canon)
		default:
			if other, dup := addrs[canon]; dup {
				add(KindListener, l.Name, "address", l.DeclRange, ErrDuplicate, "address %s is already used by listener %q", canon, other)
			}
			addrs[canon] = l.Name
		}
	}

	if dp := s.Routing.DefaultPool; dp != "" {
		if _, ok := s.Pools[dp]; !ok {
			add(KindRouting, "", "default_pool", "", ErrUnknownPool, "the default pool %q is not defined%s", dp, knownHint(s.PoolNames()))
		}
	}
	validateTenants(s, add)
	validateRoles(s, add, func(pool, addr, field string, sentinel error, msg string) {
		errs = append(errs, &ValidationError{Kind: KindEndpoint, Name: addr, Pool: pool, Field: field, Where: s.Pools[pool].DeclRange, Err: sentinel, Msg: msg})
	})
	for _, r := range s.Replicas {
		where := ""
		if s.ReplicaDiscovery != nil {
			where = s.ReplicaDiscovery.DeclRange
		}
		if canon, err := CanonicalAddress(r.Address, true); err != nil {
			addErr(KindReplicas, r.ID, "peers", where, err)
		} else if canon != r.Address {
			add(KindReplicas, r.ID, "peers", where, ErrBadAddress, "replica address %q is not canonical (want %q)", r.Address, canon)
		}
	}
	return errors.Join(errs...)
}

// KVEventsEngines are the engines whose KV-cache events (and /tokenize
// endpoint, which matching requests to their blocks needs) the picker
// knows.
var KVEventsEngines = []Engine{EngineVLLM}

// CheckKVEvents judges a kv_events block of a pool on engine: its ports
// and the engine. Each Problem's Field is "" (the block) or ".port",
// ".replay_port".
func CheckKVEvents(kv *KVEvents, engine Engine) []Problem {
	var out []Problem
	if !slices.Contains(KVEventsEngines, engine) {
		out = append(out, Problem{Msg: fmt.Sprintf("KV-cache events need engine %s; the pool's engine is %q", quoteList(KVEventsEngines), engine)})
	}
	if kv.Port < 1 || kv.Port > 65535 {
		out = append(out, Problem{Field: ".port", Msg: fmt.Sprintf("port %d is not in 1-65535 (vLLM's kv-events-config endpoint, tcp://*:PORT)", kv.Port)})
	}
	switch {
	case kv.ReplayPort < 0 || kv.ReplayPort > 65535:
		out = append(out, Problem{Field: ".replay_port", Msg: fmt.Sprintf("replay_port %d is not in 1-65535 (0 or absent: no replay socket)", kv.ReplayPort)})
	case kv.ReplayPort != 0 && kv.ReplayPort == kv.Port:
		out = append(out, Problem{Field: ".replay_port", Msg: fmt.Sprintf("replay_port %d is the event port too; vLLM binds them separately", kv.ReplayPort)})
	}
	return out
}

func validateAdmission(pool, where string, a *Admission,
	add func(kind, name, field, where string, sentinel error, format string, args ...any)) {
	f := func(field, format string, args ...any) {
		add(KindPool, pool, "admission."+field, where, ErrBadAdmission, format, args...)
	}
	if a.MaxQueued < 0 {
		f("max_queued", "max_queued %d is negative; want 1 or more (0: the default)", a.MaxQueued)
	}
	if a.MaxQueuedBytes < 0 {
		f("max_queued_bytes", "max_queued_bytes %d is negative; want 1 or more (0: the default)", a.MaxQueuedBytes)
	}
	if a.BandMaxQueued < 0 {
		f("band_max_queued", "band_max_queued %d is negative; want 1 or more (0: only max_queued bounds a band)", a.BandMaxQueued)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{{"ttl", a.TTL}, {"no_endpoint_wait", a.NoEndpointWait}} {
		if d.v < 0 || d.v > MaxAdmissionTTL {
			f(d.field, "%s %v is not between 0 and %v", d.field, d.v, MaxAdmissionTTL)
		}
	}
	if a.Fairness != "" && !slices.Contains(fairnessNames, a.Fairness) {
		f("fairness", "unknown fairness %q: want one of %s", a.Fairness, quoteList(fairnessNames))
	}
	if a.PriorityMin > a.PriorityMax {
		f("priority_min", "priority_min %d is above priority_max %d", a.PriorityMin, a.PriorityMax)
	}
	if (a.PriorityMin != 0 || a.PriorityMax != 0) && a.PriorityHeader == "" {
		f("priority_min", "priority_min and priority_max bound a priority header; name it with priority_header")
	}
	for _, h := range []struct{ field, v string }{{"flow_header", a.FlowHeader}, {"priority_header", a.PriorityHeader}} {
		if h.v != "" && !validHeaderName(h.v) {
			f(h.field, "%s %q is not an HTTP header name", h.field, h.v)
		}
	}
}

// validHeaderName reports whether h is a lower-case HTTP header name (the
// form Envoy hands the picker).
func validHeaderName(h string) bool {
	if h == "" {
		return false
	}
	for _, c := range h {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', strings.ContainsRune("!#$%&'*+-.^_`|~", c):
		default:
			return false
		}
	}
	return true
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func knownHint(names []string) string {
	if len(names) == 0 {
		return " (no pools are defined)"
	}
	return " (defined pools: " + quoteList(names) + ")"
}
