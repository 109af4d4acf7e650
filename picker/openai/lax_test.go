package openai

import (
	"bufio"
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/realvllm"
)

// laxCase is one raw JSON value and how vLLM 0.32 reads it, as a bool
// field ("stream") and as an int field ("max_tokens"): "N" null (None),
// "E" rejected, else the value.
type laxCase struct {
	raw, asBool, asInt string
}

// laxCases were checked against vLLM 0.32's ChatCompletionRequest
// (TestRealVLLMLaxJSONMatchesPydantic checks many more against it).
var laxCases = []laxCase{
	{`true`, "1", "1"}, {`false`, "0", "0"}, {`null`, "N", "N"},
	{`1`, "1", "1"}, {`0`, "0", "0"}, {`1.0`, "1", "1"}, {`-0.0`, "0", "0"}, {`1e0`, "1", "1"}, {`2`, "E", "2"},
	{`0.5`, "E", "E"}, {`5.5`, "E", "E"}, {`1e2`, "E", "100"}, {`1e400`, "E", "E"}, {`-7`, "E", "-7"},
	{`"true"`, "1", "E"}, {`"True"`, "1", "E"}, {`"tRuE"`, "1", "E"}, {`"1"`, "1", "1"}, {`"t"`, "1", "E"},
	{`"y"`, "1", "E"}, {`"yes"`, "1", "E"}, {`"on"`, "1", "E"}, {`"ON"`, "1", "E"},
	{`"false"`, "0", "E"}, {`"0"`, "0", "0"}, {`"f"`, "0", "E"}, {`"n"`, "0", "E"}, {`"no"`, "0", "E"}, {`"off"`, "0", "E"},
	{`" true"`, "E", "E"}, {`"true "`, "E", "E"}, {`""`, "E", "E"}, {`"1.0"`, "E", "1"}, {`"yeſ"`, "E", "E"},
	{`"\u0074rue"`, "1", "E"}, {`[]`, "E", "E"}, {`{}`, "E", "E"},
	{`"5"`, "E", "5"}, {`" 5 "`, "E", "5"}, {`"+5"`, "E", "5"}, {`"-5"`, "E", "-5"}, {`"05"`, "E", "5"},
	{`"5.00"`, "E", "5"}, {`"5."`, "E", "E"}, {`".5"`, "E", "E"}, {`"5.5"`, "E", "E"}, {`"5_0"`, "E", "50"},
	{`"_5"`, "E", "E"}, {`"5_"`, "E", "E"}, {`"5__0"`, "E", "E"}, {`"1e1"`, "E", "E"}, {`"0x5"`, "E", "E"},
	{`"+-5"`, "E", "E"}, {`"--5"`, "E", "E"}, {`"0-5"`, "E", "-5"}, {`"-0-5"`, "E", "E"}, {`"\u00a05"`, "E", "5"},
	{`"٥"`, "E", "E"}, {`"99999999999999999999999"`, "E", strconv.Itoa(maxLaxInt)},
}

func (c laxCase) check(t *testing.T) {
	t.Helper()
	b, ok := laxBool([]byte(c.raw))
	gotBool := "E"
	switch {
	case ok && c.raw == "null":
		gotBool = "N"
	case ok && b:
		gotBool = "1"
	case ok:
		gotBool = "0"
	}
	n, present, ok := laxInt([]byte(c.raw))
	gotInt := "E"
	switch {
	case ok && !present:
		gotInt = "N"
	case ok:
		gotInt = strconv.FormatInt(n, 10)
	}
	if gotBool != c.asBool || gotInt != c.asInt {
		t.Errorf("%s: as bool %s, as int %s; vLLM reads %s and %s", c.raw, gotBool, gotInt, c.asBool, c.asInt)
	}
}

func TestLaxBoolAndInt(t *testing.T) {
	t.Parallel()
	for _, c := range laxCases {
		c.check(t)
	}
}

// pydanticScript validates each JSON value read from stdin (one a line)
// as vLLM's chat request's stream and max_tokens, printing "bool int" per
// line with N for None and E for a rejection.
const pydanticScript = `
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
def check(field, v):
    try:
        r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], field: v})
    except Exception:
        return "E"
    x = getattr(r, field)
    if x is None:
        return "N"
    return str(int(x))
for line in sys.stdin:
    v = json.loads(line)
    print(check("stream", v), check("max_tokens", v), flush=False)
`

// TestRealVLLMLaxJSONMatchesPydantic reads thousands of JSON values,
// strings built from the characters pydantic's rules turn on, as the
// picker does and as vLLM's own request model does, and compares.
func TestRealVLLMLaxJSONMatchesPydantic(t *testing.T) {
	py := realvllm.Require(t)
	var raws []string
	seen := map[string]bool{}
	add := func(raw string) {
		if !seen[raw] && json.Valid([]byte(raw)) {
			seen[raw] = true
			raws = append(raws, raw)
		}
	}
	for _, c := range laxCases {
		add(c.raw)
	}
	alphabet := []string{"0", "1", "5", "-", "+", "_", ".", " ", "e", "t", "T", "y", "n", "o", "f", "\u00a0", "\u2003", "x"}
	var build func(prefix string, depth int)
	build = func(prefix string, depth int) {
		b, _ := json.Marshal(prefix)
		add(string(b))
		if depth == 0 {
			return
		}
		for _, c := range alphabet {
			build(prefix+c, depth-1)
		}
	}
	build("", 3)
	r := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		var s strings.Builder
		for range 4 + r.IntN(4) {
			s.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		b, _ := json.Marshal(s.String())
		add(string(b))
	}
	for _, w := range []string{"true", "false", "yes", "no", "on", "off"} {
		for mask := range 1 << len(w) {
			var s strings.Builder
			for i, c := range w {
				if mask&(1<<i) != 0 {
					c -= 'a' - 'A'
				}
				s.WriteRune(c)
			}
			add(strconv.Quote(s.String()))
		}
	}
	for _, n := range []string{"0", "-0", "1", "2", "-1", "1.0", "1.5", "0.0", "1e0", "1E1", "2.5e1", "1e-1", "123456789012345678901234567890", "9.9e18", "1e19"} {
		add(n)
	}

	cmd := exec.Command(py, "-c", pydanticScript)
	cmd.Stdin = strings.NewReader(strings.Join(raws, "\n") + "\n")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pydantic: %v\n%s", err, stderr.String())
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	i := 0
	for sc.Scan() {
		if i >= len(raws) {
			t.Fatalf("more answers than values: %q", sc.Text())
		}
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			t.Fatalf("answer %q", sc.Text())
		}
		if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
			f[1] = strconv.FormatInt(min(max(n, -maxLaxInt), maxLaxInt), 10)
		} else if len(f[1]) > 18 && f[1] != "E" && f[1] != "N" {
			if f[1][0] == '-' {
				f[1] = strconv.Itoa(-maxLaxInt)
			} else {
				f[1] = strconv.Itoa(maxLaxInt)
			}
		}
		laxCase{raws[i], f[0], f[1]}.check(t)
		i++
	}
	if i != len(raws) {
		t.Fatalf("%d answers for %d values", i, len(raws))
	}
	t.Logf("%d values compared with vLLM 0.32's reading", len(raws))
}
