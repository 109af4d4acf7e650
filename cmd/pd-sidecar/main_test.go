package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
)

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{},                   // no trust policy
		{"-config", "x.hcl"}, // without -pool
		{"-pool", "p", "-prefillers", "10.0.0.1:1"}, // without -config
		{"-allow-any-prefiller", "-prefill-timeout", "0s"},
		{"-allow-any-prefiller", "extra"},
	} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) accepted", args)
		}
	}
}

func startSim(t *testing.T) string {
	t.Helper()
	addr := testutil.FreeAddr(t)
	_, port, _ := strings.Cut(addr, ":")
	testutil.Start(t, "vllm-sim "+addr, testutil.Binary(t, "vllm-sim"), "-port", port, "-time-scale", "20", "-kv-connector", "NixlConnector")
	testutil.WaitHTTP(t, "http://"+addr+"/health", 10*time.Second)
	return addr
}

// TestSidecarProcess runs the binary with its allow-list from an HCL
// configuration, re-read on SIGHUP.
func TestSidecarProcess(t *testing.T) {
	p1, p2, d := startSim(t), startSim(t), startSim(t)
	addr := testutil.FreeAddr(t)
	dir := t.TempDir()
	hcl := func(prefill string) string {
		return `pool "big" {
  endpoint "` + prefill + `" { role = "prefill" }
  endpoint "` + addr + `" { role = "decode" }
  disaggregation {}
}
`
	}
	cfgPath := testutil.WriteFile(t, dir, "pd.hcl", hcl(p1))
	proc := testutil.Start(t, "pd-sidecar", testutil.Binary(t, "pd-sidecar"), "-listen", addr, "-decoder", "http://"+d,
		"-config", cfgPath, "-pool", "big", "-log-level", "debug")
	testutil.WaitHTTP(t, "http://"+addr+"/health", 10*time.Second)

	post := func(prefill string) string {
		t.Helper()
		b, _ := json.Marshal(map[string]any{"model": "meta-llama/Meta-Llama-3-8B-Instruct", "prompt": strings.Repeat("word ", 300), "max_tokens": 3})
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/completions", bytes.NewReader(b))
		req.Header.Set(pd.PrefillerHeader, prefill)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		return resp.Header.Get(pd.ResultHeader)
	}
	if got := post(p1); got != "split" {
		t.Errorf("configured prefill server: %s, want split", got)
	}
	if got := post(p2); got != "local" {
		t.Errorf("unconfigured prefill server: %s, want local", got)
	}
	// The configuration moves the prefill role to p2; SIGHUP re-reads it.
	testutil.WriteFile(t, dir, "pd.hcl", hcl(p2))
	if err := proc.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "p2 allowed after SIGHUP", func() error {
		if got := post(p2); got != "split" {
			return &resultErr{got}
		}
		return nil
	})
	if got := post(p1); got != "local" {
		t.Errorf("former prefill server: %s, want local", got)
	}
	// Other paths reach the decode server: the pool scrapes it here.
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "vllm:num_requests_running") {
		t.Errorf("/metrics through the sidecar: %d %.200s", resp.StatusCode, b)
	}
}

type resultErr struct{ got string }

func (e *resultErr) Error() string { return "result " + e.got }

// TestSidecarTrustsConsulPrefillers runs the binary on a pool whose
// members come from a real Consul: an instance registered with meta role
// prefill becomes a trusted prefill server, one with role decode does not,
// and a deregistered one stops being trusted.
func TestSidecarTrustsConsulPrefillers(t *testing.T) {
	c := testutil.StartConsul(t)
	p, other, d := startSim(t), startSim(t), startSim(t)
	addr := testutil.FreeAddr(t)
	cfg := testutil.WriteFile(t, t.TempDir(), "pd.hcl", `consul {
  address = "`+c.Addr+`"
}
pool "big" {
  consul {
    service = "vllm-big"
  }
  disaggregation {}
}
`)
	register := func(id, hostport, role string) {
		t.Helper()
		host, port, _ := strings.Cut(hostport, ":")
		n, _ := strconv.Atoi(port)
		err := c.Client().Agent().ServiceRegister(&api.AgentServiceRegistration{ID: id, Name: "vllm-big", Address: host, Port: n,
			Meta: map[string]string{"role": role}})
		if err != nil {
			t.Fatal(err)
		}
	}
	register("p", p, "prefill")
	register("other", other, "decode")
	testutil.Start(t, "pd-sidecar", testutil.Binary(t, "pd-sidecar"), "-listen", addr, "-decoder", "http://"+d,
		"-config", cfg, "-pool", "big", "-log-level", "debug")
	testutil.WaitHTTP(t, "http://"+addr+"/health", 10*time.Second)

	result := func(prefill string) string {
		t.Helper()
		b, _ := json.Marshal(map[string]any{"model": "meta-llama/Meta-Llama-3-8B-Instruct", "prompt": strings.Repeat("word ", 300), "max_tokens": 2})
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/completions", bytes.NewReader(b))
		req.Header.Set(pd.PrefillerHeader, prefill)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		return resp.Header.Get(pd.ResultHeader)
	}
	testutil.Eventually(t, 15*time.Second, "the Consul prefill server trusted", func() error {
		if got := result(p); got != "split" {
			return &resultErr{got}
		}
		return nil
	})
	if got := result(other); got != "local" {
		t.Errorf("a decode-role instance as prefill server: %s, want local", got)
	}
	if err := c.Client().Agent().ServiceDeregister("p"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 15*time.Second, "the deregistered prefill server no longer trusted", func() error {
		if got := result(p); got != "local" {
			return &resultErr{got}
		}
		return nil
	})
}
