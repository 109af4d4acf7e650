package consul

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// serviceFile is the part of a Consul service definition file this test
// reads.
type serviceFile struct {
	Service struct {
		ID      string            `json:"id"`
		Name    string            `json:"name"`
		Address string            `json:"address"`
		Port    int               `json:"port"`
		Meta    map[string]string `json:"meta"`
		Checks  []struct {
			HTTP     string `json:"http"`
			Interval string `json:"interval"`
			// Deregister must stay empty in definition files (see the
			// test).
			Deregister string `json:"deregister_critical_service_after"`
		} `json:"checks"`
	} `json:"service"`
}

// TestExampleServiceDefinitions checks that the shipped Consul service
// definitions follow the meta convention: each becomes a vllm endpoint
// with models and an HTTP health check, without warnings. None sets
// deregister_critical_service_after: an agent reads a definition file only
// at start or reload, so a host reaped after a long outage would not come
// back when it is up again (examples/consul/README.md).
func TestExampleServiceDefinitions(t *testing.T) {
	t.Parallel()
	root := testutil.RepoRoot(t)
	var files []string
	for _, dir := range []string{"examples/consul", "examples/compose/consul", "examples/compose/consul-gpu"} {
		m, err := filepath.Glob(filepath.Join(root, dir, "*.json"))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) == 0 {
		t.Fatal("no example service definitions found")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var sf serviceFile
			if err := json.Unmarshal(b, &sf); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			s := sf.Service
			if s.ID == "" || s.Name == "" || len(s.Checks) == 0 || s.Checks[0].HTTP == "" || s.Checks[0].Interval == "" {
				t.Errorf("%s: want id, name and an HTTP check with an interval: %+v", f, s)
			}
			for _, c := range s.Checks {
				if c.Deregister != "" {
					t.Errorf("%s: deregister_critical_service_after %q in a definition file: the host would not be registered again when it comes back", f, c.Deregister)
				}
			}
			entry := &api.ServiceEntry{
				Node:    &api.Node{Node: "host", Address: "10.9.9.9"},
				Service: &api.AgentService{ID: s.ID, Service: s.Name, Address: s.Address, Port: s.Port, Meta: s.Meta},
			}
			eps, warnings := convert([]*api.ServiceEntry{entry}, registry.ConsulSelector{Service: s.Name}, registry.EngineVLLM)
			if len(warnings) > 0 || len(eps) != 1 {
				t.Fatalf("%s: endpoints %+v, warnings %q", f, eps, warnings)
			}
			if len(eps[0].Models) == 0 {
				t.Errorf("%s: no meta.models", f)
			}
		})
	}
}
