package hclfile

import (
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/sched"
)

// TestAttributeErrors pins the diagnostics of a bad value for every
// attribute of every block (wrong type, null, failing checks): each line
// is the full "file:line:column: error: summary: detail".
func TestAttributeErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc string
		src  string
		want []string
	}{
		{"listener-address-list", "listener \"l\" { address = [\"127.0.0.1:1\"] }\n", []string{
			`a.hcl:1:26: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"listener-address-null", "listener \"l\" { address = null }\n", []string{
			`a.hcl:1:26: error: Missing value: A value is required here, not null`,
		}},
		{"routing-default-list", "routing { default_pool = [] }\n", []string{
			`a.hcl:1:26: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"pool-endpoints-string", "pool \"p\" { endpoints = \"127.0.0.1:1\" }\n", []string{
			`a.hcl:1:25: error: Invalid expression: A static list expression is required`,
		}},
		{"pool-endpoints-nested", "pool \"p\" { endpoints = [[\"127.0.0.1:1\"]] }\n", []string{
			`a.hcl:1:25: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"pool-engine-list", "pool \"p\" { engine = [] }\n", []string{
			`a.hcl:1:21: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"pool-failure-list", "pool \"p\" { failure_mode = {} }\n", []string{
			`a.hcl:1:27: error: Incorrect value type: Expected a string, got a object`,
		}},
		{"pool-metrics-path-null", "pool \"p\" { metrics_path = null }\n", []string{
			`a.hcl:1:27: error: Missing value: A value is required here, not null`,
		}},
		{"pool-consul-types", "pool \"p\" {\n  consul {\n    service = []\n    tag = \" x\"\n    datacenter = []\n    passing_only = \"maybe\"\n  }\n}\n", []string{
			`a.hcl:3:15: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:4:11: error: Invalid consul tag: " x" is not a valid Consul tag name`,
			`a.hcl:5:18: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:6:20: error: Incorrect value type: Expected a bool, got a string`,
		}},
		{"pool-consul-service-bad", "pool \"p\" {\n  consul {\n    service = \"a/b\"\n  }\n}\n", []string{
			`a.hcl:3:15: error: Invalid consul service: "a/b" is not a valid Consul service name`,
		}},
		{"pool-consul-missing", "pool \"p\" {\n  consul {\n    tag = \"x\"\n  }\n}\n", []string{
			`a.hcl:2:10: error: Missing required argument: The argument "service" is required, but no definition was found`,
		}},
		{"endpoint-types", "pool \"p\" {\n  engine = \"tgi\"\n  endpoint \"127.0.0.1:1\" {\n    draining = \"x\"\n    metrics_path = []\n    models = \"m\"\n  }\n}\n", []string{
			`a.hcl:2:12: error: Unknown engine: Unknown engine "tgi": want one of "vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"`,
			`a.hcl:4:16: error: Incorrect value type: Expected a bool, got a string`,
			`a.hcl:5:20: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:6:15: error: Invalid expression: A static list expression is required`,
		}},
		{"endpoint-models-nested", "pool \"p\" {\n  endpoint \"127.0.0.1:1\" {\n    models = [[1]]\n  }\n}\n", []string{
			`a.hcl:3:15: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"endpoint-metrics-bad", "pool \"p\" {\n  metrics_path = \"nope\"\n  endpoint \"127.0.0.1:1\" {\n    metrics_path = []\n  }\n}\n", []string{
			`a.hcl:2:18: error: Invalid metrics_path: Bad metrics_path "nope": want an absolute path such as "/metrics"`,
			`a.hcl:4:20: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"endpoint-metrics-invalid", "pool \"p\" {\n  endpoint \"127.0.0.1:1\" {\n    metrics_path = \"x\"\n  }\n}\n", []string{
			`a.hcl:3:20: error: Invalid metrics_path: Bad metrics_path "x": want an absolute path such as "/metrics"`,
		}},
		{"sched-strings", "pool \"p\" {\n  scheduling {\n    profile = []\n    picker = []\n    session_header = []\n    scrape_interval = []\n  }\n}\n", []string{
			`a.hcl:3:15: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:4:14: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:5:22: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:6:23: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"sched-session-bad", "pool \"p\" {\n  scheduling {\n    session_header = \"X Session\"\n  }\n}\n", []string{
			`a.hcl:3:22: error: Invalid session_header: "X Session" is not a valid HTTP header name`,
		}},
		{"sched-numbers", "pool \"p\" {\n  scheduling {\n    queue_threshold = \"x\"\n    kv_threshold = \"y\"\n  }\n}\n", []string{
			`a.hcl:3:23: error: Incorrect value type: Expected a number, got a string`,
			`a.hcl:4:20: error: Incorrect value type: Expected a number, got a string`,
		}},
		{"sched-int-range", "pool \"p\" {\n  scheduling {\n    queue_threshold = 1e12\n    kv_threshold = null\n  }\n}\n", []string{
			`a.hcl:3:23: error: Incorrect value type: The number is out of range`,
			`a.hcl:4:20: error: Missing value: A value is required here, not null`,
		}},
		{"sched-maps", "pool \"p\" {\n  scheduling {\n    scorers = \"q\"\n    metrics = []\n  }\n}\n", []string{
			`a.hcl:3:16: error: Invalid expression: A static map expression is required`,
			`a.hcl:4:15: error: Invalid expression: A static map expression is required`,
		}},
		{"sched-map-values", "pool \"p\" {\n  scheduling {\n    scorers = { queue = \"x\", kv_cache = 2, \"\" = 1 }\n    metrics = { waiting = [], \"\" = \"y\" }\n  }\n}\n", []string{
			`a.hcl:3:25: error: Incorrect value type: Expected a number, got a string`,
			`a.hcl:3:49: error: Invalid scheduling: Unknown scorer "": want one of "queue", "running", "kv-cache", "in-flight", "in-flight-tokens", "prefix", "lora", "session", "ttft"`,
			`a.hcl:4:27: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:4:31: error: Invalid scheduling: Unknown metric "": want one of "waiting", "running", "kv_usage", "lora_info", "cache_config"`,
		}},
		{"sched-map-keys", "pool \"p\" {\n  scheduling {\n    scorers = { ([\"a\"]) = 1 }\n  }\n}\n", []string{
			`a.hcl:3:17: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"model-types", "pool \"p\" {}\nmodel \"m\" {\n  pool = []\n  priority = 1.5\n}\n", []string{
			`a.hcl:3:10: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:4:14: error: Incorrect value type: Expected a whole number`,
		}},
		{"model-target-weight", "pool \"p\" {}\nmodel \"m\" {\n  pool = \"p\"\n  target \"x\" { weight = \"heavy\" }\n  target \"y\" { weight = -1 }\n}\n", []string{
			`a.hcl:4:25: error: Incorrect value type: Expected a number, got a string`,
			`a.hcl:5:25: error: Invalid target weights: Target "y" has negative weight -1`,
		}},
		{"model-priority-string", "pool \"p\" {}\nmodel \"m\" {\n  pool = \"p\"\n  priority = \"high\"\n}\n", []string{
			`a.hcl:4:14: error: Incorrect value type: Expected a number, got a string`,
		}},
		{"agent-empty", "consul {\n  address = \"\"\n  token = \" \"\n  token_file = []\n}\npool \"p\" {}\n", []string{
			`a.hcl:2:13: error: Empty address: The consul block's address is empty; leave it out to use the environment`,
			`a.hcl:3:11: error: Empty token: The consul block's token is empty; leave it out to use the environment`,
			`a.hcl:4:16: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"agent-tls-types", "consul {\n  tls {\n    server_name = \"\"\n    ca_file = []\n    insecure_skip_verify = \"no\"\n    cert_file = \"c\"\n  }\n  tls {}\n}\npool \"p\" {}\n", []string{
			`a.hcl:2:3: error: Incomplete client certificate: Set both cert_file and key_file, or neither`,
			`a.hcl:3:19: error: Empty server_name: The consul block's server_name is empty; leave it out to use the environment`,
			`a.hcl:4:15: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:5:28: error: Incorrect value type: Expected a bool, got a string`,
			`a.hcl:8:3: error: Duplicate tls block: The consul block may have one tls block`,
		}},
		{"tls-types", "tls {\n  cert_file = \"\"\n  allowed_sans = \"x\"\n  allow_plaintext = \"y\"\n  admin_tls = []\n  envoy_dir = []\n}\npool \"p\" {}\n", []string{
			`a.hcl:2:15: error: Empty cert_file: The tls block's cert_file is empty; leave it out instead`,
			`a.hcl:3:19: error: Invalid expression: A static list expression is required`,
			`a.hcl:4:21: error: Incorrect value type: Expected a bool, got a string`,
			`a.hcl:5:15: error: Incorrect value type: Expected a bool, got a tuple`,
			`a.hcl:6:15: error: Incorrect value type: Expected a string, got a tuple`,
		}},
		{"tls-sans-nested", "tls {\n  allowed_sans = [[1]]\n  admin_token_file = \"  \"\n}\npool \"p\" {}\n", []string{
			`a.hcl:2:19: error: Incorrect value type: Expected a string, got a tuple`,
			`a.hcl:3:22: error: Empty admin_token_file: The tls block's admin_token_file is empty; leave it out instead`,
		}},
		{"empty-labels", "pool \"\" {}\nmodel \" \" {\n  pool = \"p\"\n}\nlistener \"\" {\n  address = \"127.0.0.1:1\"\n}\n", []string{
			`a.hcl:1:6: error: Empty pool name: A pool block needs a non-empty name label`,
			`a.hcl:2:7: error: Empty model name: A model block needs a non-empty name label`,
			`a.hcl:5:10: error: Empty listener name: A listener block needs a non-empty name label`,
		}},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			_, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(tc.src)}}, sched.Rules)
			got := strings.Split(FormatDiagnostics(diags), "\n")
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("got:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestConsulAgentEveryAttribute decodes every attribute of the top-level
// consul block (full.hcl has the usual ones).
func TestConsulAgentEveryAttribute(t *testing.T) {
	t.Parallel()
	src := `consul {
  address    = "unix:///run/consul.sock"
  token_file = "/etc/consul.token"
  tls {
    server_name          = "consul.internal"
    ca_file              = "/ca.pem"
    ca_path              = "/etc/ca.d"
    cert_file            = "/c.pem"
    key_file             = "/k.pem"
    insecure_skip_verify = true
  }
}
pool "p" {}
`
	cfg, diags := Parse([]Input{{Name: "a.hcl", Src: []byte(src)}}, sched.Rules)
	if diags.HasErrors() {
		t.Fatal(FormatDiagnostics(diags))
	}
	want := ConsulAgent{Address: "unix:///run/consul.sock", TokenFile: "/etc/consul.token", TLS: ConsulTLS{
		ServerName: "consul.internal", CAFile: "/ca.pem", CAPath: "/etc/ca.d", CertFile: "/c.pem", KeyFile: "/k.pem", InsecureSkipVerify: true}}
	if cfg.Consul == nil || *cfg.Consul != want {
		t.Errorf("consul block = %+v, want %+v", cfg.Consul, want)
	}
}
