package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard/switchyard/cmd/vllm-sim/sim"
	"github.com/switchyard/switchyard/internal/contract"
)

// maxBody caps request bodies.
const maxBody = 16 << 20

// faults configures failure injection; zero values disable each fault.
type faults struct {
	errorRate  float64
	errorCodes []int
	hangAfter  int     // requests after the first hangAfter never get an answer
	hangRate   float64 // fraction of requests that never get an answer
	crashAfter int     // the process exits when request crashAfter+1 arrives
}

// server is the OpenAI-compatible HTTP front of one simulated vLLM.
type server struct {
	eng          *sim.Engine
	log          *slog.Logger
	servedBy     string   // our listen address, sent as x-served-by
	apiKey       string   // required on /v1 when set (vLLM's --api-key)
	served       []string // base model names
	loraEnabled  bool
	defaultMax   int
	eosMean      int
	faults       faults
	pd           pdConfig
	readyAt      time.Time
	quit         chan struct{} // closed when shutdown starts
	exit         func(code int)
	nextID       atomic.Uint64
	inferenceNum atomic.Int64
	// metricsDelay is waited before each /metrics answer; scrapes counts
	// them.
	metricsDelay time.Duration
	scrapes      atomic.Int64

	mu    sync.Mutex
	rng   *rand.Rand
	loras []lora // load order
}

type lora struct{ name, path string }

func (s *server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", s.handleChat)
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("POST /v1/load_lora_adapter", s.handleLoadLoRA)
	mux.HandleFunc("POST /v1/unload_lora_adapter", s.handleUnloadLoRA)
	mux.HandleFunc("GET /health", s.handleHealth)
	mux.HandleFunc("GET /metrics", s.handleMetrics)
	if s.pd.enabled {
		mux.HandleFunc("POST "+kvPullPath, s.handlePull)
	}
	mux.HandleFunc("POST /tokenize", s.handleTokenize)
	mux.HandleFunc("POST /reset_prefix_cache", s.handleResetPrefixCache)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("x-served-by", s.servedBy)
		// Echo the picker's destination list, so tests can check that
		// the server that answered is the one the picker chose.
		if d := r.Header.Get(contract.DestinationHeader); d != "" {
			w.Header().Set("x-destination-seen", d)
		}
		if time.Now().Before(s.readyAt) {
			writeError(w, http.StatusServiceUnavailable, "server is starting up")
			return
		}
		if s.apiKey != "" && strings.HasPrefix(r.URL.Path, "/v1") && r.Header.Get("Authorization") != "Bearer "+s.apiKey {
			// vLLM's answer, shape included.
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"error":"Unauthorized"}`))
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// handleTokenize is vLLM's POST /tokenize: the token ids a completion
// prompt or a chat conversation becomes, exactly as generate computes
// them.
func (s *server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req genRequest
	if !decodeBody(w, r, &req) {
		return
	}
	modelName := req.Model
	if modelName == "" {
		modelName = s.served[0]
	}
	if _, ok := s.resolveModel(modelName); !ok {
		writeErrorParam(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", modelName), "model")
		return
	}
	toks, err := s.promptTokens(&req, req.Messages != nil)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if toks == nil {
		toks = []uint32{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(toks), "max_model_len": s.eng.Config().MaxModelLen, "tokens": toks, "token_strs": nil})
}

// handleResetPrefixCache is vLLM's dev-mode POST /reset_prefix_cache.
func (s *server) handleResetPrefixCache(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]bool{"success": s.eng.ResetPrefixCache()})
}

func (s *server) handleHealth(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusOK)
}

func (s *server) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	s.scrapes.Add(1)
	if s.metricsDelay > 0 {
		// A stand-in for the time real vLLM's API server spends making its
		// page (CPU there; a wait here, so a fleet costs nothing).
		time.Sleep(s.metricsDelay)
	}
	page := s.eng.MetricsPage()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(page)))
	_, _ = w.Write(page)
}

func (s *server) handleModels(w http.ResponseWriter, _ *http.Request) {
	type modelCard struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen *int    `json:"max_model_len"` // null for adapters, as vLLM sends
		Permission  []any   `json:"permission"`
	}
	now := time.Now().Unix()
	base := s.served[0]
	maxLen := s.eng.Config().MaxModelLen
	perm := func(id string) []any {
		return []any{map[string]any{"id": "modelperm-" + id, "object": "model_permission", "created": now,
			"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false,
			"allow_view": true, "allow_fine_tuning": false, "organization": "*", "group": nil, "is_blocking": false}}
	}
	var cards []modelCard
	for _, name := range s.served {
		cards = append(cards, modelCard{ID: name, Object: "model", Created: now, OwnedBy: "vllm", Root: base, MaxModelLen: &maxLen, Permission: perm(name)})
	}
	s.mu.Lock()
	for _, l := range s.loras {
		cards = append(cards, modelCard{ID: l.name, Object: "model", Created: now, OwnedBy: "vllm", Root: l.path, Parent: &base, Permission: perm(l.name)})
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": cards})
}

type loraRequest struct {
	Name string `json:"lora_name"`
	Path string `json:"lora_path"`
}

func (s *server) handleLoadLoRA(w http.ResponseWriter, r *http.Request) {
	var req loraRequest
	if !decodeBody(w, r, &req) {
		return
	}
	switch {
	case !s.loraEnabled:
		writeError(w, http.StatusBadRequest, "LoRA is not enabled; start the server with -enable-lora or -lora-modules")
		return
	case req.Name == "":
		writeError(w, http.StatusBadRequest, "lora_name must be set")
		return
	case slices.Contains(s.served, req.Name):
		writeError(w, http.StatusBadRequest, fmt.Sprintf("%q is a base model name", req.Name))
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.ContainsFunc(s.loras, func(l lora) bool { return l.name == req.Name }) {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("The lora adapter '%s' has already been loaded.", req.Name))
		return
	}
	s.loras = append(s.loras, lora{name: req.Name, path: req.Path})
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
}

func (s *server) handleUnloadLoRA(w http.ResponseWriter, r *http.Request) {
	var req loraRequest
	if !decodeBody(w, r, &req) {
		return
	}
	if req.Name == "" {
		writeError(w, http.StatusBadRequest, "lora_name must be set")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	i := slices.IndexFunc(s.loras, func(l lora) bool { return l.name == req.Name })
	if i < 0 {
		writeError(w, http.StatusNotFound, fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name))
		return
	}
	s.loras = slices.Delete(s.loras, i, i+1)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", req.Name)
}

// resolveModel maps a request's model to the adapter to run ("" = base);
// ok is false for an unknown model.
func (s *server) resolveModel(name string) (adapter string, ok bool) {
	if slices.Contains(s.served, name) {
		return "", true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.ContainsFunc(s.loras, func(l lora) bool { return l.name == name }) {
		return name, true
	}
	return "", false
}

// genRequest is the union of the completion and chat request fields we use.
type genRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []chatMessage   `json:"messages"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	MinTokens           int             `json:"min_tokens"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	N                   *int            `json:"n"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	KVTransferParams *kvParams `json:"kv_transfer_params"`
	// AddGenerationPrompt (chat; default true) ends the rendered
	// conversation with the assistant marker.
	AddGenerationPrompt *bool `json:"add_generation_prompt"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

func (s *server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	s.generate(w, r, false)
}

func (s *server) handleChat(w http.ResponseWriter, r *http.Request) {
	s.generate(w, r, true)
}

// injectFault applies the failure flags to an inference request; true means
// the request has been dealt with.
func (s *server) injectFault(w http.ResponseWriter, r *http.Request) bool {
	n := s.inferenceNum.Add(1)
	f := s.faults
	if f.crashAfter > 0 && n > int64(f.crashAfter) {
		s.log.Error("crash-after reached, exiting", "requests", n-1)
		s.exit(3)
	}
	s.mu.Lock()
	hang := (f.hangAfter > 0 && n > int64(f.hangAfter)) || (f.hangRate > 0 && s.rng.Float64() < f.hangRate)
	fail := 0
	if !hang && f.errorRate > 0 && s.rng.Float64() < f.errorRate {
		fail = f.errorCodes[s.rng.IntN(len(f.errorCodes))]
	}
	s.mu.Unlock()
	if hang {
		s.log.Debug("injected hang", "request", n)
		select {
		case <-r.Context().Done():
		case <-s.quit:
		}
		panic(http.ErrAbortHandler) // drop the connection without an answer
	}
	if fail != 0 {
		writeError(w, fail, "injected failure")
		return true
	}
	return false
}

func (s *server) generate(w http.ResponseWriter, r *http.Request, chat bool) {
	if s.injectFault(w, r) {
		return
	}
	var req genRequest
	if !decodeBody(w, r, &req) {
		return
	}
	modelName := req.Model
	if modelName == "" {
		modelName = s.served[0]
	}
	adapter, ok := s.resolveModel(modelName)
	if !ok {
		writeErrorParam(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", modelName), "model")
		return
	}
	if req.N != nil && *req.N != 1 {
		writeError(w, http.StatusBadRequest, "vllm-sim supports only n=1")
		return
	}
	toks, err := s.promptTokens(&req, chat)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	maxTokens := s.defaultMax
	if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
	}
	if chat && req.MaxCompletionTokens != nil {
		maxTokens = *req.MaxCompletionTokens
	}
	if maxTokens < 1 {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("max_tokens must be at least 1, got %d", maxTokens))
		return
	}
	if req.MinTokens < 0 || req.MinTokens > maxTokens {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("min_tokens must be between 0 and max_tokens (%d), got %d", maxTokens, req.MinTokens))
		return
	}
	stopAfter := 0
	if s.eosMean > 0 && !req.IgnoreEOS {
		stopAfter = max(naturalLength(toks, s.eosMean), req.MinTokens)
	}
	rs := response{id: s.newID(chat), model: modelName, created: time.Now().Unix(), chat: chat}
	simReq := sim.Request{Prompt: toks, MaxTokens: maxTokens, StopAfter: stopAfter, LoRA: adapter, RemoteCached: -1}
	if kv := req.KVTransferParams; s.pd.enabled && kv != nil {
		switch {
		case kv.DoRemoteDecode:
			simReq.HoldKV = rs.id
		case kv.DoRemotePrefill:
			n, err := s.pd.pullRemote(r.Context(), kv)
			if err != nil && !s.pd.recompute {
				s.log.Warn("remote KV load failed; failing the request (kv_load_failure_policy fail)", "err", err)
				writeKVLoadError(w, req.Stream)
				return
			}
			if err != nil {
				s.log.Warn("remote KV load failed; recomputing the prompt (kv_load_failure_policy recompute)", "err", err)
				break
			}
			simReq.RemoteTokens = min(n, len(toks))
			if kv.RemotePrefillCachedTokens != nil {
				simReq.RemoteCached = *kv.RemotePrefillCachedTokens
			}
		}
	}
	h, err := s.eng.Submit(r.Context(), simReq)
	if errors.Is(err, sim.ErrInvalidRequest) {
		msg := strings.TrimPrefix(err.Error(), sim.ErrInvalidRequest.Error()+": ")
		param := ""
		if strings.Contains(msg, "maximum context length") {
			param = "input_tokens" // vLLM names the field that overflowed
		}
		writeErrorParam(w, http.StatusBadRequest, "BadRequestError", msg, param)
		return
	}
	if err != nil {
		return // client went away during the frontend latency
	}
	defer h.Cancel() // no-op once finished; frees the request if the client left

	if req.Stream {
		includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
		s.stream(w, r, h, rs, includeUsage)
		return
	}
	var out strings.Builder
	for {
		select {
		case ev := <-h.Events:
			out.WriteString(ev.Text)
			if ev.Done {
				body := rs.full(out.String(), ev)
				if simReq.HoldKV != "" {
					body["kv_transfer_params"] = s.pd.prefillParams(rs.id, ev)
				}
				writeJSON(w, http.StatusOK, body)
				return
			}
		case <-r.Context().Done():
			return
		}
	}
}

// promptTokens is the token ids of a request's prompt: the rendered
// conversation's, or the completion prompt's.
func (s *server) promptTokens(req *genRequest, chat bool) ([]uint32, error) {
	var text string
	var toks []uint32
	var err error
	if chat {
		text, err = renderMessages(req.Messages, req.AddGenerationPrompt == nil || *req.AddGenerationPrompt)
	} else {
		text, toks, err = parsePrompt(req.Prompt)
	}
	if err != nil {
		return nil, err
	}
	if toks == nil {
		toks = sim.Tokenize(text)
	}
	return toks, nil
}

func (s *server) stream(w http.ResponseWriter, r *http.Request, h *sim.Handle, rs response, includeUsage bool) {
	flusher, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	send := func(v any) bool {
		b, err := json.Marshal(v)
		if err != nil {
			return false
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	first := true
	for {
		select {
		case ev := <-h.Events:
			// As vLLM: the chat role chunk goes out with the first token
			// (vLLM sends it on the first output of its engine), so the
			// first body bytes mark the time to first token.
			if first && rs.chat && !send(rs.chunk(map[string]any{"role": "assistant", "content": ""}, nil)) {
				return
			}
			first = false
			var delta any = map[string]any{"content": ev.Text}
			if !rs.chat {
				delta = ev.Text
			}
			var reason any
			if ev.Done {
				reason = ev.FinishReason
			}
			if !send(rs.chunk(delta, reason)) {
				return
			}
			if !ev.Done {
				continue
			}
			if includeUsage && !send(rs.usageChunk(ev.Usage)) {
				return
			}
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
			if flusher != nil {
				flusher.Flush()
			}
			return
		case <-r.Context().Done():
			return
		}
	}
}

func (s *server) newID(chat bool) string {
	prefix := "cmpl-"
	if chat {
		prefix = "chatcmpl-"
	}
	return fmt.Sprintf("%s%016x", prefix, s.nextID.Add(1))
}

// naturalLength is where the simulated model would emit EOS for a prompt:
// deterministic, uniform in [1, 2*mean-1].
func naturalLength(toks []uint32, mean int) int {
	h := fnv.New32a()
	var b [4]byte
	for _, t := range toks {
		b[0], b[1], b[2], b[3] = byte(t), byte(t>>8), byte(t>>16), byte(t>>24)
		_, _ = h.Write(b[:])
	}
	return 1 + int(h.Sum32()%uint32(2*mean-1))
}

// parsePrompt accepts a string, a one-element string array, a token id
// array, or a one-element array of token id arrays.
func parsePrompt(raw json.RawMessage) (string, []uint32, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil, errors.New("prompt is required")
	}
	var str string
	if json.Unmarshal(raw, &str) == nil {
		return str, nil, nil
	}
	var strs []string
	if json.Unmarshal(raw, &strs) == nil {
		if len(strs) != 1 {
			return "", nil, fmt.Errorf("vllm-sim supports one prompt per request, got %d", len(strs))
		}
		return strs[0], nil, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil {
		return "", ids, nil
	}
	var idss [][]uint32
	if json.Unmarshal(raw, &idss) == nil && len(idss) == 1 {
		return "", idss[0], nil
	}
	return "", nil, errors.New("prompt must be a string, a list with one string, or a list of token ids")
}

// renderMessages applies the chat template; content may be a string or a
// list of {"type":"text","text":...} parts.
func renderMessages(msgs []chatMessage, addGenerationPrompt bool) (string, error) {
	if len(msgs) == 0 {
		return "", errors.New("messages must not be empty")
	}
	out := make([]sim.Message, 0, len(msgs))
	for i, m := range msgs {
		if m.Role == "" {
			return "", fmt.Errorf("messages[%d].role is required", i)
		}
		var content string
		if len(m.Content) > 0 && string(m.Content) != "null" {
			if err := json.Unmarshal(m.Content, &content); err != nil {
				var parts []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				}
				if err := json.Unmarshal(m.Content, &parts); err != nil {
					return "", fmt.Errorf("messages[%d].content must be a string or a list of parts", i)
				}
				var texts []string
				for _, p := range parts {
					if p.Type == "text" {
						texts = append(texts, p.Text)
					}
				}
				content = strings.Join(texts, " ")
			}
		}
		out = append(out, sim.Message{Role: m.Role, Content: content})
	}
	return sim.RenderChatPrompt(out, addGenerationPrompt), nil
}

// response builds the JSON bodies of one request's answer.
type response struct {
	id      string
	model   string
	created int64
	chat    bool
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
		// vLLM 0.32 sends created_cache_tokens as a number on chat and as
		// null on completions; absent here stands for null.
		CreatedCacheTokens *int `json:"created_cache_tokens,omitempty"`
	} `json:"prompt_tokens_details"`
}

// systemFingerprint mirrors vLLM's "vllm-<version>-<hash>".
const systemFingerprint = "vllm-0.32.0-vllmsim"

func toUsage(u sim.Usage, chat bool) usageJSON {
	out := usageJSON{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.PromptTokens + u.CompletionTokens}
	out.PromptTokensDetails.CachedTokens = u.CachedTokens
	if chat {
		zero := 0 // tokens written to an external KV store; none here
		out.PromptTokensDetails.CreatedCacheTokens = &zero
	}
	return out
}

func (rs response) object(chunk bool) string {
	switch {
	case rs.chat && chunk:
		return "chat.completion.chunk"
	case rs.chat:
		return "chat.completion"
	default:
		return "text_completion"
	}
}

func (rs response) full(text string, last sim.Event) map[string]any {
	choice := map[string]any{"index": 0, "logprobs": nil, "finish_reason": last.FinishReason, "stop_reason": nil}
	if rs.chat {
		choice["message"] = map[string]any{"role": "assistant", "content": text}
	} else {
		choice["text"] = text
	}
	return map[string]any{
		"id": rs.id, "object": rs.object(false), "created": rs.created, "model": rs.model,
		"choices": []any{choice}, "usage": toUsage(last.Usage, rs.chat), "system_fingerprint": systemFingerprint,
	}
}

func (rs response) chunk(delta any, finishReason any) map[string]any {
	choice := map[string]any{"index": 0, "logprobs": nil, "finish_reason": finishReason}
	if rs.chat {
		choice["delta"] = delta
	} else {
		choice["text"] = delta
	}
	return map[string]any{"id": rs.id, "object": rs.object(true), "created": rs.created, "model": rs.model, "choices": []any{choice}}
}

func (rs response) usageChunk(u sim.Usage) map[string]any {
	return map[string]any{"id": rs.id, "object": rs.object(true), "created": rs.created, "model": rs.model,
		"choices": []any{}, "usage": toUsage(u, rs.chat), "system_fingerprint": systemFingerprint}
}

func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody))
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "request body too large")
			return false
		}
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return false
	}
	return true
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(b)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	typ := map[int]string{
		http.StatusBadRequest:            "BadRequestError",
		http.StatusNotFound:              "NotFoundError",
		http.StatusRequestEntityTooLarge: "BadRequestError",
		http.StatusTooManyRequests:       "RateLimitError",
		http.StatusServiceUnavailable:    "ServiceUnavailableError",
	}[code]
	if typ == "" {
		typ = "InternalServerError"
	}
	writeErrorType(w, code, typ, msg)
}

func writeErrorType(w http.ResponseWriter, code int, typ, msg string) {
	writeErrorParam(w, code, typ, msg, "")
}

// writeErrorParam writes vLLM's error shape; param names the offending
// request field as vLLM does ("model", "input_tokens"), or is null.
func writeErrorParam(w http.ResponseWriter, code int, typ, msg, param string) {
	var p any
	if param != "" {
		p = param
	}
	writeJSON(w, code, map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": p, "code": code}})
}
