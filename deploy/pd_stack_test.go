package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/deploy/composetest"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
)

// pdModel is the model examples/pd serves disaggregated.
const pdModel = "meta-llama/Llama-3.1-70B-Instruct"

// TestPDComposeStack runs examples/pd/docker-compose.yaml in a real engine
// (issue 29): the unmodified file, moved only to a free subnet and loopback
// host ports. Every service must become healthy with its own image's
// health check; a long prompt (over the pool's min_prompt_tokens) is split
// by the picker and its decode server's sidecar, streamed and not, chat and
// completions, with the prompt counted once in the usage; a short prompt is
// decoded whole; switchyard counts both decisions.
func TestPDComposeStack(t *testing.T) {
	e := composetest.Require(t)
	p := loadPDProject(t)
	root := testutil.RepoRoot(t)
	from, err := netip.ParsePrefix(p.Networks[pdNetwork].Ipam.Config[0].Subnet)
	if err != nil {
		t.Fatal(err)
	}
	reloc := composetest.Relocation{From: from, To: e.FreeSubnet(t, netip.MustParsePrefix("10.231.0.0/16"), from)}
	moved, err := composetest.Override(p, composetest.Move{Reloc: reloc, Dir: t.TempDir(),
		HostPort: func(string, uint32) int { return testutil.FreePort(t) }})
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	if ca := hostCABundle(); ca != "" {
		env["SWITCHYARD_BUILD_CA"] = ca
	}
	proj := e.NewProject(t, composetest.Options{
		Files:      []string{root + "/" + pdComposeFile},
		Override:   moved.Override,
		Env:        env,
		NamePrefix: "sypd",
	})
	start := time.Now()
	proj.Up(t, 20*time.Minute, "--build")
	t.Logf("project %s (subnet %s) up and healthy in %v", proj.Name, reloc.To, time.Since(start).Round(time.Second))

	envoy := fmt.Sprintf("http://127.0.0.1:%d", moved.Ports["envoy"][8080])
	admin := fmt.Sprintf("http://127.0.0.1:%d", moved.Ports["switchyard"][9090])
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Proxy: nil}}

	// Envoy is healthy once it has a configuration; the pool's endpoints
	// are routable once switchyard has scraped them.
	testutil.Eventually(t, time.Minute, "a short chat completion through Envoy", func() error {
		_, err := pdSend(client, envoy, pdRequest{chat: true, prompt: "hello"})
		return err
	})

	long := func(tag string) string { return tag + " " + strings.Repeat("word ", 1500) }
	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			what := fmt.Sprintf("chat=%v stream=%v", chat, stream)
			r, err := pdSend(client, envoy, pdRequest{chat: chat, stream: stream, prompt: long(what)})
			if err != nil {
				t.Errorf("%s: %v", what, err)
				continue
			}
			if r.result != "split" {
				t.Errorf("%s: the sidecar says %q, want split", what, r.result)
			}
			if r.promptTokens < 1024 || r.completionTokens != pdMaxTokens {
				t.Errorf("%s: usage %d prompt, %d completion tokens; want >= 1024 and %d", what, r.promptTokens, r.completionTokens, pdMaxTokens)
			}
		}
	}
	for _, stream := range []bool{false, true} {
		r, err := pdSend(client, envoy, pdRequest{chat: true, stream: stream, prompt: "a short question"})
		if err != nil {
			t.Errorf("short, stream=%v: %v", stream, err)
		} else if r.result != "local" {
			t.Errorf("short, stream=%v: the sidecar says %q, want local", stream, r.result)
		}
	}

	// The same prompt again: its prefix is now cached on the decode
	// server that served it, so the picker decodes it whole there or
	// splits it again; either way the request is answered.
	if _, err := pdSend(client, envoy, pdRequest{prompt: long("chat=false stream=false")}); err != nil {
		t.Errorf("repeated long prompt: %v", err)
	}

	metrics, err := httpGetText(client, admin+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for decision, atLeast := range map[string]float64{"split": 4, "short-prompt": 2} {
		if v := pdDecisions(metrics, decision); v < atLeast {
			t.Errorf("switchyard_pd_decisions_total{decision=%q} = %v, want >= %v", decision, v, atLeast)
		}
	}
}

// pdMaxTokens is each test request's max_tokens.
const pdMaxTokens = 6

type pdRequest struct {
	chat, stream bool
	prompt       string
}

type pdResponse struct {
	result                         string // the sidecar's x-switchyard-pd
	promptTokens, completionTokens int
}

// pdSend sends one completion or chat completion through Envoy and reads
// its usage (the last chunk's, when streamed).
func pdSend(c *http.Client, envoy string, r pdRequest) (pdResponse, error) {
	body := map[string]any{"model": pdModel, "max_tokens": pdMaxTokens, "stream": r.stream}
	path := "/v1/completions"
	if r.chat {
		path = "/v1/chat/completions"
		body["messages"] = []map[string]string{{"role": "user", "content": r.prompt}}
	} else {
		body["prompt"] = r.prompt
	}
	if r.stream {
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return pdResponse{}, err
	}
	resp, err := c.Post(envoy+path, "application/json", bytes.NewReader(b))
	if err != nil {
		return pdResponse{}, err
	}
	defer resp.Body.Close()
	out := pdResponse{result: resp.Header.Get(pd.ResultHeader)}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		return out, fmt.Errorf("%s: %s", resp.Status, truncate(string(msg), 200))
	}
	type usage struct {
		Usage *struct {
			Prompt     int `json:"prompt_tokens"`
			Completion int `json:"completion_tokens"`
		} `json:"usage"`
	}
	read := func(data []byte) error {
		var u usage
		if err := json.Unmarshal(data, &u); err != nil {
			return fmt.Errorf("%w: %s", err, truncate(string(data), 200))
		}
		if u.Usage != nil {
			out.promptTokens, out.completionTokens = u.Usage.Prompt, u.Usage.Completion
		}
		return nil
	}
	if !r.stream {
		data, err := io.ReadAll(resp.Body)
		if err != nil {
			return out, err
		}
		return out, read(data)
	}
	done := false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		if err := read([]byte(line)); err != nil {
			return out, err
		}
	}
	if err := sc.Err(); err != nil {
		return out, err
	}
	if !done {
		return out, fmt.Errorf("stream ended without [DONE]")
	}
	return out, nil
}

func httpGetText(c *http.Client, url string) (string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}

// pdDecisions sums switchyard_pd_decisions_total over pools for decision in
// a Prometheus text page.
func pdDecisions(page, decision string) float64 {
	var sum float64
	for _, line := range strings.Split(page, "\n") {
		if !strings.HasPrefix(line, "switchyard_pd_decisions_total{") || !strings.Contains(line, `decision="`+decision+`"`) {
			continue
		}
		if i := strings.LastIndexByte(line, ' '); i > 0 {
			if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
				sum += v
			}
		}
	}
	return sum
}
