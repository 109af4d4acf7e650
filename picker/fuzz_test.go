package picker

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/switchyard/switchyard/picker/openai"
)

// FuzzParseRequest checks that request parsing never panics, agrees with
// encoding/json on the top-level "model" and on the presence of a prompt,
// and that a rewrite keeps the body valid and changes only the model. Run: go test -run '^$' -fuzz FuzzParseRequest ./picker/
func FuzzParseRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"llama","prompt":"hi"}`,
		`{"messages":[{"role":"user","content":"x"}],"model":"m","stream":true}`,
		`{"model":"a\"b\\c\u00e9"}`,
		`{"mod\u0065l":"x"}`,
		`{"tools":[{"model":"inner"}],"model":"outer"}`,
		`{"model":"first","model":"second"}`,
		`{"model":null}`,
		`{"model":1}`,
		`[{"model":"x"}]`,
		`{"model":"x"`,
		`{"prompt":"\"model\":\"fake\"","model":"real"}`,
		" {\n\"model\" :\t\"ws\" } ",
		`{}`,
		``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := openai.ParseRequest(body)
		// Reference: exact-case keys, last duplicate wins.
		var obj map[string]json.RawMessage
		var refModel string
		refOK := json.Unmarshal(body, &obj) == nil && json.Unmarshal(obj["model"], &refModel) == nil && refModel != ""
		// Validity must agree with encoding/json for object documents.
		if isObject := json.Unmarshal(body, &obj) == nil && obj != nil; isObject == (err == openai.ErrInvalidJSON) {
			t.Fatalf("validity of %q: parser says %v, encoding/json object=%v", body, err, isObject)
		}
		// The prompt span is the value of a top-level "messages" or
		// "prompt" key whenever the document has one.
		if err != openai.ErrInvalidJSON {
			_, hasMessages := obj["messages"]
			_, hasPrompt := obj["prompt"]
			if found := r.PromptEnd > 0; found != (hasMessages || hasPrompt) {
				t.Fatalf("prompt of %q found %v, encoding/json keys messages %v prompt %v", body, found, hasMessages, hasPrompt)
			}
			if p := r.Prompt(body); r.PromptEnd > 0 && !json.Valid([]byte(p)) {
				t.Fatalf("prompt span of %q is %q, not a JSON value", body, p)
			}
		}
		if err != nil {
			if refOK {
				t.Fatalf("rejected %q (%v) but encoding/json finds model %q", body, err, refModel)
			}
			return
		}
		if !refOK || refModel != r.Model {
			t.Fatalf("model %q, encoding/json says %q", r.Model, refModel)
		}
		out := openai.RewriteModel(body, r, "rewritten/ü\"")
		r2, err := openai.ParseRequest(out)
		if err != nil || r2.Model != "rewritten/ü\"" {
			t.Fatalf("rewrite of %q broke it: %q %v", body, out, err)
		}
		if !bytes.Equal(out[:r.ValueStart], body[:r.ValueStart]) || !bytes.Equal(out[r2.ValueEnd:], body[r.ValueEnd:]) {
			t.Fatalf("rewrite changed bytes outside the model value")
		}
		// The SSE rewriter gives the same output however the stream is split.
		doc := append(append([]byte("data: "), body...), "\n\n"...)
		whole := openai.NewResponseRewriter(openai.EventStream, "c", 1<<20).Write(doc, true)
		w := openai.NewResponseRewriter(openai.EventStream, "c", 1<<20)
		cut := len(doc) / 3
		split := append(append([]byte{}, w.Write(doc[:cut], false)...), w.Write(doc[cut:], true)...)
		if !bytes.Equal(whole, split) {
			t.Fatalf("SSE split changes output: %q vs %q", whole, split)
		}
	})
}
