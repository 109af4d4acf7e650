package picker

import "testing"

func TestPromptText(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ desc, body, want string }{
		{"chat, model first", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, `[{"role":"user","content":"hi"}]`},
		{"chat, messages first", `{"messages":[{"role":"system","content":"s"}] , "model":"m"}`, `[{"role":"system","content":"s"}]`},
		{"completions prompt string", `{"max_tokens":3,"model":"m","prompt":"once upon"}`, `"once upon"`},
		{"escapes and brackets inside strings", `{"x":"a\"}]{[","y":{"z":[1,{"w":"}"}]},"prompt":["p\\",1]}`, `["p\\",1]`},
		{"numbers and literals skipped", `{"n":-1.5e3,"b":true,"nul":null,"messages":[]}`, `[]`},
		{"no prompt key: whole body", `{"model":"m","input":"x"}`, `{"model":"m","input":"x"}`},
		{"not an object: whole body", `[1,2]`, `[1,2]`},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			t.Parallel()
			if got := promptText([]byte(tc.body)); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
