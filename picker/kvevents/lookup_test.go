package kvevents

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

func chatPrompt(model string, msgs ...[2]string) Prompt {
	var m []map[string]string
	for _, x := range msgs {
		m = append(m, map[string]string{"role": x[0], "content": x[1]})
	}
	b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4, "messages": m})
	return Prompt{Model: model, Chat: true, Body: b}
}

func completionPromptOf(model, text string) Prompt {
	b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4, "prompt": text})
	return Prompt{Model: model, Body: b}
}

// lookupEventually polls Lookup until it answers without ErrPending.
func lookupEventually(t *testing.T, tok *Tokenizer, servers []string, p Prompt) Tokens {
	t.Helper()
	var out Tokens
	testutil.Eventually(t, 10*time.Second, "tokens in the cache", func() error {
		var err error
		out, err = tok.Lookup(servers, p)
		return err
	})
	return out
}

// A request whose prompt is not cached is answered at once (the
// estimate routes it) while a background call tokenizes its stable
// prefix; the next request sharing the system prompt finds it, and the
// first prompts of the model are checked against their whole prompt.
func TestLookupChatPrefix(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{VerifyFirst: 1, VerifyEvery: 1 << 30})
	t.Cleanup(tok.Close)
	servers := []string{f.addr()}
	sys := [2]string{"system", "you are a router"}
	first := chatPrompt("tiny", sys, [2]string{"user", "first question"})

	// The server holds every call until released: Lookup must not wait.
	gate := make(chan struct{})
	f.gate.Store(&gate)
	if _, err := tok.Lookup(servers, first); !errors.Is(err, ErrPending) {
		t.Fatalf("first lookup: %v, want ErrPending", err)
	}
	if _, err := tok.Lookup(servers, first); !errors.Is(err, ErrPending) {
		t.Fatalf("second lookup while the call is held: %v, want ErrPending", err)
	}
	close(gate)

	second := chatPrompt("tiny", sys, [2]string{"user", "another question, longer than the first"})
	got := lookupEventually(t, tok, servers, second)
	if want := "<system>you are a router\n"; !got.Prefix || string(u32bytes(got.IDs)) != want {
		t.Fatalf("second request: %+v (%q), want the system prompt's tokens %q as a prefix", got, u32bytes(got.IDs), want)
	}
	if whole := len(renderFake(mustMap(second.Body), false)); got.Total < len(got.IDs)+1 || got.Total > 3*whole {
		t.Fatalf("estimated total %d tokens for a %d-token prompt", got.Total, whole)
	}
	testutil.Eventually(t, 10*time.Second, "first prompts checked", func() error {
		if st := tok.Stats(); st.Verified == 0 || st.Mismatches != 0 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	// The first request's whole prompt was tokenized to check it: a
	// repeat of it is exact.
	rep := lookupEventually(t, tok, servers, first)
	if rep.Prefix || string(u32bytes(rep.IDs)) != "<system>you are a router\n<user>first question\n<assistant>" {
		t.Fatalf("repeat: %+v", rep)
	}

	// A conversation's next turn finds the history warmed by the turn
	// before: everything up to the last turn's question.
	turn1 := chatPrompt("tiny", sys, [2]string{"user", "q1"}, [2]string{"assistant", "a1"}, [2]string{"user", "q2"})
	if got, err := tok.Lookup(servers, turn1); err != nil || string(u32bytes(got.IDs)) != "<system>you are a router\n" {
		t.Fatalf("turn 1: %q, %v (the system prompt is cached)", u32bytes(got.IDs), err)
	}
	history := "<system>you are a router\n<user>q1\n<assistant>a1\n"
	testutil.Eventually(t, 10*time.Second, "turn 1's history warmed", func() error {
		if got, _ := tok.Lookup(servers, turn1); string(u32bytes(got.IDs)) != history {
			return fmt.Errorf("turn 1 keyed by %q", u32bytes(got.IDs))
		}
		return nil
	})
	turn2 := chatPrompt("tiny", sys, [2]string{"user", "q1"}, [2]string{"assistant", "a1"}, [2]string{"user", "q2"}, [2]string{"assistant", "a2"}, [2]string{"user", "q3"})
	if got, err := tok.Lookup(servers, turn2); err != nil || string(u32bytes(got.IDs)) != history {
		t.Fatalf("turn 2 keyed by %q (%v), want turn 1's history %q", u32bytes(got.IDs), err, history)
	}
	st := tok.Stats()
	if st.PrefixHits == 0 || st.Misses == 0 || st.Failures != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func mustMap(b []byte) map[string]any {
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	return m
}

// Completion prompts are keyed by their text cut after a single line
// break between two non-space characters.
func TestLookupCompletionPrefix(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{})
	t.Cleanup(tok.Close)
	servers := []string{f.addr()}
	doc := "a shared document\nof two lines."
	if _, err := tok.Lookup(servers, completionPromptOf("tiny", doc+"\nquestion one")); !errors.Is(err, ErrPending) {
		t.Fatalf("first: %v", err)
	}
	got := lookupEventually(t, tok, servers, completionPromptOf("tiny", doc+"\nquestion two, a longer one"))
	if !got.Prefix || string(u32bytes(got.IDs)) != doc+"\n" {
		t.Fatalf("second: %+v (%q)", got, u32bytes(got.IDs))
	}
	// A shorter cut of the same text (the document's first line) is a
	// prefix too, but the longest cached one answers.
	third := lookupEventually(t, tok, servers, completionPromptOf("tiny", doc+"\nquestion three\nwith two lines"))
	if string(u32bytes(third.IDs)) != doc+"\n" {
		t.Fatalf("third: %q", u32bytes(third.IDs))
	}
	// No single line break between words: no stable prefix.
	for _, p := range []string{"one line only", "trailing space \nnext", "two breaks\n\nnext", "\nleading"} {
		if _, err := tok.Lookup(servers, completionPromptOf("tiny", p)); !errors.Is(err, ErrNoPrefix) {
			t.Errorf("%q: %v, want ErrNoPrefix", p, err)
		}
	}
}

// Requests wanting the same prefix share one call, made on the least
// busy candidate.
func TestLookupCoalescesOnTheLeastBusy(t *testing.T) {
	a, b := newFakeTokenizeServer(t), newFakeTokenizeServer(t)
	busy := map[string]int{a.addr(): 5, b.addr(): 0}
	tok := NewTokenizer(TokenizerOptions{VerifyFirst: 1, VerifyEvery: 1 << 30, Busy: func(_, addr string) int { return busy[addr] }})
	t.Cleanup(tok.Close)
	servers := []string{a.addr(), b.addr()}
	if _, err := tok.fetchModels(context.Background(), b.addr()); err != nil {
		t.Fatal(err)
	}
	// The prefix, checked once against the whole prompt.
	_, _ = tok.Lookup(servers, chatPrompt("tiny", [2]string{"system", "warm"}, [2]string{"user", "x"}))
	lookupEventually(t, tok, servers, chatPrompt("tiny", [2]string{"system", "warm"}, [2]string{"user", "y"}))
	testutil.Eventually(t, 10*time.Second, "first prompt checked", func() error {
		if st := tok.Stats(); st.Verified != 1 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	if b.calls.Load() != 2 { // the prefix, the whole prompt
		t.Fatalf("%d tokenize calls, want 2", b.calls.Load())
	}
	gate := make(chan struct{})
	b.gate.Store(&gate)
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = tok.Lookup(servers, chatPrompt("tiny", [2]string{"system", "shared"}, [2]string{"user", fmt.Sprint("q", i)}))
		}()
	}
	wg.Wait()
	close(gate)
	lookupEventually(t, tok, servers, chatPrompt("tiny", [2]string{"system", "shared"}, [2]string{"user", "last"}))
	if a.calls.Load() != 0 || b.calls.Load() != 3 {
		t.Fatalf("tokenize calls: %d on the busy server, %d on the idle one; want 0 and 3 (50 requests, one call)", a.calls.Load(), b.calls.Load())
	}
}

// A server gets no more background calls than its budget: what finds no
// room is dropped (and asked for again by a later request).
func TestLookupBudget(t *testing.T) {
	f := newFakeTokenizeServer(t)
	tok := NewTokenizer(TokenizerOptions{CallsPerSecond: 0.001, Burst: 3, VerifyFirst: 1, VerifyEvery: 1 << 30})
	t.Cleanup(tok.Close)
	servers := []string{f.addr()}
	for i := range 6 {
		_, _ = tok.Lookup(servers, chatPrompt("tiny", [2]string{"system", fmt.Sprint("prefix ", i)}, [2]string{"user", "x"}))
		if i == 0 {
			// The model list (one call) comes before anything is keyed.
			testutil.Eventually(t, 10*time.Second, "model list", func() error {
				if _, known := tok.adapterOf("tiny"); !known {
					return errors.New("not read yet")
				}
				return nil
			})
		}
	}
	testutil.Eventually(t, 20*time.Second, "prefixes dropped", func() error {
		if st := tok.Stats(); st.Dropped == 0 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	if n := f.calls.Load(); n > 2 { // + the model list: the budget of 3
		t.Fatalf("%d tokenize calls beyond a budget of 3 calls", n)
	}
}

// A model whose prefix tokens do not start its prompts' tokens (a
// template that moves the system prompt) is found out by the check and
// matched by whole prompts only from then on.
func TestLookupDetectsUnstablePrefixes(t *testing.T) {
	f := newFakeTokenizeServer(t)
	f.systemLast.Store(true)
	var unstable []string
	var mu sync.Mutex
	tok := NewTokenizer(TokenizerOptions{OnUnstable: func(model string, chat bool) {
		mu.Lock()
		unstable = append(unstable, fmt.Sprintf("%s %v", model, chat))
		mu.Unlock()
	}})
	t.Cleanup(tok.Close)
	servers := []string{f.addr()}
	sys := [2]string{"system", "moved"}
	_, _ = tok.Lookup(servers, chatPrompt("tiny", sys, [2]string{"user", "a"}))
	testutil.Eventually(t, 10*time.Second, "mismatch found", func() error {
		if st := tok.Stats(); st.Mismatches == 0 || !slices.Equal(st.Unstable, []string{"tiny (chat)"}) {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
	mu.Lock()
	if !slices.Equal(unstable, []string{"tiny true"}) {
		t.Fatalf("told %v", unstable)
	}
	mu.Unlock()
	// The system prompt's tokens are cached, but no longer used.
	p := chatPrompt("tiny", sys, [2]string{"user", "b"})
	if _, err := tok.Lookup(servers, p); !errors.Is(err, ErrPending) {
		t.Fatalf("unstable model keyed by a prefix: %v", err)
	}
	// Its whole prompt was fetched in the background: a repeat is exact.
	got := lookupEventually(t, tok, servers, p)
	if got.Prefix || string(u32bytes(got.IDs)) != "<user>b\n<system>moved\n<assistant>" {
		t.Fatalf("repeat %+v", got)
	}
	// Completions of the same model are another kind, still keyed by
	// prefixes.
	_, _ = tok.Lookup(servers, completionPromptOf("tiny", "doc\nq1"))
	if got := lookupEventually(t, tok, servers, completionPromptOf("tiny", "doc\nq2")); !got.Prefix {
		t.Fatalf("completion %+v", got)
	}
}

// A model whose servers refuse its stable prefixes (conversations that
// do not end with a user message) is matched by whole prompts only once
// a few have been refused and none accepted.
func TestLookupRefusedPrefixes(t *testing.T) {
	f := newFakeTokenizeServer(t)
	f.refuseEnd.Store(true)
	tok := NewTokenizer(TokenizerOptions{VerifyFirst: 1, VerifyEvery: 1 << 30})
	t.Cleanup(tok.Close)
	servers := []string{f.addr()}
	for i := range 4 {
		_, _ = tok.Lookup(servers, chatPrompt("tiny", [2]string{"system", fmt.Sprint("s", i)}, [2]string{"user", "u"}))
		testutil.Eventually(t, 10*time.Second, "prefix refused", func() error {
			if st := tok.Stats(); st.Refused < int64(min(i+1, maxRefused)) {
				return fmt.Errorf("stats %+v", st)
			}
			return nil
		})
	}
	if st := tok.Stats(); !slices.Equal(st.Unstable, []string{"tiny (chat)"}) || st.Refused != maxRefused {
		t.Fatalf("stats %+v", st)
	}
	// Whole prompts (ending with the user's message) are accepted.
	p := chatPrompt("tiny", [2]string{"system", "s9"}, [2]string{"user", "u"})
	_, _ = tok.Lookup(servers, p)
	if got := lookupEventually(t, tok, servers, p); got.Prefix {
		t.Fatalf("%+v", got)
	}
}

func TestSplitArray(t *testing.T) {
	for in, want := range map[string][]string{
		`[]`:                            {},
		` [ {"a":1} , {"b":"x,]}"} ]`:   {`{"a":1}`, `{"b":"x,]}"}`},
		`[{"c":"q\"],"},[1,[2]],"s",3]`: {`{"c":"q\"],"}`, `[1,[2]]`, `"s"`, `3`},
	} {
		spans, ok := splitArray([]byte(in), nil)
		if !ok {
			t.Fatalf("%s: not an array", in)
		}
		var got []string
		for _, s := range spans {
			got = append(got, in[s[0]:s[1]])
		}
		if len(got) != len(want) || (len(got) > 0 && !slices.Equal(got, want)) {
			t.Errorf("%s: %q, want %q", in, got, want)
		}
	}
	for _, bad := range []string{`{}`, `[1,2`, `["x]`} {
		if _, ok := splitArray([]byte(bad), nil); ok {
			t.Errorf("%s split", bad)
		}
	}
}
