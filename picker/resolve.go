package picker

import (
	"fmt"

	"github.com/switchyard/switchyard/picker/openai"
)

// The resolve stage: the body's model names a declared model (its pool,
// and the target it is sent upstream as, the body rewritten when they
// differ) or, undeclared, the default pool; a request without a model
// (GET /health) goes to the header-only pool. Inference requests need a
// JSON body with a model (400); an undeclared model without a default
// pool gets 404. GET /v1/models is answered here too (models.go).

// resolve finds the request's pool and model in the current snapshot;
// the request's chain becomes its pool's. parsed locates the model and
// the prompt in the body. A non-zero reply is a local answer. A request
// the admission queue held is resolved again when it leaves the queue:
// it keeps the target it drew (while its model still has it) and is
// counted once, in its model's requests and in the rewrites.
func (r *request) resolve() (pv *poolView, mv *modelView, parsed openai.Request, rep reply) {
	s := r.s
	snap := s.snap.Load()
	r.snap = snap
	r.upstream = r.body
	r.target = ""
	inference := openai.IsInferencePath(string(r.path))
	if len(r.upstream) == 0 {
		if inference && string(r.method) == "POST" {
			return nil, nil, parsed, reply{code: 400, msg: "request body is empty: a JSON object with a \"model\" field is required"}
		}
		pv = snap.headerOnlyPool
	} else if req, tok, err := openai.ModelSpan(r.upstream); err != nil {
		if inference {
			return nil, nil, parsed, reply{code: 400, msg: err.Error()}
		}
		pv, parsed = snap.headerOnlyPool, req
	} else {
		parsed = req
		// Look the model up without materialising the name when possible.
		if !openai.NeedsDecode(tok) {
			mv = snap.models[string(tok[1:len(tok)-1])]
		} else if name := openai.DecodeString(tok); name != "" {
			mv = snap.models[name]
			parsed.Model = name
		}
		if mv == nil {
			if parsed.Model == "" {
				parsed.Model = string(tok[1 : len(tok)-1])
			}
			r.clientModel, r.target = parsed.Model, parsed.Model
			if snap.unknownPool == nil {
				r.missing = true
				return nil, nil, parsed, reply{code: 404, msg: fmt.Sprintf("model %q does not exist", parsed.Model)}
			}
			pv = snap.unknownPool
		} else {
			r.clientModel = mv.model.Name
			pv = mv.pool
			again := r.counted
			if !again || !mv.keepTarget(r) {
				r.target, r.obj = mv.target(randN)
			}
			if !again {
				r.obj.requests.Add(1)
			}
			if r.target != mv.model.Name {
				r.upstream = openai.RewriteModel(r.upstream, parsed, r.target)
				r.rewritten, r.bodyRewritten = true, true
				if !again {
					s.stats.rewritten.Add(1)
				}
			}
			r.counted = true
		}
	}
	if pv != nil {
		r.ch = &pv.chain
	}
	r.priority = 0
	if mv != nil {
		r.priority = mv.model.Priority
	}
	return pv, mv, parsed, reply{}
}

// keepTarget gives r, resolved before (it waited in the admission queue),
// the target and counters it drew then, when mv (perhaps of a newer
// snapshot) still has that target; false when it must draw again.
func (mv *modelView) keepTarget(r *request) bool {
	if len(mv.targets) == 0 {
		if r.target == mv.model.Name {
			r.obj = mv.counters[0]
			return true
		}
		return false
	}
	for i, t := range mv.targets {
		if t == r.target {
			r.obj = mv.counters[i]
			return true
		}
	}
	return false
}
