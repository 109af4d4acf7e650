package kvevents

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/realvllm"
)

// chatBody is a chat request of about n prompt words.
func chatBody(n int, question string) []byte {
	w := newWorkload(1, 1)
	b, _ := json.Marshal(map[string]any{"model": "tiny", "max_tokens": 16,
		"messages": []map[string]string{{"role": "system", "content": w.words(n, "system.")}, {"role": "user", "content": question}}})
	return b
}

// BenchmarkPrepareCached is the exact index's per-request cost when the
// prompt's tokens are cached, as Manager.Prepare pays it: parse the body,
// find its tokens (its stable prefix, the system prompt: "prefix"; or
// the whole prompt: "whole"), key them and match 16 servers, each holding
// part of it.
func BenchmarkPrepareCached(b *testing.B) {
	f := newFakeTokenizeServer(b)
	// One check against the whole prompt (the warm-up's), then none: a
	// checked prompt's whole tokens would be cached too.
	tok := NewTokenizer(TokenizerOptions{VerifyFirst: 1, VerifyEvery: 1 << 30})
	b.Cleanup(tok.Close)
	x := NewIndex()
	body := chatBody(1500, "what now?")
	p := Prompt{Model: "tiny", Chat: true, Body: body}
	ctx := context.Background()
	servers := []string{f.addr()}
	ids, err := tok.Tokenize(ctx, servers, p)
	if err != nil {
		b.Fatal(err)
	}
	// The system prompt's tokens, cached by a first request's background
	// call.
	other := Prompt{Model: "tiny", Chat: true, Body: chatBody(1500, "another question")}
	for {
		if t, err := tok.Lookup(servers, other); err == nil && t.Prefix {
			break
		}
		time.Sleep(time.Millisecond)
	}
	var addrs []string
	for i := range 16 {
		addr := fmt.Sprintf("10.0.0.%d:8000", i+1)
		addrs = append(addrs, addr)
		s := x.Server(addr)
		s.SetState(Synced)
		n := min(16*(i+1), len(ids.IDs)/16)
		apply(s, storeRun(ids.IDs, 16, 0, n, engineHashes(ids.IDs, 16, uint64(i)), ""))
	}
	third := Prompt{Model: "tiny", Chat: true, Body: chatBody(1500, "a third question")}
	for _, c := range []struct {
		name string
		p    Prompt
	}{{"prefix", third}, {"whole", p}} {
		b.Run(c.name, func(b *testing.B) {
			n, ok := make([]int, len(addrs)), make([]bool, len(addrs))
			b.SetBytes(int64(len(c.p.Body)))
			b.ReportAllocs()
			for b.Loop() {
				t, err := tok.Lookup(servers, c.p)
				if err != nil || t.Prefix != (c.name == "prefix") {
					b.Fatal(err, t.Prefix)
				}
				q := x.NewQuery(t.IDs, t.Adapter, t.Salt)
				q.CachedTokens(addrs, n, ok)
				q.Release()
			}
			b.ReportMetric(float64(len(ids.IDs)), "tokens")
		})
	}
}

// BenchmarkRealVLLMTokenize is what a prompt the cache does not have
// costs: one POST /tokenize to a real vLLM (CPU build, idle), a distinct
// ~1,000-token chat prompt each time.
//
//	SWITCHYARD_REQUIRE_VLLM=1 go test -run '^$' -bench RealVLLMTokenize -benchtime 200x ./picker/kvevents/
func BenchmarkRealVLLMTokenize(b *testing.B) {
	python := realvllm.Require(b)
	model := realvllm.EnsureModel(b, python)
	srv := realvllm.StartFleet(b, python, model, realvllm.Options{})[0]
	tok := NewTokenizer(TokenizerOptions{MaxCachedTokens: 1})
	ctx := context.Background()
	i := 0
	var tokens int
	for b.Loop() {
		i++
		t, err := tok.Tokenize(ctx, []string{srv.Addr}, Prompt{Model: "tiny", Chat: true, Body: chatBody(700, fmt.Sprintf("question %d", i))})
		if err != nil {
			b.Fatal(err)
		}
		tokens = len(t.IDs)
	}
	st := tok.Stats()
	if st.Hits != 0 || st.Calls != int64(i) {
		b.Fatalf("stats %+v after %d prompts", st, i)
	}
	b.ReportMetric(float64(tokens), "tokens")
}

// BenchmarkIndexApply is what following a server costs the router: each
// op stores a 64-block run (16-token blocks) and evicts it again; it
// reports the memory a held block takes (server maps and the pool's key
// table) from a second index holding 26,000 blocks on each of 8 servers.
func BenchmarkIndexApply(b *testing.B) {
	x := NewIndex()
	s := x.Server("a")
	s.SetState(Synced)
	prompt := seqTokens(0, 64*16)
	hashes := engineHashes(prompt, 16, 1)
	store := Batch{Events: []Event{storeRun(prompt, 16, 0, 64, hashes, "")}}
	evict := Batch{Events: []Event{{Kind: BlockRemoved, Hashes: hashes, Medium: MediumGPU}}}
	b.ReportAllocs()
	for b.Loop() {
		s.Apply(&store, testNow)
		s.Apply(&evict, testNow)
	}
	b.StopTimer()
	const servers, blocks = 8, 26000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	big := NewIndex()
	long := seqTokens(0, blocks*16)
	for i := range servers {
		srv := big.Server(fmt.Sprint(i))
		// Servers share half their blocks (common prefixes), as a pool's do.
		h := engineHashes(long, 16, uint64(i))
		apply(srv, storeRun(long, 16, 0, blocks/2, h, ""))
		other := seqTokens(1_000_000*(i+1), blocks/2*16)
		apply(srv, storeRun(other, 16, 0, blocks/2, engineHashes(other, 16, uint64(i)), ""))
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/(servers*blocks), "bytes/held-block")
	runtime.KeepAlive(big)
}
