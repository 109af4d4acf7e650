package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"
)

// How a request becomes the engine's token ids.
//
// The router asks the engine: vLLM's POST /tokenize runs the request
// through the same tokenizer, chat template and special-token rules as
// the generation endpoints, for the base model or any LoRA adapter the
// server has, so the ids are exactly the ones the engine will compute
// and key its blocks by. A tokenizer in the router would have to
// reimplement every model's tokenizer and Jinja chat template to be as
// exact.
//
// A request never waits for that answer (Lookup, lookup.go): the cache
// is keyed by the prompt's stable prefixes (a conversation's messages
// before its last one, a completion prompt cut at a line break), which
// requests sharing a system prompt, a document or a conversation's
// history share; a prompt whose prefix is not cached yet is routed by
// the estimate while a background call fills the cache for the next
// (warm.go). Tokenize is the blocking form, for the whole prompt.

// ErrUnsupported marks a request whose blocks cannot be matched exactly:
// several prompts in one request, multimodal content, or prompt
// embeddings (their block keys depend on data the router does not
// have). Callers fall back to their estimate.
var ErrUnsupported = errors.New("request not supported by the exact prefix index")

// Prompt is what Tokenize needs of a request.
type Prompt struct {
	// Model is the model or adapter name sent upstream (after any
	// rewrite).
	Model string
	// Chat is true for /v1/chat/completions, false for /v1/completions.
	Chat bool
	// Body is the JSON request body; only read.
	Body []byte
}

// Tokens is a tokenized prompt.
type Tokens struct {
	// IDs are the prompt's token ids; shared with the cache: read only.
	// With Prefix they are the ids of a stable prefix of the prompt only.
	IDs []uint32
	// Prefix: IDs are a prefix of the prompt's token ids (what follows
	// it is not known); Total is then the prompt's estimated length in
	// tokens.
	Prefix bool
	Total  int
	// Adapter is the LoRA adapter the request runs on ("" the base model).
	Adapter string
	// Salt is the request's cache_salt ("" none).
	Salt string
}

// TokenizerOptions tune a Tokenizer. Zero fields take the defaults.
type TokenizerOptions struct {
	// Client sends the requests (nil: a keep-alive client of its own).
	Client *http.Client
	// Timeout bounds one /tokenize exchange (default 2 s).
	Timeout time.Duration
	// MaxCachedTokens bounds the cache by the token ids it holds
	// (default 4M: 16 MiB).
	MaxCachedTokens int
	// ModelsTTL is how long a server's list of adapters (GET /v1/models)
	// is trusted (default 60 s).
	ModelsTTL time.Duration
	// APIKey is sent as a bearer token ("" none).
	APIKey string

	// Background calls (warm.go). CallsPerSecond and Burst bound the
	// calls each server gets (default 20/s, bursts of 20); a server gets
	// one call at a time; Workers calls run at once per pool (default 2);
	// QueueLength prompts may wait for one (default 256; more are
	// dropped, and tried again by the next request that needs them).
	CallsPerSecond float64
	Burst          int
	Workers        int
	QueueLength    int
	// Busy, when set, tells how busy a server is (its requests in
	// flight): background calls go to the least busy candidate.
	Busy func(pool, addr string) int
	// VerifyFirst prompts per model and kind (chat, completions) have
	// their stable prefix checked against the whole prompt's tokens
	// (default 4), then one in VerifyEvery (default 64).
	VerifyFirst, VerifyEvery int
	// OnUnstable, when set, is told once about a model whose stable
	// prefixes turned out not to start its prompts' tokens.
	OnUnstable func(model string, chat bool)
}

func (o *TokenizerOptions) setDefaults() {
	if o.Timeout <= 0 {
		o.Timeout = 2 * time.Second
	}
	if o.MaxCachedTokens <= 0 {
		o.MaxCachedTokens = 4 << 20
	}
	if o.ModelsTTL <= 0 {
		o.ModelsTTL = time.Minute
	}
	if o.CallsPerSecond <= 0 {
		o.CallsPerSecond = 20
	}
	if o.Burst <= 0 {
		o.Burst = 20
	}
	if o.Workers <= 0 {
		o.Workers = 2
	}
	if o.QueueLength <= 0 {
		o.QueueLength = 256
	}
	if o.VerifyFirst <= 0 {
		o.VerifyFirst = 4
	}
	if o.VerifyEvery <= 0 {
		o.VerifyEvery = 64
	}
}

// Tokenizer tokenizes requests through a pool's servers and caches the
// answers. Safe for concurrent use. Close stops its background calls.
type Tokenizer struct {
	opts   TokenizerOptions
	pool   string // for Busy
	client *http.Client
	seed   maphash.Seed
	flight singleflight.Group
	rr     atomic.Uint64

	mu     sync.RWMutex
	cache  map[uint64]*cacheEntry
	order  []uint64 // insertion order ring for eviction
	oldest int
	cached int // token ids held

	modelsMu sync.Mutex
	models   map[string]*serverModels // by server
	// adapters says, per model name the servers list, whether it is a
	// LoRA adapter (from whichever server listed it last).
	adapters map[string]adapterInfo

	bg warmer // background calls (warm.go)

	// Counters: requests answered from the whole prompt's cache entry,
	// from a stable prefix's, or not (misses); blocking-path hits;
	// /tokenize round trips and their failures.
	hits, prefixHits, misses, unkeyed atomic.Int64
	calls, failures                   atomic.Int64
	callNanos                         atomic.Int64
}

type cacheEntry struct {
	ids []uint32
	ref atomic.Bool // used since it last escaped eviction
}

type serverModels struct {
	adapters map[string]bool
	known    map[string]bool
	fetched  time.Time
}

type adapterInfo struct {
	adapter bool
	at      time.Time
}

// NewTokenizer returns a Tokenizer.
func NewTokenizer(opts TokenizerOptions) *Tokenizer {
	opts.setDefaults()
	t := &Tokenizer{opts: opts, client: opts.Client, seed: maphash.MakeSeed(), cache: map[uint64]*cacheEntry{},
		models: map[string]*serverModels{}, adapters: map[string]adapterInfo{}}
	if t.client == nil {
		t.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second}}
	}
	t.bg.init(t)
	return t
}

// Close stops the background calls and waits for them.
func (t *Tokenizer) Close() { t.bg.close() }

// TokenizerStats are a Tokenizer's counters.
type TokenizerStats struct {
	// Requests keyed (Lookup): Hits from the whole prompt's tokens,
	// PrefixHits from a stable prefix's, Misses neither (the estimate
	// answered), Unkeyed without a stable prefix to warm.
	Hits, PrefixHits, Misses, Unkeyed int64
	// Calls went to a server (Failures of them failed); CallSeconds is
	// their total time. Dropped prompts found no server within its
	// budget, or no room in the queue.
	Calls, Failures, Dropped int64
	CallSeconds              float64
	// Verified stable prefixes were checked against the whole prompt's
	// tokens (a call each); Mismatches were not a prefix of them.
	// Refused prefixes were refused by the server (400). Unstable lists
	// the models ("model (chat)" or "model (completions)") whose
	// prefixes are not used since: a mismatch, or refusals and no
	// prefix accepted.
	Verified, Mismatches, Refused int64
	Unstable                      []string
	// CachedTokens is the token ids the cache holds.
	CachedTokens int
}

// Stats returns the counters.
func (t *Tokenizer) Stats() TokenizerStats {
	t.mu.RLock()
	n := t.cached
	t.mu.RUnlock()
	st := TokenizerStats{Hits: t.hits.Load(), PrefixHits: t.prefixHits.Load(), Misses: t.misses.Load(), Unkeyed: t.unkeyed.Load(),
		Calls: t.calls.Load(), Failures: t.failures.Load(), CallSeconds: time.Duration(t.callNanos.Load()).Seconds(), CachedTokens: n}
	t.bg.stats(&st)
	return st
}

// request is the part of a body that decides its tokens.
type request struct {
	Model    string          `json:"model"`
	Messages json.RawMessage `json:"messages"`
	Prompt   json.RawMessage `json:"prompt"`
	// Chat template inputs (vLLM's TokenizeChatRequest takes the same).
	AddGenerationPrompt  json.RawMessage `json:"add_generation_prompt,omitempty"`
	ContinueFinalMessage json.RawMessage `json:"continue_final_message,omitempty"`
	AddSpecialTokens     json.RawMessage `json:"add_special_tokens,omitempty"`
	ChatTemplate         json.RawMessage `json:"chat_template,omitempty"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs,omitempty"`
	Tools                json.RawMessage `json:"tools,omitempty"`
	// Documents feed the chat template too, but vLLM's /tokenize does not
	// take them: such requests are not keyed.
	Documents    json.RawMessage `json:"documents,omitempty"`
	CacheSalt    string          `json:"cache_salt,omitempty"`
	PromptEmbeds json.RawMessage `json:"prompt_embeds,omitempty"`
}

// multimodal content parts, whose blocks carry identifiers the router
// cannot compute.
var multimodal = [][]byte{[]byte(`"image_url"`), []byte(`"input_audio"`), []byte(`"video_url"`), []byte(`"audio_url"`), []byte(`"image_embeds"`)}

// parse reads what decides p's tokens, refusing what cannot be keyed.
func parse(p Prompt, r *request) error {
	if err := json.Unmarshal(p.Body, r); err != nil {
		return fmt.Errorf("tokenize: body: %w", err)
	}
	if len(r.PromptEmbeds) > 0 {
		return fmt.Errorf("%w: prompt_embeds", ErrUnsupported)
	}
	if p.Chat {
		if len(r.Messages) == 0 {
			return errors.New("tokenize: chat request without messages")
		}
		for _, m := range multimodal {
			if bytes.Contains(r.Messages, m) {
				return fmt.Errorf("%w: multimodal content", ErrUnsupported)
			}
		}
		if len(r.Documents) > 0 && string(r.Documents) != "null" {
			return fmt.Errorf("%w: documents", ErrUnsupported)
		}
	}
	return nil
}

// Tokenize returns p's token ids as the pool's servers compute them,
// asking one of servers ("ip:port", tried in turn) when the cache does
// not have them, and waiting for the answer. It fails with
// ErrUnsupported for requests no server could key exactly, and with the
// server's error otherwise. Requests use Lookup, which never waits.
func (t *Tokenizer) Tokenize(ctx context.Context, servers []string, p Prompt) (Tokens, error) {
	var r request
	if err := parse(p, &r); err != nil {
		return Tokens{}, err
	}
	if len(servers) == 0 {
		return Tokens{}, errors.New("tokenize: no server")
	}
	out := Tokens{Salt: r.CacheSalt}
	// Which server: the same one for the same prompt is no better than
	// any other (all run the model); spread the work.
	first := int(t.rr.Add(1) % uint64(len(servers)))
	var err error
	for i := range min(len(servers), 2) {
		srv := servers[(first+i)%len(servers)]
		if out.Adapter, err = t.adapter(ctx, srv, p.Model); err != nil {
			continue
		}
		if out.IDs, err = t.ids(ctx, srv, p, &r); err == nil || errors.Is(err, ErrUnsupported) {
			break
		}
	}
	return out, err
}

// keyHash is a maphash with length-prefixed fields.
type keyHash struct{ maphash.Hash }

func (h *keyHash) field(b []byte) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(b)))
	h.Write(n[:])
	h.Write(b)
}

// wholeKey is the cache key of a whole prompt: exactly what its
// /tokenize body carries, read from the raw fields (a hit costs no
// encoding). For a completion it also returns the prompt's text, or its
// token ids when it is given as ids (nothing to tokenize).
func (t *Tokenizer) wholeKey(p Prompt, r *request) (key uint64, text string, ids []uint32, err error) {
	var h keyHash
	h.SetSeed(t.seed)
	h.field([]byte(p.Model))
	if p.Chat {
		h.WriteByte('c')
		for _, f := range [][]byte{r.Messages, r.AddGenerationPrompt, r.ContinueFinalMessage, r.AddSpecialTokens, r.ChatTemplate, r.ChatTemplateKwargs, r.Tools} {
			h.field(f)
		}
		return h.Sum64(), "", nil, nil
	}
	if text, ids, err = completionPrompt(r.Prompt); err != nil || ids != nil {
		return 0, "", ids, err
	}
	h.WriteByte('p')
	h.field([]byte(text))
	h.field(r.AddSpecialTokens)
	return h.Sum64(), text, nil, nil
}

// wholeBody is the /tokenize body of the whole prompt.
func wholeBody(p Prompt, r *request, text string) []byte {
	var body []byte
	if p.Chat {
		body, _ = json.Marshal(chatTokenize{Model: p.Model, Messages: r.Messages, AddGenerationPrompt: r.AddGenerationPrompt,
			ContinueFinalMessage: r.ContinueFinalMessage, AddSpecialTokens: r.AddSpecialTokens, ChatTemplate: r.ChatTemplate,
			ChatTemplateKwargs: r.ChatTemplateKwargs, Tools: r.Tools})
	} else {
		body, _ = json.Marshal(completionTokenize{Model: p.Model, Prompt: text, AddSpecialTokens: r.AddSpecialTokens})
	}
	return body
}

// ids returns the prompt's token ids, from the cache or from srv.
func (t *Tokenizer) ids(ctx context.Context, srv string, p Prompt, r *request) ([]uint32, error) {
	key, text, ids, err := t.wholeKey(p, r)
	if err != nil || ids != nil {
		return ids, err
	}
	if ids := t.lookup(key); ids != nil {
		t.hits.Add(1)
		return ids, nil
	}
	body := wholeBody(p, r, text)
	v, err, _ := t.flight.Do(strconv.FormatUint(key, 16), func() (any, error) {
		ids, err := t.call(ctx, srv, body)
		if err == nil {
			t.store(key, ids)
		}
		return ids, err
	})
	if err != nil {
		return nil, err
	}
	return v.([]uint32), nil
}

type chatTokenize struct {
	Model                string          `json:"model"`
	Messages             json.RawMessage `json:"messages"`
	AddGenerationPrompt  json.RawMessage `json:"add_generation_prompt,omitempty"`
	ContinueFinalMessage json.RawMessage `json:"continue_final_message,omitempty"`
	AddSpecialTokens     json.RawMessage `json:"add_special_tokens,omitempty"`
	ChatTemplate         json.RawMessage `json:"chat_template,omitempty"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs,omitempty"`
	Tools                json.RawMessage `json:"tools,omitempty"`
}

type completionTokenize struct {
	Model            string          `json:"model"`
	Prompt           string          `json:"prompt"`
	AddSpecialTokens json.RawMessage `json:"add_special_tokens,omitempty"`
}

// completionPrompt reads a completions prompt: a string or a one-string
// list (to tokenize), or token ids (used as they are).
func completionPrompt(raw json.RawMessage) (string, []uint32, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil, errors.New("tokenize: completion request without a prompt")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil {
		if len(ss) != 1 {
			return "", nil, fmt.Errorf("%w: %d prompts in one request", ErrUnsupported, len(ss))
		}
		return ss[0], nil, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil {
		return "", ids, nil
	}
	var idss [][]uint32
	if json.Unmarshal(raw, &idss) == nil && len(idss) == 1 {
		return "", idss[0], nil
	}
	return "", nil, fmt.Errorf("%w: prompt is neither text nor token ids of one prompt", ErrUnsupported)
}

// call asks srv's /tokenize.
func (t *Tokenizer) call(ctx context.Context, srv string, body []byte) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, t.opts.Timeout)
	defer cancel()
	start := time.Now()
	t.calls.Add(1)
	ids, err := t.post(ctx, srv, body)
	t.callNanos.Add(int64(time.Since(start)))
	if err != nil {
		t.failures.Add(1)
	}
	return ids, err
}

func (t *Tokenizer) post(ctx context.Context, srv string, body []byte) ([]uint32, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+srv+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if t.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+t.opts.APIKey)
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("tokenize on %s: %w", srv, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("tokenize on %s: %w", srv, err)
	}
	if resp.StatusCode != http.StatusOK {
		err := fmt.Errorf("tokenize on %s: status %d: %.200s", srv, resp.StatusCode, b)
		if resp.StatusCode == http.StatusBadRequest {
			err = &refusedError{err}
		}
		return nil, err
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
		Count  int      `json:"count"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("tokenize on %s: %w", srv, err)
	}
	if out.Tokens == nil || out.Count != len(out.Tokens) {
		return nil, fmt.Errorf("tokenize on %s: %d tokens for count %d", srv, len(out.Tokens), out.Count)
	}
	return out.Tokens, nil
}

// refusedError is a /tokenize the server refused (400): the prompt
// itself is not acceptable (a chat template or tokenizer that refuses a
// conversation ending with that role, say), not the server's state.
type refusedError struct{ error }

func (e *refusedError) Unwrap() error { return e.error }

// lookup returns the cached ids of key, or nil.
func (t *Tokenizer) lookup(key uint64) []uint32 {
	t.mu.RLock()
	e := t.cache[key]
	t.mu.RUnlock()
	if e == nil {
		return nil
	}
	if !e.ref.Load() {
		e.ref.Store(true)
	}
	return e.ids
}

// store caches ids, evicting the oldest entries past the token budget;
// an entry used since it last came up for eviction gets a second chance
// (a system prompt every request shares stays while one-off
// conversations pass through).
func (t *Tokenizer) store(key uint64, ids []uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(ids) > t.opts.MaxCachedTokens || t.cache[key] != nil {
		return
	}
	for spared := 0; t.cached+len(ids) > t.opts.MaxCachedTokens && t.oldest < len(t.order); {
		old := t.order[t.oldest]
		t.oldest++
		e := t.cache[old]
		if e == nil {
			continue
		}
		if e.ref.Load() && spared < len(t.cache) {
			e.ref.Store(false)
			t.order = append(t.order, old)
			spared++
			continue
		}
		t.cached -= len(e.ids)
		delete(t.cache, old)
	}
	if t.oldest > len(t.order)/2 { // compact the ring's consumed half
		t.order = append(t.order[:0], t.order[t.oldest:]...)
		t.oldest = 0
	}
	t.cache[key] = &cacheEntry{ids: ids}
	t.order = append(t.order, key)
	t.cached += len(ids)
}

// adapter returns model when srv serves it as a LoRA adapter, "" for a
// base model (its GET /v1/models lists adapters with a parent).
func (t *Tokenizer) adapter(ctx context.Context, srv, model string) (string, error) {
	t.modelsMu.Lock()
	sm := t.models[srv]
	t.modelsMu.Unlock()
	now := time.Now()
	if sm == nil || now.Sub(sm.fetched) > t.opts.ModelsTTL || !sm.known[model] && now.Sub(sm.fetched) > time.Second {
		fresh, err := t.fetchModels(ctx, srv)
		switch {
		case err == nil:
			sm = fresh
		case sm == nil:
			return "", err
		}
	}
	if sm.adapters[model] {
		return model, nil
	}
	return "", nil
}

// adapterOf says, without a call, whether model is an adapter; known is
// false while no server's list has been read with it.
func (t *Tokenizer) adapterOf(model string) (adapter string, known bool) {
	t.modelsMu.Lock()
	ai, ok := t.adapters[model]
	t.modelsMu.Unlock()
	if ai.adapter {
		adapter = model
	}
	return adapter, ok
}

// fetchModels reads srv's GET /v1/models and records its adapters.
func (t *Tokenizer) fetchModels(ctx context.Context, srv string) (*serverModels, error) {
	ctx, cancel := context.WithTimeout(ctx, t.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+srv+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	if t.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+t.opts.APIKey)
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("models of %s: %w", srv, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("models of %s: status %d", srv, resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 8<<20)).Decode(&list); err != nil {
		return nil, fmt.Errorf("models of %s: %w", srv, err)
	}
	now := time.Now()
	sm := &serverModels{adapters: map[string]bool{}, known: map[string]bool{}, fetched: now}
	t.modelsMu.Lock()
	defer t.modelsMu.Unlock()
	for _, m := range list.Data {
		sm.known[m.ID] = true
		a := m.Parent != nil && *m.Parent != ""
		if a {
			sm.adapters[m.ID] = true
		}
		t.adapters[m.ID] = adapterInfo{adapter: a, at: now}
	}
	t.models[srv] = sm
	return sm, nil
}

// modelsStale reports whether model's adapter information should be
// read again.
func (t *Tokenizer) modelsStale(model string, now time.Time) bool {
	t.modelsMu.Lock()
	defer t.modelsMu.Unlock()
	ai, ok := t.adapters[model]
	return !ok || now.Sub(ai.at) > t.opts.ModelsTTL
}
