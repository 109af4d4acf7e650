package xds

import (
	"bufio"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/pd"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

func pool(name string, mode registry.FailureMode, addrs ...string) *registry.Pool {
	p := &registry.Pool{Name: name, Engine: registry.EngineVLLM, FailureMode: mode}
	for _, a := range addrs {
		p.Endpoints = append(p.Endpoints, registry.Endpoint{Address: a, Source: "test"})
	}
	return p
}

func newState(version uint64, listenAddr string, pools ...*registry.Pool) *registry.State {
	s := registry.Empty()
	s.Version = version
	s.Listeners = []registry.Listener{{Name: "public", Address: listenAddr}}
	for _, p := range pools {
		s.Pools[p.Name] = p
		// A model named after the pool, so requests the picker did not
		// process ({"model":"<pool>"}) have a pool to stay in.
		s.Models[p.Name] = &registry.Model{Name: p.Name, Pool: p.Name}
	}
	return s
}

type reply struct {
	status int
	header http.Header
	body   string
}

func post(t *testing.T, url string, headers map[string]string, body string) (reply, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}, err
}

// waitClusters polls Envoy's /clusters until every want is present and
// every unwanted string is absent.
func waitClusters(t *testing.T, admin string, within time.Duration, want, unwanted []string) {
	t.Helper()
	testutil.Eventually(t, within, "Envoy /clusters", func() error {
		out, err := httpGet(admin + "/clusters")
		if err != nil {
			return err
		}
		if missing := testutil.ContainsAll(out, want...); len(missing) > 0 {
			return fmt.Errorf("missing %q", missing)
		}
		for _, u := range unwanted {
			if strings.Contains(out, u) {
				return fmt.Errorf("still has %q", u)
			}
		}
		return nil
	})
}

// waitPicker waits until Envoy's picker cluster host is healthy (or not).
func waitPicker(t *testing.T, admin, pickerAddr string, healthy bool) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "picker health in Envoy", func() error {
		out, err := httpGet(admin + "/clusters")
		if err != nil {
			return err
		}
		line := ir.PickerCluster + "::" + pickerAddr + "::health_flags::"
		for _, l := range strings.Split(out, "\n") {
			if !strings.HasPrefix(l, line) {
				continue
			}
			flags := strings.TrimPrefix(l, line)
			if (flags == "healthy") == healthy {
				return nil
			}
			return fmt.Errorf("picker health flags %q", flags)
		}
		return fmt.Errorf("no picker host in /clusters")
	})
}

func TestEnvoyServesTranslatedConfig(t *testing.T) {
	a, b, c := startBackend(t), startBackend(t), startBackend(t)
	picker := startResponder(t)
	listen := testutil.FreeAddr(t)
	dead := testutil.FreeAddr(t) // in the pool, but nothing listens
	pub := registry.NewPublisher(newState(1, listen, pool("llama", registry.FailClosed, a.Addr, b.Addr, dead)))
	srv, xdsAddr := startXDS(t, pub, Options{Translation: ir.Options{PickerAddr: picker.Addr}})
	admin, proc := startEnvoy(t, "envoy-test-1", xdsAddr)

	// Envoy connects, ACKs, and holds listener, clusters and endpoints.
	testutil.Eventually(t, 10*time.Second, "Envoy ACKs the snapshot", func() error {
		nodes := srv.Nodes()
		if len(nodes) != 1 || nodes[0].ID != "envoy-test-1" || nodes[0].Cluster != "test" {
			return fmt.Errorf("nodes = %+v", nodes)
		}
		vs := srv.Stats().Versions
		for _, typ := range []string{"Listener", "Cluster", "RouteConfiguration", "ClusterLoadAssignment"} {
			if got := nodes[0].Acked[typ]; got != vs[typ] {
				return fmt.Errorf("%s acked %q, serving %q", typ, got, vs[typ])
			}
		}
		return nil
	})
	dump, err := httpGet(admin + "/config_dump?include_eds")
	if err != nil {
		t.Fatal(err)
	}
	if missing := testutil.ContainsAll(dump, "listener/public", "listener/public/routes", "pool/llama", ir.PickerCluster,
		"envoy.load_balancing_policies.override_host", "FULL_DUPLEX_STREAMED", a.Addr[strings.LastIndex(a.Addr, ":")+1:]); len(missing) > 0 {
		t.Fatalf("config_dump lacks %q", missing)
	}
	waitClusters(t, admin, 5*time.Second, []string{"pool/llama::" + a.Addr + "::", "pool/llama::" + b.Addr + "::"}, nil)
	testutil.WaitTCP(t, listen, 5*time.Second)
	waitPicker(t, admin, picker.Addr, true)

	url := "http://" + listen + "/v1/completions"
	t.Run("pool unknown to Envoy gets 404 JSON", func(t *testing.T) {
		// The picker chose a pool the routes do not have (yet).
		r, err := post(t, url, map[string]string{"x-test-pool": "not-a-pool", "x-test-pick": a.Addr}, `{"model":"x"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusNotFound || r.header.Get("content-type") != "application/json" || r.body != ir.NoPoolBody {
			t.Fatalf("got %d %q %q, want 404 application/json", r.status, r.header.Get("content-type"), r.body)
		}
	})

	t.Run("unprocessed request gets 503 JSON whatever the client sends", func(t *testing.T) {
		// The responder continues a request without x-test-pool
		// unprocessed, as Envoy does when the picker is unreachable. With
		// only fail-closed pools it gets the picker-unavailable answer; a
		// client-sent pool header or destination never reaches a pool.
		r, err := post(t, url, map[string]string{ir.PoolHeader: "llama", ir.DestinationKey: a.Addr}, `{"model":"x"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusServiceUnavailable || r.header.Get("x-served-by") != "" ||
			r.header.Get("content-type") != "application/json" || r.body != ir.PickerUnavailableBody {
			t.Fatalf("got %d %q %q from %q, want 503 %s from Envoy", r.status, r.header.Get("content-type"), r.body, r.header.Get("x-served-by"), ir.PickerUnavailableBody)
		}
	})

	t.Run("picked endpoint serves, client destination header ignored", func(t *testing.T) {
		for i := 0; i < 3; i++ {
			body := `{"model":"llama","prompt":"` + strings.Repeat("hi ", 5000) + `"}`
			r, err := post(t, url, map[string]string{
				"x-test-pool": "llama", "x-test-pick": b.Addr,
				ir.DestinationKey: a.Addr, // a client trying to choose the upstream
			}, body)
			if err != nil {
				t.Fatal(err)
			}
			if r.status != http.StatusOK || r.header.Get("x-served-by") != b.Addr {
				t.Fatalf("got %d served by %q (%s), want 200 from %s", r.status, r.header.Get("x-served-by"), r.body, b.Addr)
			}
			if !strings.Contains(r.body, fmt.Sprintf(`"request_bytes":%d`, len(body))) {
				t.Fatalf("body not forwarded intact: %s", r.body)
			}
		}
		served := picker.Served()
		if len(served) == 0 || served[len(served)-1] != b.Addr {
			t.Fatalf("served-host metadata seen by the picker = %q, want %s", served, b.Addr)
		}
	})

	// override_host's fallback never chooses: a host the picker did not
	// pick may not serve the model or adapter (it would answer its own
	// 404), so a pick Envoy cannot honour fails instead.
	t.Run("picked endpoint outside the pool is never replaced", func(t *testing.T) {
		r, err := post(t, url, map[string]string{"x-test-pool": "llama", "x-test-pick": c.Addr}, `{"model":"llama"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusServiceUnavailable || r.header.Get("x-served-by") != "" {
			t.Fatalf("got %d from %q, want 503 from Envoy (no host)", r.status, r.header.Get("x-served-by"))
		}
	})

	t.Run("connect failure retries the next fallback", func(t *testing.T) {
		r, err := post(t, url, map[string]string{"x-test-pool": "llama", "x-test-pick": dead + "," + b.Addr}, `{"model":"llama"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusOK || r.header.Get("x-served-by") != b.Addr {
			t.Fatalf("got %d from %q, want 200 from fallback %s", r.status, r.header.Get("x-served-by"), b.Addr)
		}
		if served := picker.Served(); served[len(served)-1] != b.Addr {
			t.Fatalf("served-host metadata = %q, want %s", served[len(served)-1], b.Addr)
		}
	})

	t.Run("clients cannot make Envoy retry a POST", func(t *testing.T) {
		r, err := post(t, "http://"+listen+"/fail", map[string]string{
			"x-test-pool": "llama", "x-test-pick": a.Addr,
			"x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3", "x-forwarded-for": "10.0.0.1",
		}, `{"model":"llama"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusServiceUnavailable || a.fails.Load() != 1 {
			t.Fatalf("status %d, backend saw %d attempts; want 503 after exactly 1", r.status, a.fails.Load())
		}
	})

	t.Run("streamed response flows chunk by chunk", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+listen+"/stream", strings.NewReader(`{"model":"llama","stream":true}`))
		req.Header.Set("x-test-pool", "llama")
		req.Header.Set("x-test-pick", a.Addr)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		first, err := br.ReadString('\n')
		if err != nil || first != "data: first\n" {
			t.Fatalf("first event %q, %v", first, err)
		}
		a.release <- struct{}{} // only now may the backend continue
		rest, err := io.ReadAll(br)
		if err != nil || !strings.Contains(string(rest), "data: second") || !strings.Contains(string(rest), "[DONE]") {
			t.Fatalf("rest of stream %q, %v", rest, err)
		}
	})

	t.Run("registry change reaches Envoy within 1s", func(t *testing.T) {
		before := srv.Stats().Version
		pub.Publish(newState(2, listen, pool("llama", registry.FailClosed, a.Addr), pool("qwen", registry.FailClosed, c.Addr)))
		start := time.Now()
		waitClusters(t, admin, time.Second, []string{"pool/llama::" + a.Addr + "::", "pool/qwen::" + c.Addr + "::"}, []string{"pool/llama::" + b.Addr + "::"})
		t.Logf("registry change visible in Envoy /clusters after %v", time.Since(start))
		if v := srv.Stats().Version; v == before {
			t.Fatalf("version did not change (%q)", v)
		}
		testutil.Eventually(t, 5*time.Second, "new pool routable", func() error {
			r, err := post(t, url, map[string]string{"x-test-pool": "qwen", "x-test-pick": c.Addr}, `{"model":"qwen"}`)
			if err != nil {
				return err
			}
			if r.status != http.StatusOK || r.header.Get("x-served-by") != c.Addr {
				return fmt.Errorf("got %d from %q", r.status, r.header.Get("x-served-by"))
			}
			return nil
		})
	})

	if n := srv.Stats().NACKs; n != 0 {
		t.Fatalf("Envoy NACKed %d times: %+v", n, srv.Nodes())
	}
	if st := srv.Stats(); st.Failures != 0 || st.ACKs == 0 {
		t.Fatalf("stats = %+v", st)
	}
	// Envoy logs at warning level; our config must not trigger any
	// deprecation or rejection warnings.
	for _, bad := range []string{"deprecated", "rejected", "NACK"} {
		if strings.Contains(proc.Output(), bad) {
			t.Errorf("Envoy output mentions %q:\n%s", bad, proc.Output())
		}
	}
}

// TestEnvoyFailOpenAndFailClosed proves the fail-open design with a dead
// picker: a fail-open pool keeps serving through least_request, while a
// configuration with only fail-closed pools answers 503.
func TestEnvoyFailOpenAndFailClosed(t *testing.T) {
	for _, api := range apiTypes {
		t.Run(api, func(t *testing.T) { testEnvoyFailOpenAndFailClosed(t, api) })
	}
}

func testEnvoyFailOpenAndFailClosed(t *testing.T, api string) {
	a, b := startBackend(t), startBackend(t)
	deadPicker := testutil.FreeAddr(t) // nothing listens here
	listen := testutil.FreeAddr(t)
	pub := registry.NewPublisher(newState(1, listen, pool("llama", registry.FailOpen, a.Addr, b.Addr)))
	srv, xdsAddr := startXDS(t, pub, Options{Translation: ir.Options{PickerAddr: deadPicker}})
	admin, _ := startEnvoyAPI(t, "envoy-failopen", xdsAddr, api)
	waitClusters(t, admin, 10*time.Second, []string{"pool/llama::" + a.Addr + "::"}, nil)
	testutil.WaitTCP(t, listen, 5*time.Second)
	waitPicker(t, admin, deadPicker, false)
	url := "http://" + listen + "/v1/chat/completions"

	body := `{"model":"llama","messages":[{"role":"user","content":"hello"}]}`
	testutil.Eventually(t, 5*time.Second, "fail-open request served", func() error {
		r, err := post(t, url, nil, body)
		if err != nil {
			return err
		}
		if r.status != http.StatusOK || !strings.Contains(r.body, fmt.Sprintf(`"request_bytes":%d`, len(body))) {
			return fmt.Errorf("got %d %q", r.status, r.body)
		}
		return nil
	})

	// Without the picker, override_host has no metadata and least_request
	// balances; a client header naming an endpoint must not pin it.
	servedBy := map[string]int{}
	for i := 0; i < 30; i++ {
		r, err := post(t, url, map[string]string{ir.DestinationKey: b.Addr}, body)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusOK {
			t.Fatalf("fail-open request %d: %d %q", i, r.status, r.body)
		}
		servedBy[r.header.Get("x-served-by")]++
	}
	if servedBy[a.Addr] == 0 {
		t.Fatalf("client header pinned every request to %s: %v", b.Addr, servedBy)
	}
	// Nor does a client's prefill header reach a server (a decode
	// server's sidecar would act on it): Envoy removes it ahead of the
	// picker, which is bypassed here.
	if r, err := post(t, url, map[string]string{pd.PrefillerHeader: b.Addr}, body); err != nil || r.status != http.StatusOK ||
		!strings.Contains(r.body, `"prefiller":""`) {
		t.Fatalf("fail-open request with a client's %s: %+v %v", pd.PrefillerHeader, r, err)
	}
	// A client-sent pool header makes Envoy skip reading the model (the
	// picker sets that header on what it picked), so the request gets the
	// picker-unavailable answer: it cannot pick a pool either.
	if r, err := post(t, url, map[string]string{ir.PoolHeader: "llama"}, body); err != nil || r.status != http.StatusServiceUnavailable || r.body != ir.PickerUnavailableBody {
		t.Fatalf("client pool header with the picker down: %+v %v, want the 503 JSON", r, err)
	}

	// Switch the pool between fail-open and fail-closed and back. The
	// Listener resource stays the same (Envoy never modifies its
	// listener), so a client connection opened before a switch follows it
	// at once: the routes alone decide.
	modified := func() string {
		out, err := httpGet(admin + "/stats?filter=^listener_manager.listener_(modified|added)$")
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := modified()
	keep := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1}}
	defer keep.CloseIdleConnections()
	// send sends a request on keep's single connection and reports
	// whether the connection was reused. Envoy reads the whole body to
	// find the model before any route answers, so the connection stays.
	send := func() (reply, bool, error) {
		reused := false
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			return reply{}, false, err
		}
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused },
		}))
		resp, err := keep.Do(req)
		if err != nil {
			return reply{}, false, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}, reused, err
	}
	if r, _, err := send(); err != nil || r.status != http.StatusOK {
		t.Fatalf("fail-open on the kept connection: %+v %v", r, err)
	}
	for i, mode := range []registry.FailureMode{registry.FailClosed, registry.FailOpen, registry.FailClosed} {
		v := srv.Stats().Version
		pub.Publish(newState(uint64(i+2), listen, pool("llama", mode, a.Addr)))
		want := http.StatusOK
		if mode == registry.FailClosed {
			want = http.StatusServiceUnavailable
		}
		testutil.Eventually(t, 5*time.Second, fmt.Sprintf("%s answers %d on a connection opened before", mode, want), func() error {
			if srv.Stats().Version == v {
				return fmt.Errorf("not translated yet")
			}
			r, reused, err := send()
			if err != nil {
				return err
			}
			if !reused {
				t.Fatalf("%s: Envoy closed the kept connection", mode)
			}
			if r.status != want {
				return fmt.Errorf("got %d %q", r.status, r.body)
			}
			if want == http.StatusServiceUnavailable && (r.body != ir.PickerUnavailableBody || r.header.Get("content-type") != "application/json") {
				t.Fatalf("fail-closed with the picker down: %q %q, want %s as JSON", r.header.Get("content-type"), r.body, ir.PickerUnavailableBody)
			}
			return nil
		})
	}
	if after := modified(); after != before {
		t.Fatalf("Envoy's listener was modified by pool edits:\nbefore %s\nafter  %s", before, after)
	}
	if n := srv.Stats().NACKs; n != 0 {
		t.Fatalf("Envoy NACKed %d times", n)
	}
}

// TestEnvoyPickerCrashFailsOpen kills a live picker under a fail-open
// pool several times: outlier detection ejects it on the first refused
// stream every time (not only the first: Envoy's default 1 s
// update_merge_window once delayed an ejection that followed an
// unejection), so at most the request in flight fails before traffic
// flows without it; once the picker is back, requests go through it again
// within a few health-check intervals. One round restarts the picker only
// after Envoy's health check marked it down, the others at once.
func TestEnvoyPickerCrashFailsOpen(t *testing.T) {
	a := startBackend(t)
	picker := startResponder(t)
	listen := testutil.FreeAddr(t)
	pub := registry.NewPublisher(newState(1, listen, pool("llama", registry.FailOpen, a.Addr)))
	_, xdsAddr := startXDS(t, pub, Options{Translation: ir.Options{PickerAddr: picker.Addr}})
	admin, _ := startEnvoy(t, "envoy-crash", xdsAddr)
	waitClusters(t, admin, 10*time.Second, []string{"pool/llama::" + a.Addr + "::"}, nil)
	testutil.WaitTCP(t, listen, 5*time.Second)
	waitPicker(t, admin, picker.Addr, true)
	url := "http://" + listen + "/v1/completions"
	body := `{"model":"llama","prompt":"x"}`
	picked := map[string]string{"x-test-pool": "llama", "x-test-pick": a.Addr}
	if r, err := post(t, url, picked, body); err != nil || r.status != http.StatusOK || len(picker.Served()) != 1 {
		t.Fatalf("through picker: %+v %v served=%v", r, err, picker.Served())
	}

	cur := picker
	for round, waitUnhealthy := range []bool{false, false, true, false} {
		cur.Stop()
		killed := time.Now()
		failures := 0
		testutil.Eventually(t, 5*time.Second, "fail-open after picker crash", func() error {
			r, err := post(t, url, picked, body)
			if err != nil {
				return err
			}
			if r.status != http.StatusOK {
				failures++
				return fmt.Errorf("status %d", r.status)
			}
			return nil
		})
		t.Logf("crash %d: failing open %v after the kill, %d requests failed before", round, time.Since(killed).Round(time.Millisecond), failures)
		// The request in flight fails; one more may, since the ejection
		// reaches Envoy's worker threads asynchronously.
		if failures > 2 {
			t.Fatalf("crash %d: %d requests failed after the picker crashed; want at most the first two", round, failures)
		}
		if waitUnhealthy {
			waitPicker(t, admin, picker.Addr, false)
		}

		cur = startResponderAt(t, picker.Addr)
		back := time.Now()
		testutil.Eventually(t, 10*time.Second, "traffic back through the restarted picker", func() error {
			if _, err := post(t, url, picked, body); err != nil {
				return err
			}
			if len(cur.Served()) == 0 {
				return fmt.Errorf("restarted picker saw no request yet")
			}
			return nil
		})
		t.Logf("crash %d: routed through the restarted picker %v after its restart (health-checked down first: %v)", round, time.Since(back).Round(time.Millisecond), waitUnhealthy)
	}
}

// TestEnvoySurvivesSwitchyardRestart restarts the xDS server in place:
// until the new registry publishes, Envoy keeps serving the old config;
// the same content then has the same versions (content addresses), so
// Envoy gets no new configuration at all; new content gets new versions.
func TestEnvoySurvivesSwitchyardRestart(t *testing.T) {
	for _, api := range apiTypes {
		t.Run(api, func(t *testing.T) { testEnvoySurvivesSwitchyardRestart(t, api) })
	}
}

func testEnvoySurvivesSwitchyardRestart(t *testing.T, api string) {
	a, b := startBackend(t), startBackend(t)
	listen := testutil.FreeAddr(t)
	pub1 := registry.NewPublisher(newState(1, listen, pool("llama", registry.FailClosed, a.Addr)))
	srv1, xdsAddr, stop1 := startXDSAt(t, "127.0.0.1:0", pub1, Options{})
	admin, _ := startEnvoyAPI(t, "envoy-restart", xdsAddr, api)
	waitClusters(t, admin, 10*time.Second, []string{"pool/llama::" + a.Addr + "::"}, nil)
	v1 := srv1.Stats().Versions
	// State of the world: a reconnecting Envoy holding the served
	// versions is sent nothing. Incremental: its first wildcard request
	// is answered with an empty update, which changes no cluster.
	filter := "^cluster_manager.cds.update_success$"
	if api == envoy.APITypeDelta {
		filter = "^cluster_manager.cluster_(added|modified|removed)$"
	}
	updates := func() string {
		out, err := httpGet(admin + "/stats?filter=" + filter)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := updates()
	stop1()

	// The restarted process has not loaded its sources yet.
	pub2 := registry.NewPublisher(nil)
	srv2, _, _ := startXDSAt(t, xdsAddr, pub2, Options{})
	testutil.Eventually(t, 10*time.Second, "Envoy reconnects", func() error {
		if len(srv2.Nodes()) == 0 || srv2.Nodes()[0].Streams == 0 {
			return fmt.Errorf("not connected")
		}
		return nil
	})
	// Nothing was served for the unloaded state, so Envoy keeps the old
	// config.
	if v := srv2.Stats().Version; v != "" {
		t.Fatalf("restarted server served version %q before its registry loaded", v)
	}
	waitClusters(t, admin, time.Second, []string{"pool/llama::" + a.Addr + "::"}, nil)

	// The same content under a new registry version: the same versions,
	// and Envoy has nothing to update.
	pub2.Publish(newState(5, listen, pool("llama", registry.FailClosed, a.Addr)))
	testutil.Eventually(t, 5*time.Second, "restarted server serving", func() error {
		if srv2.Stats().RegistryVersion != 5 {
			return fmt.Errorf("not translated yet")
		}
		return nil
	})
	if v := srv2.Stats().Versions; !maps.Equal(v, v1) {
		t.Fatalf("same content after a restart: versions %v, want %v", v, v1)
	}
	if after := updates(); after != before {
		t.Fatalf("Envoy updated its clusters for unchanged content: %q -> %q", before, after)
	}
	// The status knows the node holds every served version, though
	// nothing (or, incremental, an empty update) was sent.
	testutil.Eventually(t, 5*time.Second, "node holds the served versions", func() error {
		if n := srv2.Nodes(); len(n) != 1 || !maps.Equal(n[0].Acked, v1) {
			return fmt.Errorf("nodes %+v, want %v held", n, v1)
		}
		return nil
	})

	pub2.Publish(newState(6, listen, pool("llama", registry.FailClosed, b.Addr)))
	waitClusters(t, admin, 5*time.Second, []string{"pool/llama::" + b.Addr + "::"}, []string{"pool/llama::" + a.Addr + "::"})
	if v2 := srv2.Stats().Versions; v2["ClusterLoadAssignment"] == v1["ClusterLoadAssignment"] {
		t.Fatalf("new endpoints kept the endpoints version %q", v2["ClusterLoadAssignment"])
	}
	if srv1.Stats().NACKs+srv2.Stats().NACKs != 0 {
		t.Fatal("Envoy NACKed")
	}
}

// TestEnvoyIPv6Endpoint checks that override_host matches the picker's
// "[v6]:port" string against an IPv6 EDS endpoint.
func TestEnvoyIPv6Endpoint(t *testing.T) {
	v4 := startBackend(t)
	v6 := startBackendAt(t, "[::1]:0")
	picker := startResponder(t)
	port := testutil.FreePort(t)
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	// "[::]" listens on every address, IPv4 included.
	pub := registry.NewPublisher(newState(1, fmt.Sprintf("[::]:%d", port), pool("llama", registry.FailClosed, v4.Addr, v6.Addr)))
	srv, xdsAddr := startXDS(t, pub, Options{Translation: ir.Options{PickerAddr: picker.Addr}})
	admin, _ := startEnvoy(t, "envoy-ipv6", xdsAddr)
	waitClusters(t, admin, 10*time.Second, []string{"pool/llama::" + v6.Addr + "::"}, nil)
	testutil.WaitTCP(t, listen, 5*time.Second)
	waitPicker(t, admin, picker.Addr, true)
	for i := 0; i < 4; i++ {
		target := listen
		if i%2 == 1 {
			target = fmt.Sprintf("[::1]:%d", port)
		}
		r, err := post(t, "http://"+target+"/v1/completions", map[string]string{"x-test-pool": "llama", "x-test-pick": v6.Addr}, `{"model":"llama"}`)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusOK || r.header.Get("x-served-by") != v6.Addr {
			t.Fatalf("got %d from %q, want %s", r.status, r.header.Get("x-served-by"), v6.Addr)
		}
	}
	if served := picker.Served(); served[len(served)-1] != v6.Addr {
		t.Fatalf("served-host metadata %q, want %s", served[len(served)-1], v6.Addr)
	}
	if srv.Stats().NACKs != 0 {
		t.Fatal("NACK")
	}
}

// TestEnvoyNACKIsCounted gives Envoy a listener it cannot bind (the port is
// taken), which it rejects: the NACK must be counted and attributed.
func TestEnvoyNACKIsCounted(t *testing.T) {
	for _, api := range apiTypes {
		t.Run(api, func(t *testing.T) { testEnvoyNACKIsCounted(t, api) })
	}
}

func testEnvoyNACKIsCounted(t *testing.T, api string) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	listen := testutil.FreeAddr(t)
	pub := registry.NewPublisher(newState(1, listen, pool("llama", registry.FailClosed, "127.0.0.1:1")))
	srv, xdsAddr := startXDS(t, pub, Options{})
	startEnvoyAPI(t, "envoy-nack", xdsAddr, api)
	testutil.WaitTCP(t, listen, 10*time.Second)
	if n := srv.Stats().NACKs; n != 0 {
		t.Fatalf("NACKs before the bad listener = %d", n)
	}

	bad := newState(2, listen, pool("llama", registry.FailClosed, "127.0.0.1:1"))
	bad.Listeners = append(bad.Listeners, registry.Listener{Name: "squatted", Address: taken.Addr().String()})
	pub.Publish(bad)
	testutil.Eventually(t, 5*time.Second, "NACK counted", func() error {
		nodes := srv.Nodes()
		if srv.Stats().NACKs == 0 || len(nodes) != 1 || nodes[0].NACKs == 0 {
			return fmt.Errorf("stats %+v nodes %+v", srv.Stats(), nodes)
		}
		if !strings.Contains(nodes[0].LastNACK, "listener/squatted") {
			return fmt.Errorf("last NACK %q does not name the listener", nodes[0].LastNACK)
		}
		return nil
	})
	t.Logf("NACK: %s", srv.Nodes()[0].LastNACK)
}

// TestEnvoyKeepsUnchangedPools changes one pool's endpoints several times:
// Envoy is sent only that pool's assignment (on either protocol) and keeps
// every other pool's endpoints, routing to them throughout.
func TestEnvoyKeepsUnchangedPools(t *testing.T) {
	for _, api := range apiTypes {
		t.Run(api, func(t *testing.T) { testEnvoyKeepsUnchangedPools(t, api) })
	}
}

func testEnvoyKeepsUnchangedPools(t *testing.T, api string) {
	a, b1, b2, c := startBackend(t), startBackend(t), startBackend(t), startBackend(t)
	picker := startResponder(t)
	listen := testutil.FreeAddr(t)
	st := func(v uint64, bs ...string) *registry.State {
		return newState(v, listen, pool("a", registry.FailClosed, a.Addr), pool("b", registry.FailClosed, bs...), pool("c", registry.FailClosed, c.Addr))
	}
	pub := registry.NewPublisher(st(1, b1.Addr))
	srv, xdsAddr := startXDS(t, pub, Options{Translation: ir.Options{PickerAddr: picker.Addr}})
	admin, _ := startEnvoyAPI(t, "envoy-keep-"+api, xdsAddr, api)
	waitClusters(t, admin, 10*time.Second, []string{"pool/a::" + a.Addr + "::", "pool/b::" + b1.Addr + "::", "pool/c::" + c.Addr + "::"}, nil)
	testutil.WaitTCP(t, listen, 5*time.Second)
	waitPicker(t, admin, picker.Addr, true)
	served := func(p, pick string) error {
		r, err := post(t, "http://"+listen+"/v1/completions", map[string]string{"x-test-pool": p, "x-test-pick": pick}, `{"model":"`+p+`"}`)
		if err != nil {
			return err
		}
		if r.status != http.StatusOK || r.header.Get("x-served-by") != pick {
			return fmt.Errorf("pool %s: %d from %q, want %s", p, r.status, r.header.Get("x-served-by"), pick)
		}
		return nil
	}
	for i, bs := range [][]string{{b2.Addr}, {b1.Addr, b2.Addr}, {b1.Addr}} {
		pub.Publish(st(uint64(i+2), bs...))
		var unwanted []string
		if len(bs) == 1 {
			other := b1.Addr
			if bs[0] == b1.Addr {
				other = b2.Addr
			}
			unwanted = []string{"pool/b::" + other + "::"}
		}
		var want []string
		for _, e := range bs {
			want = append(want, "pool/b::"+e+"::")
		}
		waitClusters(t, admin, 5*time.Second, append(want, "pool/a::"+a.Addr+"::", "pool/c::"+c.Addr+"::"), unwanted)
		for _, r := range [][2]string{{"a", a.Addr}, {"c", c.Addr}, {"b", bs[0]}} {
			if err := served(r[0], r[1]); err != nil {
				t.Fatalf("after change %d: %v", i+1, err)
			}
		}
	}
	if srv.Stats().NACKs != 0 {
		t.Fatal("Envoy NACKed")
	}
	// Only pool b's assignment was ever sent again.
	out, err := httpGet(admin + "/stats?filter=^cluster.pool/[abc].update_success$")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("EDS updates per cluster:\n%s", out)
	if !strings.Contains(out, "cluster.pool/a.update_success: 1\n") || !strings.Contains(out, "cluster.pool/c.update_success: 1\n") {
		t.Fatalf("pools a and c were updated again:\n%s", out)
	}
}
