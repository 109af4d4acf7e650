package main

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// TestE2EConfigReload edits the HCL file while a long SSE stream is in
// flight: a pool is added, the stream's own endpoint is removed, a model is
// remapped to another pool, a bad edit is rejected while the old
// configuration keeps routing, and the next good edit applies. The stream
// must complete with every token (acceptances 2 and 7).
func TestE2EConfigReload(t *testing.T) {
	t.Parallel()
	// Pool A's sims are slow enough (time scale 5: ~1.4 ms per token) for
	// the stream to outlive every edit; pool B's sim is fast.
	a1, a2 := startSim(t, simOptions{timeScale: 5}), startSim(t, simOptions{timeScale: 5})
	b1 := startSim(t, simOptions{})
	poolA := func(addrs ...string) string {
		return fmt.Sprintf("pool \"A\" {\n  endpoints = [%s]\n}\n", quoteList(addrs))
	}
	poolB := fmt.Sprintf("pool \"B\" {\n  endpoints = [%q]\n}\n", b1.Addr)
	model := func(name, pool string) string { return fmt.Sprintf("model %q {\n  pool = %q\n}\n", name, pool) }

	f := newFleet(t, poolA(a1.Addr, a2.Addr)+model("m-a", "A"), fleetOptions{})

	// The long stream, started before any edit.
	const streamTokens = 3000
	streamHost := make(chan string, 1)
	type result struct {
		resp *infResp
		err  error
	}
	streamDone := make(chan result, 1)
	go func() {
		resp, err := sendTo(f.client, "http://"+f.listen, infReq{chat: true, stream: true, model: "m-a", maxTokens: streamTokens, prompt: "a long story"},
			func(r *infResp) { streamHost <- r.servedBy })
		streamDone <- result{resp, err}
	}()
	var kept, removed string
	select {
	case removed = <-streamHost:
	case <-time.After(10 * time.Second):
		t.Fatal("long stream: no response headers within 10s")
	}
	switch removed {
	case a1.Addr:
		kept = a2.Addr
	case a2.Addr:
		kept = a1.Addr
	default:
		t.Fatalf("long stream served by %q, not a member of pool A", removed)
	}

	// waitServed sends req until it is served by want (acceptance 2: an
	// edit reaches Envoy and routing) and logs how long after since, the
	// rename of the file, that took.
	waitServed := func(what string, since time.Time, req infReq, want string) {
		t.Helper()
		var took time.Duration
		testutil.Eventually(t, settle, what, func() error {
			resp, err := f.send(req)
			if err != nil {
				return err
			}
			if resp.status != http.StatusOK || resp.servedBy != want {
				return fmt.Errorf("status %d served by %q, want 200 from %s", resp.status, resp.servedBy, want)
			}
			took = time.Since(since)
			return nil
		})
		t.Logf("%s: %v after the file write", what, took.Round(time.Millisecond))
	}
	mA := infReq{model: "m-a", prompt: "hello", maxTokens: 1}
	mB := infReq{model: "m-b", prompt: "hello", maxTokens: 1}

	if resp, err := f.send(mB); err != nil || resp.status != http.StatusNotFound {
		t.Fatalf("m-b before it exists: %v %+v, want 404", err, resp)
	}

	// 1. A pool and a model are added.
	at := f.writeConfig(poolA(a1.Addr, a2.Addr) + poolB + model("m-a", "A") + model("m-b", "B"))
	waitServed("pool B added: m-b served by B", at, mB, b1.Addr)

	// 2. The stream's endpoint is removed from pool A.
	at = f.writeConfig(poolA(kept) + poolB + model("m-a", "A") + model("m-b", "B"))
	var took time.Duration
	testutil.Eventually(t, settle, "endpoint removed from the picker and Envoy", func() error {
		s, err := f.status()
		if err != nil {
			return err
		}
		if eps := s.endpoints("A"); !slices.Equal(eps, []string{kept}) {
			return fmt.Errorf("picker pool A endpoints %v", eps)
		}
		out, err := httpGetString(f.envoyAdm + "/clusters")
		if err != nil {
			return err
		}
		if strings.Contains(out, "pool/A::"+removed+"::") {
			return fmt.Errorf("Envoy still has %s in pool/A", removed)
		}
		took = time.Since(at)
		return nil
	})
	t.Logf("endpoint removal: out of the picker and Envoy %v after the file write", took.Round(time.Millisecond))
	for range 6 {
		resp, err := f.send(mA)
		checkOK(t, resp, err, "m-a")
		if resp.servedBy != kept {
			t.Fatalf("m-a served by %q after %s was removed, want %s", resp.servedBy, removed, kept)
		}
	}

	// 3. m-a is remapped to pool B.
	at = f.writeConfig(poolA(kept) + poolB + model("m-a", "B") + model("m-b", "B"))
	waitServed("m-a remapped to pool B", at, mA, b1.Addr)

	// 4. A bad edit: the last good configuration stays in force.
	before := f.mustStatus()
	f.writeConfig(poolA(kept) + poolB + model("m-a", "nope") + model("m-b", "B"))
	testutil.Eventually(t, settle, "config_error in /api/status", func() error {
		s, err := f.status()
		if err != nil {
			return err
		}
		if !strings.Contains(s.ConfigError, "switchyard.hcl:") || !strings.Contains(s.ConfigError, "nope") {
			return fmt.Errorf("config_error %q", s.ConfigError)
		}
		return nil
	})
	for _, r := range []infReq{mA, mB} {
		resp, err := f.send(r)
		checkOK(t, resp, err, r.model)
		if resp.servedBy != b1.Addr {
			t.Fatalf("after the bad edit %s served by %q, want %s (the old configuration)", r.model, resp.servedBy, b1.Addr)
		}
	}
	if s := f.mustStatus(); s.RegistryVersion != before.RegistryVersion || s.XDS.Version != before.XDS.Version {
		t.Fatalf("bad edit changed versions: registry %d -> %d, xDS %q -> %q", before.RegistryVersion, s.RegistryVersion, before.XDS.Version, s.XDS.Version)
	}

	// 5. The next good edit applies and clears the error.
	at = f.writeConfig(poolA(kept) + poolB + model("m-a", "A") + model("m-b", "B"))
	waitServed("good edit after a bad one: m-a back on pool A", at, mA, kept)
	if s := f.mustStatus(); s.ConfigError != "" {
		t.Fatalf("config_error still %q after a good edit", s.ConfigError)
	}
	if _, err := f.acked(before.RegistryVersion + 1); err != nil {
		t.Fatalf("Envoy did not ACK the new version: %v", err)
	}

	// The stream outlived every edit and completes with all its tokens.
	select {
	case r := <-streamDone:
		t.Fatalf("the long stream ended before the edits were done (%v, %+v): lengthen it, the check above proves nothing", r.err, r.resp)
	default:
	}
	select {
	case r := <-streamDone:
		checkOK(t, r.resp, r.err, "m-a")
		if !r.resp.done || r.resp.completion != streamTokens || r.resp.tokens != streamTokens {
			t.Fatalf("stream incomplete: [DONE]=%v usage %d, %d token chunks, want %d", r.resp.done, r.resp.completion, r.resp.tokens, streamTokens)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the long stream did not finish within 30s")
	}
}

func quoteList(addrs []string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = fmt.Sprintf("%q", a)
	}
	return strings.Join(q, ", ")
}
