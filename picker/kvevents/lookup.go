package kvevents

import (
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"time"
)

// Stable prefixes: what a request shares with the requests before it.
//
// A request's whole prompt is usually new (its last user turn, its
// question), but what comes before it is not: a conversation's history,
// a system prompt, a document. The cache is keyed by those stable
// prefixes, each tokenized once for all the requests that share it:
//
//   - chat: the conversation's first j messages, rendered without a
//     generation prompt (add_generation_prompt false), for every j short
//     of the whole; the background call warms the messages before the
//     last one, which the next turn of the conversation, and every
//     request with the same history or system prompt, starts with.
//   - completions: the prompt text cut just after a line break that sits
//     between two non-space characters (a single "\n"): every tokenizer
//     vLLM serves splits words there, so the cut text's tokens are the
//     whole text's first ones. The background call warms the cut at the
//     last such line break.
//
// Whether the prefix's tokens really start the whole prompt's depends on
// the chat template (some move the system prompt to the last turn) and
// the tokenizer; it is checked (warm.go): the first prompts of every
// model and kind, then one in VerifyEvery, are tokenized whole in the
// background too, and a model whose prefix tokens ever differ from the
// whole prompt's is matched only by whole prompts from then on.
//
// A prefix's ids tell exactly how much of the prefix each server holds;
// past it, nothing is known, so a server holding the whole prefix holds
// at least that much (Query.Bounded).

// ErrPending: the request's tokens are not known yet (no whole prompt
// or stable prefix of it in the cache); they are being fetched in the
// background for the requests that follow. The caller uses its estimate.
var ErrPending = errors.New("prompt not tokenized yet (tokenizing in the background)")

// ErrNoPrefix: the request has no stable prefix (a one-message
// conversation, a completion prompt without a line break) and its whole
// prompt is not cached; nothing is fetched for it.
var ErrNoPrefix = errors.New("prompt has no stable prefix to key it by")

// Look-up bounds: the longest stable prefixes a request tries.
const (
	maxChatCuts       = 64
	maxCompletionCuts = 256
)

// cut is one stable prefix of a request: its cache key, how many bytes
// of the prompt it covers (messages' JSON, or text), and where it ends
// (messages, or text bytes).
type cut struct {
	key   uint64
	bytes int
	end   int
}

// keyed is a request's cache keys (pooled: Lookup allocates little).
type keyed struct {
	r     request
	whole uint64
	text  string   // completion prompt
	ids   []uint32 // completion prompt given as token ids
	elems [][2]int // chat messages' spans in r.Messages
	cuts  []cut    // stable prefixes, shortest first (the last maxCuts)
	total int      // bytes of the whole prompt (as cuts count them)
}

var keyedPool = sync.Pool{New: func() any { return new(keyed) }}

// Lookup returns what the cache knows of p's tokens, never waiting for a
// server: the whole prompt's ids, or the longest stable prefix's (Prefix
// set, Total estimated from the share of the prompt it covers). It fails
// with ErrPending when neither is cached (a background call to the least
// busy of servers fetches the prefix for the requests that follow),
// ErrNoPrefix when there is nothing to fetch, ErrUnsupported for
// requests that cannot be keyed exactly, or a parse error.
func (t *Tokenizer) Lookup(servers []string, p Prompt) (Tokens, error) {
	k := keyedPool.Get().(*keyed)
	defer func() {
		k.r = request{}
		k.text, k.ids = "", nil
		k.elems, k.cuts = k.elems[:0], k.cuts[:0]
		keyedPool.Put(k)
	}()
	if err := parse(p, &k.r); err != nil {
		return Tokens{}, err
	}
	var err error
	if k.whole, k.text, k.ids, err = t.wholeKey(p, &k.r); err != nil {
		return Tokens{}, err
	}
	out := Tokens{Salt: k.r.CacheSalt}
	// Whether the model is an adapter decides its blocks' keys: read
	// from the servers' model lists, in the background too.
	adapter, known := t.adapterOf(p.Model)
	if !known || t.modelsStale(p.Model, time.Now()) {
		t.bg.refreshModels(servers, p.Model)
	}
	out.Adapter = adapter
	if k.ids != nil {
		if !known {
			t.misses.Add(1)
			return Tokens{}, ErrPending
		}
		t.hits.Add(1)
		out.IDs = k.ids
		return out, nil
	}
	if ids := t.lookup(k.whole); ids != nil && known {
		t.hits.Add(1)
		out.IDs = ids
		return out, nil
	}
	stable := t.bg.stable(p)
	if stable {
		t.cutsOf(p, k)
	}
	var hit *cut
	var hitIDs []uint32
	if len(k.cuts) > 0 {
		t.mu.RLock()
		for i := len(k.cuts) - 1; i >= 0; i-- {
			if e := t.cache[k.cuts[i].key]; e != nil {
				hit, hitIDs = &k.cuts[i], e.ids
				if !e.ref.Load() {
					e.ref.Store(true)
				}
				break
			}
		}
		t.mu.RUnlock()
	}
	// Warm the longest stable prefix for the requests that follow (the
	// next turn of this conversation; siblings sharing it); check a
	// sample against the whole prompt.
	var target *cut
	if n := len(k.cuts); n > 0 {
		target = &k.cuts[n-1]
	}
	verify := hit != nil && t.bg.sampleVerify(p)
	if target != nil && (hit != target || verify) || !stable {
		t.bg.enqueue(servers, p, k, target, hit, verify)
	}
	if hit == nil || !known {
		if target == nil && stable {
			t.unkeyed.Add(1)
			return Tokens{}, ErrNoPrefix
		}
		t.misses.Add(1)
		return Tokens{}, ErrPending
	}
	t.prefixHits.Add(1)
	out.IDs, out.Prefix = hitIDs, true
	out.Total = len(hitIDs)
	if hit.bytes > 0 && k.total > hit.bytes {
		out.Total = int(int64(len(hitIDs)) * int64(k.total) / int64(hit.bytes))
	}
	out.Total = max(out.Total, len(hitIDs)+1)
	return out, nil
}

// cutsOf computes p's stable prefixes into k.cuts (shortest first, the
// longest maxCuts of them).
func (t *Tokenizer) cutsOf(p Prompt, k *keyed) {
	var h keyHash
	h.SetSeed(t.seed)
	h.field([]byte(p.Model))
	if p.Chat {
		var ok bool
		if k.elems, ok = splitArray(k.r.Messages, k.elems[:0]); !ok || len(k.elems) < 2 {
			return
		}
		h.WriteByte('C')
		for _, f := range [][]byte{k.r.AddSpecialTokens, k.r.ChatTemplate, k.r.ChatTemplateKwargs, k.r.Tools} {
			h.field(f)
		}
		first := max(1, len(k.elems)-maxChatCuts)
		covered := 0
		for j, e := range k.elems {
			if j == len(k.elems)-1 {
				break
			}
			h.field(k.r.Messages[e[0]:e[1]])
			covered += e[1] - e[0]
			if j+1 >= first {
				k.cuts = append(k.cuts, cut{key: h.Sum64(), bytes: covered, end: j + 1})
			}
		}
		k.total = covered + k.elems[len(k.elems)-1][1] - k.elems[len(k.elems)-1][0]
		return
	}
	text := k.text
	k.total = len(text)
	h.WriteByte('T')
	h.field(k.r.AddSpecialTokens)
	// Boundaries first (the last maxCompletionCuts), then one pass of
	// hashing that stops at each.
	var ends []int
	for i := 2; i < len(text); i++ {
		if text[i-1] == '\n' && !isSpace(text[i-2]) && !isSpace(text[i]) {
			ends = append(ends, i)
		}
	}
	if len(ends) > maxCompletionCuts {
		ends = ends[len(ends)-maxCompletionCuts:]
	}
	prev := 0
	for _, e := range ends {
		h.WriteString(text[prev:e])
		prev = e
		k.cuts = append(k.cuts, cut{key: h.Sum64(), bytes: e, end: e})
	}
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'
}

// prefixBody is the /tokenize body of p's stable prefix c.
func prefixBody(p Prompt, k *keyed, c *cut) []byte {
	if !p.Chat {
		b, _ := json.Marshal(completionTokenize{Model: p.Model, Prompt: k.text[:c.end], AddSpecialTokens: k.r.AddSpecialTokens})
		return b
	}
	var msgs strings.Builder
	msgs.WriteByte('[')
	for i, e := range k.elems[:c.end] {
		if i > 0 {
			msgs.WriteByte(',')
		}
		msgs.Write(k.r.Messages[e[0]:e[1]])
	}
	msgs.WriteByte(']')
	b, _ := json.Marshal(chatTokenize{Model: p.Model, Messages: json.RawMessage(msgs.String()), AddGenerationPrompt: json.RawMessage("false"),
		AddSpecialTokens: k.r.AddSpecialTokens, ChatTemplate: k.r.ChatTemplate, ChatTemplateKwargs: k.r.ChatTemplateKwargs, Tools: k.r.Tools})
	return b
}

// splitArray appends the spans of a JSON array's elements to dst; ok is
// false when b is not an array.
func splitArray(b []byte, dst [][2]int) ([][2]int, bool) {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '[' {
		return dst, false
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == ']' {
		return dst, true
	}
	for i < len(b) {
		start := i
		depth := 0
		for ; i < len(b); i++ {
			c := b[i]
			if c == '"' {
				for i++; i < len(b) && b[i] != '"'; i++ {
					if b[i] == '\\' {
						i++
					}
				}
				continue
			}
			if c == '{' || c == '[' {
				depth++
			} else if c == '}' || c == ']' {
				if depth == 0 {
					break
				}
				depth--
			} else if c == ',' && depth == 0 {
				break
			}
		}
		if i >= len(b) {
			return dst, false
		}
		end := i
		for end > start && isSpace(b[end-1]) {
			end--
		}
		dst = append(dst, [2]int{start, end})
		if b[i] == ']' {
			return dst, true
		}
		i = skipWS(b, i+1)
	}
	return dst, false
}

func skipWS(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}
