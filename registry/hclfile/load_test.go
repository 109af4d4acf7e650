package hclfile

import (
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

func TestLoadFull(t *testing.T) {
	t.Parallel()
	cfg, diags := Load("testdata/full.hcl", sched.Rules)
	// full.hcl mixes endpoints with and without models lists on purpose.
	if len(diags) != 1 || diags[0].Summary != "Endpoints without a models list" || diags[0].Severity != hcl.DiagWarning {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	want := &registry.State{
		Pools: map[string]*registry.Pool{
			"llama": {
				Name:   "llama",
				Engine: registry.EngineVLLM,
				Endpoints: []registry.Endpoint{
					{Address: "10.0.0.1:8000", Source: "file"},
					{Address: "127.0.0.1:8002", Source: "file"},
					{Address: "127.0.0.1:8003", Source: "file", Models: []string{"sql-lora"}, MetricsPath: "/m", Draining: true},
					{Address: "[::1]:8001", Source: "file"},
				},
				FailureMode: registry.FailOpen,
				MetricsPath: "/metrics",
				Scheduling: &registry.Scheduling{
					Profile:          "default",
					Scorers:          map[string]float64{"queue": 1, "kv-cache": 0.5, "prefix": 2},
					Picker:           "weighted-random",
					ScrapeIntervalMS: 1500,
					QueueThreshold:   5,
					KVThreshold:      0.8,
					Metrics:          map[string]string{"waiting": "vllm:num_requests_waiting", "kv_usage": "vllm:kv_cache_usage_perc"},
					SessionHeader:    "x-session-id",
				},
				DeclRange: "testdata/full.hcl:13:1",
			},
			"tiny": {
				Name: "tiny", Engine: registry.EngineSGLang, Endpoints: []registry.Endpoint{},
				FailureMode: registry.FailClosed, MetricsPath: "/metrics", DeclRange: "testdata/full.hcl:37:1",
			},
		},
		Models: map[string]*registry.Model{
			"meta-llama/Llama-3.1-8B-Instruct": {Name: "meta-llama/Llama-3.1-8B-Instruct", Pool: "llama", Priority: 2, DeclRange: "testdata/full.hcl:41:1"},
			"batch":                            {Name: "batch", Pool: "tiny", Priority: -1, DeclRange: "testdata/full.hcl:46:1"},
			"chat": {Name: "chat", Pool: "llama", DeclRange: "testdata/full.hcl:51:1", Targets: []registry.Target{
				{Name: "meta-llama/Llama-3.1-8B-Instruct", Weight: 90},
				{Name: "llama-v2", Weight: 10},
				{Name: "llama-v3", Weight: DefaultTargetWeight},
			}},
		},
		Listeners: []registry.Listener{
			{Name: "internal", Address: "[::1]:8081", DeclRange: "testdata/full.hcl:5:1"},
			{Name: "public", Address: "0.0.0.0:8080", DeclRange: "testdata/full.hcl:1:1"},
		},
		Routing: registry.Routing{DefaultPool: "llama"},
	}
	if !reflect.DeepEqual(cfg.State, want) {
		t.Errorf("state mismatch\n got %s\nwant %s", dump(cfg.State), dump(want))
	}
	if cfg.Update.Source != SourceName || cfg.Files["testdata/full.hcl"] == nil {
		t.Errorf("Update.Source = %q, files = %v", cfg.Update.Source, cfg.Files)
	}
	if got := cfg.State.Summary(); got != "2 pools, 3 models, 2 listeners" {
		t.Errorf("Summary = %q", got)
	}
	wantAgent := &ConsulAgent{Address: "https://consul.internal:8501", Token: "3f1c-example", TLS: ConsulTLS{
		ServerName: "consul.internal", CAFile: "/etc/consul/ca.pem",
		CertFile: "/etc/consul/client.pem", KeyFile: "/etc/consul/client-key.pem"}}
	if !reflect.DeepEqual(cfg.Consul, wantAgent) {
		t.Errorf("consul block = %+v, want %+v", cfg.Consul, wantAgent)
	}
}

func dump(s *registry.State) string {
	var b strings.Builder
	for _, n := range s.PoolNames() {
		p := *s.Pools[n]
		b.WriteString("\n  pool ")
		b.WriteString(sprint(p))
		if p.Scheduling != nil {
			b.WriteString("\n    scheduling " + sprint(*p.Scheduling))
		}
	}
	for _, n := range s.ModelNames() {
		b.WriteString("\n  model " + sprint(*s.Models[n]))
	}
	b.WriteString("\n  listeners " + sprint(s.Listeners) + " routing " + sprint(s.Routing))
	return b.String()
}

func sprint(v any) string { return fmt.Sprintf("%+v", v) }

// TestLoadErrors checks every error case: the diagnostics (all of them, in
// order) with their exact file:line:column, summary and detail.
func TestLoadErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		file string
		want []string // "line:col: Summary: detail substring"
	}{
		{"unknown_pool.hcl", []string{
			`4:10: Unknown pool: Pool "lama" is not defined (defined pools: "llama")`,
		}},
		{"duplicates.hcl", []string{
			`2:1: Duplicate pool: The pool "llama" was already defined at testdata/bad/duplicates.hcl:1:1.`,
			`4:1: Duplicate model: The model "m" was already defined at testdata/bad/duplicates.hcl:3:1.`,
			`6:1: Duplicate listener: The listener "l" was already defined at testdata/bad/duplicates.hcl:5:1.`,
		}},
		{"duplicate_endpoint.hcl", []string{
			`2:52: Duplicate endpoint: Endpoint 127.0.0.1:8001 of pool "llama" was already defined at testdata/bad/duplicate_endpoint.hcl:2:16`,
			`4:12: Duplicate endpoint: Endpoint 127.0.0.1:8002 of pool "llama" was already defined at testdata/bad/duplicate_endpoint.hcl:2:34`,
		}},
		{"addresses.hcl", []string{
			`1:26: Invalid address: "localhost:8080": "localhost" is not an IP address (hostnames are not supported`,
			`2:26: Invalid address: "127.0.0.1": want ip:port or [ipv6]:port`,
			`5:5: Invalid address: "vllm-1:8000": "vllm-1" is not an IP address`,
			`6:5: Invalid address: "127.0.0.1:70000": port "70000" is not in 1-65535`,
			`7:5: Invalid address: "127.0.0.1:0": port "0" is not in 1-65535`,
			`8:5: Invalid address: "0.0.0.0:8000": 0.0.0.0 is the unspecified address`,
			`9:5: Invalid address: "::1:8000": want ip:port or [ipv6]:port`,
		}},
		{"enums.hcl", []string{
			`2:18: Unknown engine: Unknown engine "tgi": want one of "vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"`,
			`3:18: Unknown failure_mode: Unknown failure_mode "open": want "fail_closed" or "fail_open"`,
			`4:18: Invalid metrics_path: Bad metrics_path "metrics": want an absolute path`,
			`7:15: Invalid scheduling: Unknown profile "fastest": want one of "default", "weighted"`,
			`8:15: Invalid scheduling: Unknown picker "best": want one of "max-score", "weighted-random"`,
		}},
		{"weights.hcl", []string{
			`5:25: Invalid target weights: Target "x" has negative weight -5`,
			`9:1: Invalid target weights: Target weights sum to 0`,
			`17:3: Model targets itself: Target "c" is the model itself`,
			`19:3: Duplicate target: Model "c" already has a target "x" at testdata/bad/weights.hcl:18:3`,
		}},
		{"cross_pool_target.hcl", []string{
			`10:3: Unknown pool: Target "big" is a model served by pool "a", but model "chat" routes to pool "b"`,
		}},
		{"default_pool.hcl", []string{
			`4:18: Unknown pool: The default pool "lama" is not defined (defined pools: "llama")`,
		}},
		{"replicas.hcl", []string{
			`2:29: Invalid address: "localhost:9002": "localhost" is not an IP address`,
			`2:47: Duplicate peer: Replica 10.0.0.5:9002 is listed twice`,
			`5:1: Duplicate replicas: A replicas block was already defined at testdata/bad/replicas.hcl:1:1.`,
		}},
		{"replicas_empty.hcl", []string{
			`1:1: Empty replicas block: Say how replicas find each other`,
		}},
		{"guard.hcl", []string{
			`4:23: Invalid panic_threshold: panic_threshold 1.5 is not a share between 0 and 1`,
			`11:19: Invalid duration: panic_grace "soon" is not a duration of 0 or more`,
		}},
		{"durations.hcl", []string{
			`3:23: Invalid duration: scrape_interval "fast" is not a duration`,
			`9:23: Invalid duration: scrape_interval "100us" must be at least 1ms`,
			`15:28: Invalid duration: idle_scrape_interval "rarely" is not a duration`,
		}},
		{"unknown.hcl", []string{
			`2:3: Unsupported argument: An argument named "endpoint" is not expected here. Did you mean "endpoints"?`,
			`3:3: Unsupported argument: An argument named "weight" is not expected here`,
			`4:3: Unsupported block type: Blocks of type "healthcheck" are not expected here`,
			`7:1: Unsupported block type: Blocks of type "server" are not expected here`,
		}},
		{"missing.hcl", []string{
			`1:14: Missing required argument: The argument "address" is required`,
			`3:11: Missing required argument: The argument "pool" is required`,
		}},
		{"syntax.hcl", []string{
			`3:1: Missing item separator: Expected a comma`,
		}},
		{"types.hcl", []string{
			`2:16: Invalid expression: A static list expression is required`,
			`5:16: Incorrect value type: Expected a bool, got a string`,
			`9:23: Incorrect value type: Expected a whole number`,
			`10:23: Incorrect value type: Expected a number, got a string`,
			`16:14: Incorrect value type: Expected a number, got a string`,
		}},
		{"scheduling.hcl", []string{
			`3:23: Invalid scheduling: kv_threshold 1.5 is not in [0, 1]`,
			`4:23: Invalid scheduling: queue_threshold -1 is negative`,
			`5:33: Invalid scheduling: Scorer "queue" has weight -1; want a finite number >= 0`,
			`5:59: Invalid scheduling: Unknown scorer "fastest": want one of "queue", "running", "kv-cache"`,
			`6:25: Invalid scheduling: Unknown metric "queue_len"`,
			`8:3: Duplicate scheduling block: Pool "llama" already has a scheduling block at testdata/bad/scheduling.hcl:2:3`,
		}},
		{"admission.hcl", []string{
			`3:24: Invalid admission: max_queued -3 is negative`,
			`4:24: Invalid duration: ttl "forever" is not a duration`,
			`5:24: Invalid admission: no_endpoint_wait 10m0s is not between 0 and 5m0s`,
			`6:24: Invalid admission: Unknown fairness "lottery": want one of "tokens", "round-robin"`,
			`7:24: Invalid admission: priority_min 5 is above priority_max 1`,
			`7:24: Invalid admission: priority_min and priority_max bound a priority header; name it with priority_header`,
			`9:24: Invalid flow_header: "x tenant" is not a valid HTTP header name`,
			`11:3: Duplicate admission block: Pool "llama" already has an admission block at testdata/bad/admission.hcl:2:3`,
		}},
		{"kv_events.hcl", []string{
			`4:19: Invalid kv_events: Port 70000 is not in 1-65535`,
			`5:19: Invalid kv_events: replay_port 70000 is not in 1-65535`,
			`7:3: Duplicate kv_events block: Pool "llama" already has a kv_events block at testdata/bad/kv_events.hcl:3:3`,
			`9:17: Missing required argument: The argument "port" is required`,
			`14:21: Invalid kv_events: replay_port 5557 is the event port too`,
			`20:3: Invalid kv_events: KV-cache events need engine "vllm"; the pool's engine is "trtllm-serve"`,
		}},
		{"consul_agent.hcl", []string{
			`2:16: Invalid Consul address: "consul.internal" is not a Consul HTTP address`,
			`4:16: Conflicting Consul tokens: Set token or token_file, not both`,
			`5:3: Incomplete client certificate: Set both cert_file and key_file, or neither`,
			`9:1: Duplicate consul: A consul block was already defined at testdata/bad/consul_agent.hcl:1:1.`,
		}},
		{"variables.hcl", []string{
			`2:12: Variables not allowed: Variables may not be used here`,
		}},
	}
	seen := map[string]bool{}
	for _, tc := range cases {
		seen[tc.file] = true
		t.Run(tc.file, func(t *testing.T) {
			t.Parallel()
			path := "testdata/bad/" + tc.file
			_, diags := Load(path, sched.Rules)
			if !diags.HasErrors() {
				t.Fatal("no error")
			}
			checkDiags(t, diags, path, tc.want)
		})
	}
	// Every bad file has a case.
	files, _ := filepath.Glob("testdata/bad/*.hcl")
	for _, f := range files {
		if !seen[filepath.Base(f)] {
			t.Errorf("%s has no test case", f)
		}
	}
}

// checkDiags compares diags one to one with want ("line:col: Summary:
// detail prefix"), each in file.
func checkDiags(t *testing.T, diags hcl.Diagnostics, file string, want []string) {
	t.Helper()
	got := strings.Split(FormatDiagnostics(diags), "\n")
	if len(got) != len(want) {
		t.Fatalf("got %d diagnostics, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
	for i, w := range want {
		w = file + ":" + strings.Replace(w, ": ", ": error: ", 1)
		if !strings.HasPrefix(got[i], w) {
			t.Errorf("diagnostic %d:\n got %s\nwant %s...", i, got[i], w)
		}
	}
}

func TestLoadDirectory(t *testing.T) {
	t.Parallel()
	cfg, diags := Load("testdata/dir", sched.Rules)
	if len(diags) > 0 {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	s := cfg.State
	if got := s.Summary(); got != "2 pools, 3 models, 1 listener" {
		t.Errorf("Summary = %q", got)
	}
	if got := s.Models["llama-batch"]; got.Pool != "llama" || got.Priority != -1 || got.DeclRange != "testdata/dir/30-qwen.hcl:9:1" {
		t.Errorf("cross-file model = %+v", got)
	}
	if s.Routing.DefaultPool != "llama" || s.Pools["llama"].DeclRange != "testdata/dir/20-llama.hcl:1:1" {
		t.Errorf("routing %+v, llama at %s", s.Routing, s.Pools["llama"].DeclRange)
	}
	var names []string
	for n := range cfg.Files {
		names = append(names, n)
	}
	slices.Sort(names)
	want := []string{"testdata/dir/10-listener.hcl", "testdata/dir/20-llama.hcl", "testdata/dir/30-qwen.hcl"}
	if !slices.Equal(names, want) {
		t.Errorf("files read = %v, want %v (no hidden or non-.hcl files)", names, want)
	}
}

func TestLoadDirectoryDuplicatesAcrossFiles(t *testing.T) {
	t.Parallel()
	_, diags := Load("testdata/dupdir", sched.Rules)
	checkDiags(t, diags, "testdata/dupdir/b.hcl", []string{
		`2:1: Duplicate listener: The listener "public" was already defined at testdata/dupdir/a.hcl:1:1.`,
		`6:3: Duplicate pool: The pool "llama" was already defined at testdata/dupdir/a.hcl:5:1.`,
		`10:1: Duplicate model: The model "chat" was already defined at testdata/dupdir/a.hcl:9:1.`,
		`14:1: Duplicate routing: A routing block was already defined at testdata/dupdir/a.hcl:13:1.`,
	})
}

func TestLoadNoFiles(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ path, want string }{
		{"testdata/nohcl", "error: No configuration files: Directory testdata/nohcl contains no *.hcl files"},
		{t.TempDir(), "error: No configuration files: Directory"},
		{"testdata/does-not-exist.hcl", "error: Cannot read configuration: stat testdata/does-not-exist.hcl: no such file or directory"},
	} {
		_, diags := Load(tc.path, sched.Rules)
		if got := FormatDiagnostics(diags); !diags.HasErrors() || !strings.HasPrefix(got, tc.want) {
			t.Errorf("Load(%s) = %q, want prefix %q", tc.path, got, tc.want)
		}
	}
}

func TestNoListenerWarning(t *testing.T) {
	t.Parallel()
	cfg, diags := Parse([]Input{{Name: "p.hcl", Src: []byte("pool \"p\" {}\nmodel \"m\" { pool = \"p\" }\n")}}, sched.Rules)
	if diags.HasErrors() || len(diags) != 1 || diags[0].Severity != hcl.DiagWarning || diags[0].Summary != "No listener" {
		t.Fatalf("diagnostics = %s", FormatDiagnostics(diags))
	}
	if cfg.State.Models["m"].Pool != "p" {
		t.Fatalf("state = %+v", cfg.State)
	}
}

// A pool mixing endpoints with and without models lists gets a warning at
// the first endpoint without one; a pool where every endpoint lists its
// models, or none does, gets none.
func TestMixedModelListsWarning(t *testing.T) {
	t.Parallel()
	src := `listener "l" { address = "127.0.0.1:8080" }
pool "mixed" {
  endpoints = ["10.0.0.1:8000"]
  endpoint "10.0.0.2:8000" { models = ["base", "sql-lora"] }
}
pool "listed" {
  endpoint "10.0.1.1:8000" { models = ["base"] }
  endpoint "10.0.1.2:8000" { models = ["base", "sql-lora"] }
}
pool "bare" {
  endpoints = ["10.0.2.1:8000", "10.0.2.2:8000"]
}
`
	_, diags := Parse([]Input{{Name: "p.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() || len(diags) != 1 {
		t.Fatalf("want one warning, got %s", FormatDiagnostics(diags))
	}
	w := diags[0]
	want := `In pool "mixed", 10.0.0.1:8000 list no models: the picker sends them only models their servers list in /v1/models, but before a server has answered (or if it has no such API) any model of the pool, including "base" (listed by 10.0.0.2:8000), "sql-lora" (listed by 10.0.0.2:8000).`
	if w.Severity != hcl.DiagWarning || w.Summary != "Endpoints without a models list" || !strings.HasPrefix(w.Detail, want) {
		t.Errorf("warning %q: %q", w.Summary, w.Detail)
	}
	if w.Subject == nil || w.Subject.Start.Line != 3 {
		t.Errorf("warning at %v, want line 3 (the endpoints list)", w.Subject)
	}
}

// TestExamples loads every shipped example configuration.
func TestExamples(t *testing.T) {
	t.Parallel()
	root := testutil.RepoRoot(t)
	// Every top-level file, and every directory holding HCL files (each is
	// one configuration).
	paths, _ := filepath.Glob(filepath.Join(root, "examples", "*.hcl"))
	nested, _ := filepath.Glob(filepath.Join(root, "examples", "*", "*.hcl"))
	nested2, _ := filepath.Glob(filepath.Join(root, "examples", "*", "*", "*.hcl"))
	dirs := map[string]bool{}
	for _, f := range append(nested, nested2...) {
		dirs[filepath.Dir(f)] = true
	}
	for d := range dirs {
		paths = append(paths, d)
	}
	for _, want := range []string{"single-pool.hcl", "multi-pool.hcl", "lora.hcl", "demo", "consul", "switchyard"} {
		found := false
		for _, p := range paths {
			found = found || filepath.Base(p) == want
		}
		if !found {
			t.Errorf("example %s is missing from %v", want, paths)
		}
	}
	if len(paths) < 6 {
		t.Fatalf("found only %v", paths)
	}
	for _, p := range paths {
		cfg, diags := Load(p, sched.Rules)
		if len(diags) > 0 {
			t.Errorf("%s:\n%s", p, FormatDiagnostics(diags))
			continue
		}
		if len(cfg.State.Listeners) == 0 || len(cfg.State.Pools) == 0 {
			t.Errorf("%s: %s", p, cfg.State.Summary())
		}
	}
	demo, _ := Load(filepath.Join(root, "examples", "demo"), sched.Rules)
	s := demo.State
	if s.Listeners[0].Address != "127.0.0.1:8080" || len(s.Pools["llama"].Endpoints) != 3 ||
		s.Models["sql-lora"] == nil || len(s.Models["chat"].Targets) != 2 || s.Models["chat"].Targets[0].Weight != 90 {
		t.Errorf("demo configuration changed: %s", s.Summary())
	}
}

// The consul block's discovery-guard settings: either may be set, the
// other keeping its default; neither leaves the pool on the defaults.
func TestLoadGuard(t *testing.T) {
	t.Parallel()
	src := `
listener "l" { address = "127.0.0.1:8080" }
pool "both" {
  consul {
    service = "vllm"
    panic_threshold = 0.75
    panic_grace = "10s"
  }
}
pool "off" {
  consul {
    service = "vllm"
    panic_grace = "0s"
  }
}
pool "defaults" {
  consul { service = "vllm" }
}
`
	cfg, diags := Parse([]Input{{Name: "g.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics = %s", FormatDiagnostics(diags))
	}
	for pool, want := range map[string]registry.Guard{
		"both":     {Threshold: 0.75, Grace: 10 * time.Second},
		"off":      {Threshold: registry.DefaultGuardThreshold, Grace: 0},
		"defaults": {Threshold: registry.DefaultGuardThreshold, Grace: registry.DefaultGuardGrace},
	} {
		if got := cfg.State.Pools[pool].EffectiveGuard(); got != want {
			t.Errorf("pool %s guard = %+v, want %+v", pool, got, want)
		}
	}
}

// Every attribute of the admission block reaches the state; a pool
// without one has none (the picker's defaults).
func TestLoadAdmission(t *testing.T) {
	t.Parallel()
	src := `
listener "l" { address = "127.0.0.1:8080" }
pool "tuned" {
  admission {
    enabled          = true
    max_queued       = 200
    max_queued_bytes = 1048576
    band_max_queued  = 50
    ttl              = "10s"
    no_endpoint_wait = "2s"
    fairness         = "round-robin"
    shed_sheddable   = false
    flow_header      = "X-Tenant"
    priority_header  = "X-Priority"
    priority_min     = -1
    priority_max     = 2
  }
}
pool "off" {
  admission { enabled = false }
}
pool "defaults" {}
`
	cfg, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics = %s", FormatDiagnostics(diags))
	}
	want := registry.Admission{MaxQueued: 200, MaxQueuedBytes: 1 << 20, BandMaxQueued: 50, TTL: 10 * time.Second,
		NoEndpointWait: 2 * time.Second, Fairness: "round-robin", QueueSheddable: true, FlowHeader: "x-tenant",
		PriorityHeader: "x-priority", PriorityMin: -1, PriorityMax: 2}
	if got := cfg.State.Pools["tuned"].Admission; got == nil || *got != want {
		t.Errorf("tuned admission = %+v, want %+v", got, want)
	}
	if got := cfg.State.Pools["off"].Admission; got == nil || !got.Disabled {
		t.Errorf("off admission = %+v, want disabled", got)
	}
	if got := cfg.State.Pools["defaults"].Admission; got != nil {
		t.Errorf("defaults admission = %+v, want nil", got)
	}
}

// The replicas block: a static peer list and a Consul service name reach
// the state (canonical addresses, sorted).
func TestLoadReplicas(t *testing.T) {
	t.Parallel()
	src := `
listener "l" { address = "127.0.0.1:8080" }
replicas {
  consul_service = "switchyard"
  peers = ["10.0.0.6:9002", "[2001:db8::1]:9002", "10.0.0.5:9002"]
}
`
	cfg, diags := Parse([]Input{{Name: "r.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics = %s", FormatDiagnostics(diags))
	}
	st := cfg.State
	if st.ReplicaDiscovery == nil || st.ReplicaDiscovery.ConsulService != "switchyard" || st.ReplicaDiscovery.DeclRange != "r.hcl:3:1" {
		t.Fatalf("replica discovery = %+v", st.ReplicaDiscovery)
	}
	var got []string
	for _, r := range st.Replicas {
		if r.Source != SourceName || r.ID != r.Address {
			t.Errorf("replica %+v", r)
		}
		got = append(got, r.Address)
	}
	if want := []string{"10.0.0.5:9002", "10.0.0.6:9002", "[2001:db8::1]:9002"}; !slices.Equal(got, want) {
		t.Fatalf("replicas %v, want %v", got, want)
	}
}

// A pool's kv_events block reaches its state; an endpoint block may
// override it.
func TestLoadKVEvents(t *testing.T) {
	t.Parallel()
	src := `
listener "l" { address = "127.0.0.1:8080" }
pool "chat" {
  endpoints = ["127.0.0.1:8001"]
  kv_events {
    port        = 5557
    replay_port = 5558
    topic       = "kv@"
  }
  endpoint "127.0.0.1:8002" {
    kv_events { port = 6557 }
  }
}
pool "plain" { endpoints = ["127.0.0.1:9001"] }
`
	cfg, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatalf("diagnostics = %s", FormatDiagnostics(diags))
	}
	chat := cfg.State.Pools["chat"]
	if got, want := chat.KVEvents, (registry.KVEvents{Port: 5557, ReplayPort: 5558, Topic: "kv@"}); got == nil || *got != want {
		t.Errorf("pool kv_events = %+v, want %+v", got, want)
	}
	eps := map[string]registry.Endpoint{}
	for _, ep := range chat.Endpoints {
		eps[ep.Address] = ep
	}
	if e := eps["127.0.0.1:8001"]; e.KVEvents != nil || *e.EffectiveKVEvents(chat) != *chat.KVEvents {
		t.Errorf("8001 kv_events = %+v", e.KVEvents)
	}
	if e := eps["127.0.0.1:8002"]; e.KVEvents == nil || *e.EffectiveKVEvents(chat) != (registry.KVEvents{Port: 6557}) {
		t.Errorf("8002 kv_events = %+v", e.KVEvents)
	}
	if p := cfg.State.Pools["plain"]; p.KVEvents != nil || p.Endpoints[0].EffectiveKVEvents(p) != nil {
		t.Errorf("plain pool has kv_events %+v", p.KVEvents)
	}
}

// idle_scrape_interval reads like scrape_interval.
func TestIdleScrapeInterval(t *testing.T) {
	t.Parallel()
	cfg, diags := Parse([]Input{{Name: "a.hcl", Src: []byte("pool \"p\" {\n  scheduling {\n    scrape_interval = \"100ms\"\n    idle_scrape_interval = \"5s\"\n  }\n}\n")}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatal(FormatDiagnostics(diags))
	}
	sc := cfg.State.Pools["p"].Scheduling
	if sc == nil || sc.ScrapeIntervalMS != 100 || sc.IdleScrapeIntervalMS != 5000 {
		t.Fatalf("scheduling %+v", sc)
	}
}
