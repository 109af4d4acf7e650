package metrics

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/switchyard/switchyard/registry"
)

// pages are every recorded or generated page the parsers are compared on.
func diffPages(t testing.TB) map[string][]byte {
	pages := map[string][]byte{}
	for _, f := range []string{"vllm.txt", "vllm_legacy.txt", "sglang.txt", "trtllm.txt", "triton.txt"} {
		pages[f] = fixture(t, f)
	}
	real, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	pages["vllm-0.32.0"] = real
	return pages
}

var diffEngines = []registry.Engine{registry.EngineVLLM, registry.EngineSGLang, registry.EngineTRTLLM, registry.EngineTritonTRT}

// sameValues compares the one-pass parser's answer with the reference's
// (the Prometheus text parser), which may list TTFT buckets in another
// order when series disagree on them.
func sameValues(a, b Values) bool {
	ha, hb := a.TTFT, b.TTFT
	a.TTFT, b.TTFT = nil, nil
	if !reflect.DeepEqual(a, b) || (ha == nil) != (hb == nil) {
		return false
	}
	// NaN sums compare by their printed form.
	return ha == nil || fmt.Sprintf("%v", *ha) == fmt.Sprintf("%v", *hb)
}

// TestParseMatchesReference holds the one-pass parser to the Prometheus
// text parser on every recorded page, for every dialect, and on the same
// pages reshuffled: series in reverse order, comments dropped, Windows
// line ends, timestamps added.
func TestParseMatchesReference(t *testing.T) {
	t.Parallel()
	for name, page := range diffPages(t) {
		variants := map[string][]byte{"as recorded": page}
		lines := strings.Split(strings.TrimRight(string(page), "\n"), "\n")
		var samples, noComments, stamped []string
		for _, l := range lines {
			if !strings.HasPrefix(l, "#") {
				samples = append(samples, l)
				noComments = append(noComments, l)
				stamped = append(stamped, l+" 1700000000000")
			} else {
				stamped = append(stamped, l)
			}
		}
		variants["no comments"] = []byte(strings.Join(noComments, "\n") + "\n")
		variants["crlf"] = []byte(strings.Join(lines, "\r\n") + "\r\n")
		variants["timestamps"] = []byte(strings.Join(stamped, "\n"))
		rev := make([]string, len(samples))
		for i, l := range samples {
			rev[len(samples)-1-i] = l
		}
		variants["reversed, no comments"] = []byte(strings.Join(rev, "\n") + "\n")
		for vname, v := range variants {
			for _, e := range diffEngines {
				compareParsers(t, fmt.Sprintf("%s %s as %s", name, vname, e), e, nil, v)
			}
		}
	}
}

func compareParsers(t *testing.T, desc string, e registry.Engine, overrides map[string]string, page []byte) {
	t.Helper()
	ref, err := newRefParser(e, overrides)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewParser(e, overrides)
	if err != nil {
		t.Fatal(err)
	}
	want, werr := ref.Parse(bytes.Clone(page))
	got, gerr := p.Parse(bytes.Clone(page))
	if werr != nil {
		return // the reference refuses pages the one-pass parser may read
	}
	if gerr != nil {
		t.Errorf("%s: reference parsed it, Parse: %v", desc, gerr)
		return
	}
	if !ttftWellFormed(page) {
		// The reference read the TTFT histogram's lines leniently, in
		// its own way; the parsers may disagree on malformed ones.
		got.TTFT, want.TTFT = nil, nil
	}
	if !sameValues(got, want) {
		t.Errorf("%s:\ngot  %+v %+v\nwant %+v %+v", desc, got, got.TTFT, want, want.TTFT)
	}
}

// TestParseMatchesReferenceRandom compares the parsers on random pages
// built from the recorded vLLM page: random subsets of its lines, label
// sets rewritten with extra labels and blanks, values in other notations.
func TestParseMatchesReferenceRandom(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile("../../cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(page), "\n"), "\n")
	rng := rand.New(rand.NewPCG(25, 1))
	values := []string{"0", "1", "1.0", "3e2", "2.5E-1", "-1", "+Inf", "NaN", "0.4213", "123456789012345678", "1.000000000000000000001"}
	for i := 0; i < 300; i++ {
		var out []string
		for _, l := range lines {
			if rng.IntN(4) == 0 {
				continue
			}
			if !strings.HasPrefix(l, "#") && rng.IntN(3) == 0 {
				name, rest, hasLabels := strings.Cut(l, "{")
				if hasLabels && rng.IntN(2) == 0 {
					l = name + `{ zz="a,b\"c" , ` + rest
				}
				if sp := strings.LastIndexByte(l, ' '); sp > 0 {
					l = l[:sp+1] + values[rng.IntN(len(values))]
				}
			}
			out = append(out, l)
		}
		compareParsers(t, fmt.Sprintf("random page %d", i), registry.EngineVLLM, nil, []byte(strings.Join(out, "\n")+"\n"))
		if t.Failed() {
			return
		}
	}
}

// FuzzParse: on any page the reference reads, the one-pass parser gives
// the same Values.
func FuzzParse(f *testing.F) {
	for _, p := range diffPages(f) {
		f.Add(p)
	}
	f.Add([]byte("vllm:num_requests_waiting{model_name=\"a\"} 3\n{\"vllm:num_requests_running\",x=\"y\"} 2\n"))
	f.Fuzz(func(t *testing.T, page []byte) {
		for _, e := range diffEngines {
			compareParsers(t, string(e), e, nil, page)
		}
	})
}

// ttftWellFormed reports whether the Prometheus text parser accepts the
// page's lines that start like vLLM's TTFT histogram's.
func ttftWellFormed(page []byte) bool {
	var b bytes.Buffer
	for _, l := range bytes.Split(page, []byte("\n")) {
		if bytes.HasPrefix(bytes.TrimLeft(l, " \t"), []byte("vllm:time_to_first_token_seconds")) {
			b.Write(l)
			b.WriteByte('\n')
		}
	}
	tp := expfmt.NewTextParser(model.UTF8Validation)
	_, err := tp.TextToMetricFamilies(&b)
	return err == nil
}
