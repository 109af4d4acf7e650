package picker

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/sched"
	"github.com/switchyard/switchyard/registry"
)

// servedBy is a metrics source whose server lists the given models.
type servedBy []string

func (s servedBy) Load() *metrics.Snapshot { return &metrics.Snapshot{ServedModels: s} }

func TestModelIDs(t *testing.T) {
	t.Parallel()
	served := map[string]servedBy{
		"10.0.1.3:8000": {"beta-large", "beta-lora"}, // what the server itself lists
		"10.0.1.1:8000": {"drained-only"},            // draining: not counted
		"10.0.0.1:8000": {"alpha-only"},              // a pool that is not the default
	}
	deps := buildDeps{handle: func(k metrics.Key) sched.MetricsSource {
		if s, ok := served[k.Address]; ok {
			return s
		}
		return nil
	}}
	for _, tc := range []struct {
		desc, defaultPool string
		want              []string
	}{{
		desc: "no default pool: declared models only",
		// "llama-3-8b-instruct" is only chat's target: requested by
		// itself it would get a 404.
		want: []string{"beta-gone", "beta-small", "bulk", "chat", "llama"},
	}, {
		desc:        "default pool: plus what its live endpoints advertise",
		defaultPool: "beta",
		want:        []string{"beta-gone", "beta-large", "beta-lora", "beta-small", "bulk", "chat", "llama"},
	}} {
		t.Run(tc.desc, func(t *testing.T) {
			st := testState()
			st.Routing.DefaultPool = tc.defaultPool
			// Handles are not wired for draining endpoints; give the
			// draining one its models as configuration instead.
			st.Pools["beta"].Endpoints[0].Models = []string{"drained-only"}
			snap := buildSnapshot(st, &loads{}, deps)
			if got := snap.modelIDs(); !slices.Equal(got, tc.want) {
				t.Errorf("models = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestModelsAnsweredByThePicker(t *testing.T) {
	st := testState()
	st.Models["meta-llama/Llama-3.1-8B"] = &registry.Model{Name: "meta-llama/Llama-3.1-8B", Pool: "alpha"}
	h := newHarness(t, st, Options{})
	get := func(path string) (int, []byte) {
		t.Helper()
		s := h.duplex()
		s.send(reqHeaders(true, ":method", "GET", ":path", path))
		ir := s.recv().GetImmediateResponse()
		if ir == nil {
			t.Fatalf("GET %s: not answered by the picker", path)
		}
		for _, hv := range ir.GetHeaders().GetSetHeaders() {
			if hv.GetHeader().GetKey() == "content-type" && string(hv.GetHeader().GetRawValue()) != "application/json" {
				t.Errorf("GET %s: content-type %s", path, hv.GetHeader().GetRawValue())
			}
		}
		return int(ir.GetStatus().GetCode()), ir.GetBody()
	}

	for _, path := range []string{"/v1/models", "/v1/models?limit=5"} {
		code, body := get(path)
		var l struct {
			Object string
			Data   []struct {
				ID, Object string
				OwnedBy    string `json:"owned_by"`
				Created    int64
			}
		}
		if err := json.Unmarshal(body, &l); err != nil || code != 200 || l.Object != "list" {
			t.Fatalf("GET %s: %d %s (%v)", path, code, body, err)
		}
		var ids []string
		for _, m := range l.Data {
			ids = append(ids, m.ID)
			if m.Object != "model" || m.Created != h.srv.started.Unix() {
				t.Errorf("GET %s: entry %+v", path, m)
			}
		}
		want := []string{"beta-gone", "beta-small", "bulk", "chat", "llama", "meta-llama/Llama-3.1-8B"}
		if !slices.Equal(ids, want) {
			t.Errorf("GET %s: ids %q, want %q", path, ids, want)
		}
		if missing := testutil.ContainsAll(string(body), `"owned_by":"switchyard"`, `"object":"list"`); len(missing) > 0 {
			t.Errorf("GET %s: body %s lacks %q", path, body, missing)
		}
	}

	for path, want := range map[string]string{
		"/v1/models/chat":                      "chat",
		"/v1/models/meta-llama/Llama-3.1-8B":   "meta-llama/Llama-3.1-8B",
		"/v1/models/meta-llama%2FLlama-3.1-8B": "meta-llama/Llama-3.1-8B",
	} {
		code, body := get(path)
		var m struct{ ID, Object string }
		if err := json.Unmarshal(body, &m); err != nil || code != 200 || m.ID != want || m.Object != "model" {
			t.Errorf("GET %s: %d %s, want model %q", path, code, body, want)
		}
	}
	if code, body := get("/v1/models/llama-3-8b-instruct"); code != 404 || len(testutil.ContainsAll(string(body), `does not exist`, `"code":404`)) > 0 {
		t.Errorf("GET a model nobody may request: %d %s, want 404", code, body)
	}

	// Other header-only requests still go to a pool.
	s := h.duplex()
	s.send(reqHeaders(true, ":method", "GET", ":path", "/v1/modelsx"))
	if d := decisionOf(t, s.recv()); d.pool != "alpha" {
		t.Errorf("GET /v1/modelsx went to pool %q, want alpha", d.pool)
	}
	s.send(respHeaders(true, ":status", "200"))
	s.recv()
	h.waitInFlight(0)
}
