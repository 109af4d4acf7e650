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
// exact. Answers are cached by prompt, so a repeated prompt costs no
// round trip, and identical prompts in flight share one.

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
	IDs []uint32
	// Adapter is the LoRA adapter the request runs on ("" the base model).
	Adapter string
	// Salt is the request's cache_salt ("" none).
	Salt string
}

// TokenizerOptions tune a Tokenizer. Zero fields take the defaults.
type TokenizerOptions struct {
	// Client sends the requests (nil: a keep-alive client of its own).
	Client *http.Client
	// Timeout bounds one /tokenize exchange (default 200 ms).
	Timeout time.Duration
	// MaxCachedTokens bounds the cache by the token ids it holds
	// (default 4M: 16 MiB).
	MaxCachedTokens int
	// ModelsTTL is how long a server's list of adapters (GET /v1/models)
	// is trusted (default 10 s); an unknown model refreshes it sooner.
	ModelsTTL time.Duration
	// APIKey is sent as a bearer token ("" none).
	APIKey string
}

// Tokenizer tokenizes requests through a pool's servers and caches the
// answers. Safe for concurrent use.
type Tokenizer struct {
	opts   TokenizerOptions
	client *http.Client
	seed   maphash.Seed
	flight singleflight.Group
	rr     atomic.Uint64

	mu     sync.Mutex
	cache  map[uint64]*cacheEntry
	order  []uint64 // insertion order ring for eviction
	oldest int
	cached int // token ids held

	modelsMu sync.Mutex
	models   map[string]*serverModels

	// Counters: cache hits, round trips, failures.
	hits, calls, failures atomic.Int64
	callNanos             atomic.Int64
}

type cacheEntry struct {
	ids []uint32
}

type serverModels struct {
	adapters map[string]bool
	known    map[string]bool
	fetched  time.Time
}

// NewTokenizer returns a Tokenizer.
func NewTokenizer(opts TokenizerOptions) *Tokenizer {
	if opts.Timeout <= 0 {
		opts.Timeout = 200 * time.Millisecond
	}
	if opts.MaxCachedTokens <= 0 {
		opts.MaxCachedTokens = 4 << 20
	}
	if opts.ModelsTTL <= 0 {
		opts.ModelsTTL = 10 * time.Second
	}
	t := &Tokenizer{opts: opts, client: opts.Client, seed: maphash.MakeSeed(), cache: map[uint64]*cacheEntry{}, models: map[string]*serverModels{}}
	if t.client == nil {
		t.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second}}
	}
	return t
}

// TokenizerStats are a Tokenizer's counters.
type TokenizerStats struct {
	// Hits were answered from the cache; Calls went to a server (Failures
	// of them failed); CallSeconds is the calls' total time.
	Hits, Calls, Failures int64
	CallSeconds           float64
	// CachedTokens is the token ids the cache holds.
	CachedTokens int
}

// Stats returns the counters.
func (t *Tokenizer) Stats() TokenizerStats {
	t.mu.Lock()
	n := t.cached
	t.mu.Unlock()
	return TokenizerStats{Hits: t.hits.Load(), Calls: t.calls.Load(), Failures: t.failures.Load(),
		CallSeconds: time.Duration(t.callNanos.Load()).Seconds(), CachedTokens: n}
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

// Tokenize returns p's token ids as the pool's servers compute them,
// asking one of servers ("ip:port", tried in turn) when the cache does
// not have them. It fails with ErrUnsupported for requests no server
// could key exactly, and with the server's error otherwise.
func (t *Tokenizer) Tokenize(ctx context.Context, servers []string, p Prompt) (Tokens, error) {
	var r request
	if err := json.Unmarshal(p.Body, &r); err != nil {
		return Tokens{}, fmt.Errorf("tokenize: body: %w", err)
	}
	if len(r.PromptEmbeds) > 0 {
		return Tokens{}, fmt.Errorf("%w: prompt_embeds", ErrUnsupported)
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

// ids returns the prompt's token ids, from the cache or from srv.
func (t *Tokenizer) ids(ctx context.Context, srv string, p Prompt, r *request) ([]uint32, error) {
	// The cache key covers exactly what the /tokenize body would carry,
	// read from the raw fields: a hit costs no encoding.
	var h maphash.Hash
	h.SetSeed(t.seed)
	field := func(b []byte) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	field([]byte(p.Model))
	var prompt string
	switch {
	case p.Chat:
		if len(r.Messages) == 0 {
			return nil, errors.New("tokenize: chat request without messages")
		}
		for _, m := range multimodal {
			if bytes.Contains(r.Messages, m) {
				return nil, fmt.Errorf("%w: multimodal content", ErrUnsupported)
			}
		}
		if len(r.Documents) > 0 && string(r.Documents) != "null" {
			return nil, fmt.Errorf("%w: documents", ErrUnsupported)
		}
		h.WriteByte('c')
		for _, f := range [][]byte{r.Messages, r.AddGenerationPrompt, r.ContinueFinalMessage, r.AddSpecialTokens, r.ChatTemplate, r.ChatTemplateKwargs, r.Tools} {
			field(f)
		}
	default:
		var ids []uint32
		var err error
		if prompt, ids, err = completionPrompt(r.Prompt); err != nil {
			return nil, err
		}
		if ids != nil {
			return ids, nil // token ids already
		}
		h.WriteByte('p')
		field([]byte(prompt))
		field(r.AddSpecialTokens)
	}
	key := h.Sum64()
	if ids := t.lookup(key); ids != nil {
		t.hits.Add(1)
		return ids, nil
	}
	var body []byte
	if p.Chat {
		body, _ = json.Marshal(chatTokenize{Model: p.Model, Messages: r.Messages, AddGenerationPrompt: r.AddGenerationPrompt,
			ContinueFinalMessage: r.ContinueFinalMessage, AddSpecialTokens: r.AddSpecialTokens, ChatTemplate: r.ChatTemplate,
			ChatTemplateKwargs: r.ChatTemplateKwargs, Tools: r.Tools})
	} else {
		body, _ = json.Marshal(completionTokenize{Model: p.Model, Prompt: prompt, AddSpecialTokens: r.AddSpecialTokens})
	}
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
		return nil, fmt.Errorf("tokenize on %s: status %d: %.200s", srv, resp.StatusCode, b)
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

func (t *Tokenizer) lookup(key uint64) []uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.cache[key]; e != nil {
		return e.ids
	}
	return nil
}

// store caches ids, evicting the oldest entries (first in, first out)
// past the token budget.
func (t *Tokenizer) store(key uint64, ids []uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(ids) > t.opts.MaxCachedTokens || t.cache[key] != nil {
		return
	}
	for t.cached+len(ids) > t.opts.MaxCachedTokens && t.oldest < len(t.order) {
		old := t.order[t.oldest]
		t.oldest++
		if e := t.cache[old]; e != nil {
			t.cached -= len(e.ids)
			delete(t.cache, old)
		}
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
			t.modelsMu.Lock()
			t.models[srv] = sm
			t.modelsMu.Unlock()
		case sm == nil:
			return "", err
		}
	}
	if sm.adapters[model] {
		return model, nil
	}
	return "", nil
}

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
	sm := &serverModels{adapters: map[string]bool{}, known: map[string]bool{}, fetched: time.Now()}
	for _, m := range list.Data {
		sm.known[m.ID] = true
		if m.Parent != nil && *m.Parent != "" {
			sm.adapters[m.ID] = true
		}
	}
	return sm, nil
}
