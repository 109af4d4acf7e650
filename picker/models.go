package picker

import (
	"encoding/json"
	"fmt"
	"net/url"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
)

// modelsPath is OpenAI's model list; modelsPath + "/" + id retrieves one.
const modelsPath = "/v1/models"

// modelObject is one entry of OpenAI's model list.
type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

type modelList struct {
	Object string        `json:"object"`
	Data   []modelObject `json:"data"`
}

// answerModels answers GET /v1/models (and GET /v1/models/ID) itself,
// from what the configuration and discovery know, instead of passing the
// request to one backend whose list would miss the gateway's own names.
// It returns nil for any other request. The stages may narrow the list
// (a tenant sees the models it may use).
func (r *request) answerModels() *extprocv3.ProcessingResponse {
	if !r.headerOnly || string(r.method) != "GET" {
		return nil
	}
	path, _, _ := strings.Cut(string(r.path), "?")
	if path != modelsPath && !strings.HasPrefix(path, modelsPath+"/") {
		return nil
	}
	created := r.s.started.Unix()
	ids := r.s.snap.Load().modelIDs()
	for _, h := range r.ch.models {
		ids = h.listModels(r, ids)
	}
	if path == modelsPath || path == modelsPath+"/" {
		l := modelList{Object: "list", Data: make([]modelObject, 0, len(ids))}
		for _, id := range ids {
			l.Data = append(l.Data, modelObject{ID: id, Object: "model", Created: created, OwnedBy: "switchyard"})
		}
		return jsonReply(200, l)
	}
	id := strings.TrimPrefix(path, modelsPath+"/")
	if u, err := url.PathUnescape(id); err == nil {
		id = u
	}
	if _, ok := slices.BinarySearch(ids, id); !ok {
		return immediate(404, fmt.Sprintf("model %q does not exist", id))
	}
	return jsonReply(200, modelObject{ID: id, Object: "model", Created: created, OwnedBy: "switchyard"})
}

// modelIDs returns, sorted, the model names a request may name and be
// routed: every declared model (including rewrite names such as "chat",
// and targets that are models themselves), and, when there is a default
// pool, every name its endpoints that are not draining advertise
// (configured models lists, and what each server lists in its own
// /v1/models: base models and LoRA adapters). A target that is not itself a model, or a name only a
// non-default pool advertises, is left out: requested directly, it would
// get a 404.
func (snap *snapshot) modelIDs() []string {
	seen := make(map[string]bool, len(snap.models))
	for name := range snap.models {
		seen[name] = true
	}
	if pv := snap.unknownPool; pv != nil {
		for _, e := range pv.eps {
			if e.Draining {
				continue // takes no new requests
			}
			for _, m := range e.Models {
				seen[m] = true
			}
			if s := e.Snapshot(); s != nil {
				for _, m := range s.ServedModels {
					seen[m] = true
				}
			}
		}
	}
	ids := make([]string, 0, len(seen))
	for id := range seen {
		if id != "" {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// jsonReply builds a local reply with v as its JSON body.
func jsonReply(code int, v any) *extprocv3.ProcessingResponse {
	body, _ := json.Marshal(v) // plain structs of strings and numbers
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status: &typev3.HttpStatus{Code: typev3.StatusCode(code)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
					setHeader("content-type", "application/json"),
				}},
				Body:    body,
				Details: "switchyard_picker_models",
			},
		},
	}
}
