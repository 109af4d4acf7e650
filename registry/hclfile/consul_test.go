package hclfile

import (
	"reflect"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

func TestConsulBlock(t *testing.T) {
	t.Parallel()
	src := `
pool "llama" {
  consul {
    service      = "vllm"
    tag          = "llama-8b"
    datacenter   = "dc1"
    passing_only = true
  }
}
pool "plain" {
  endpoints = ["10.0.0.1:8000"]
  consul {
    service = "sglang"
  }
}
pool "none" {
  endpoints = ["10.0.0.2:8000"]
}
listener "l" {
  address = "127.0.0.1:8080"
}
`
	cfg, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(src)}}, sched.Rules)
	if len(diags) > 0 {
		t.Fatalf("diagnostics:\n%s", FormatDiagnostics(diags))
	}
	want := map[string]*registry.ConsulSelector{
		"llama": {Service: "vllm", Tag: "llama-8b", Datacenter: "dc1", PassingOnly: true},
		"plain": {Service: "sglang"},
		"none":  nil,
	}
	for name, w := range want {
		p := cfg.State.Pools[name]
		if p == nil {
			t.Fatalf("pool %q missing", name)
		}
		if !reflect.DeepEqual(p.Consul, w) {
			t.Errorf("pool %q Consul = %+v, want %+v", name, p.Consul, w)
		}
	}
}

func TestConsulBlockErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc, src, want string
	}{
		{"service required", "pool \"p\" {\n  consul {\n    tag = \"x\"\n  }\n}\n",
			`c.hcl:2:10: error: Missing required argument`},
		{"empty service", "pool \"p\" {\n  consul {\n    service = \"\"\n  }\n}\n",
			`c.hcl:3:15: error: Invalid consul service: "" is not a valid Consul service name`},
		{"service with a slash", "pool \"p\" {\n  consul {\n    service = \"a/b\"\n  }\n}\n",
			`c.hcl:3:15: error: Invalid consul service: "a/b"`},
		{"passing_only not a bool", "pool \"p\" {\n  consul {\n    service = \"v\"\n    passing_only = \"maybe\"\n  }\n}\n",
			`c.hcl:4:20: error: Incorrect value type: Expected a bool`},
		{"unknown attribute", "pool \"p\" {\n  consul {\n    service = \"v\"\n    address = \"x\"\n  }\n}\n",
			`c.hcl:4:5: error: Unsupported argument`},
		{"two consul blocks", "pool \"p\" {\n  consul {\n    service = \"v\"\n  }\n  consul {\n    service = \"w\"\n  }\n}\n",
			`c.hcl:5:3: error: Duplicate consul block: Pool "p" already has a consul block at c.hcl:2:3`},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			_, diags := Parse([]Input{{Name: "c.hcl", Src: []byte(tc.src)}}, sched.Rules)
			if !diags.HasErrors() {
				t.Fatalf("no error, want %q", tc.want)
			}
			got := FormatDiagnostics(diags)
			if !strings.Contains(got, tc.want) {
				t.Errorf("diagnostics:\n%s\nwant them to contain %q", got, tc.want)
			}
		})
	}
}
