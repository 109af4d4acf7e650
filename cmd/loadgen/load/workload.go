package load

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
)

// Seed streams: each concern draws from its own generator so that, e.g.,
// changing the LoRA split does not change the prompt text.
const (
	streamText uint64 = iota + 1
	streamPick
	streamLoRA
	streamArrival
)

func newRand(seed, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, stream))
}

// appendWords appends n words of exactly four lowercase letters, separated
// by single spaces, to b.
func appendWords(b []byte, rng *rand.Rand, n int) []byte {
	for i := range n {
		if i > 0 {
			b = append(b, ' ')
		}
		x := rng.Uint64()
		for range 4 {
			b = append(b, byte('a'+(x&0xffff)%26))
			x >>= 16
		}
	}
	return b
}

func words(rng *rand.Rand, n int) string {
	return string(appendWords(make([]byte, 0, 5*n), rng, n))
}

// message is one OpenAI chat message.
type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// requestBody is the JSON sent to /v1/completions or /v1/chat/completions.
type requestBody struct {
	Model         string         `json:"model"`
	Prompt        string         `json:"prompt,omitempty"`
	Messages      []message      `json:"messages,omitempty"`
	MaxTokens     int            `json:"max_tokens"`
	MinTokens     int            `json:"min_tokens"`
	IgnoreEOS     bool           `json:"ignore_eos"`
	Stream        bool           `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
}

// request is one generated request, ready to send.
type request struct {
	body      []byte
	model     string
	maxTokens int
	sessionID string   // multi-turn only
	session   *session // multi-turn only; the answer is fed back through done
}

type session struct {
	id       string
	messages []message
	sent     int // turns sent so far
	busy     bool
}

// generator produces the seeded request sequence. next is called in one
// well-defined order (the dispatcher, or workers under the generator's
// lock), so the same seed gives the same bodies in the same order.
type generator struct {
	mu   sync.Mutex
	cfg  Config
	text *rand.Rand
	pick *rand.Rand
	lora *rand.Rand

	// shared-prefix; short-long: the long documents (systems)
	systems   []string
	questions [][]string

	// multi-turn
	sessions   []*session
	cursor     int
	sessionSeq int
	idle       chan struct{} // gets a token whenever a session becomes idle
}

func newGenerator(cfg Config) *generator {
	g := &generator{
		cfg:  cfg,
		text: newRand(cfg.Seed, streamText),
		pick: newRand(cfg.Seed, streamPick),
		lora: newRand(cfg.Seed, streamLoRA),
		idle: make(chan struct{}, 1),
	}
	w := cfg.Workload
	switch w.Kind {
	case WorkloadSharedPrefix:
		g.systems = make([]string, w.Groups)
		g.questions = make([][]string, w.Groups)
		for i := range w.Groups {
			g.systems[i] = words(g.text, w.SystemLen)
			g.questions[i] = make([]string, w.UsersPerGroup)
			for u := range w.UsersPerGroup {
				g.questions[i][u] = words(g.text, w.QuestionLen)
			}
		}
	case WorkloadShortLong:
		g.systems = make([]string, w.Groups)
		for i := range w.Groups {
			g.systems[i] = words(g.text, w.SystemLen)
		}
	case WorkloadMultiTurn:
		g.sessions = make([]*session, w.Sessions)
		for i := range g.sessions {
			g.sessions[i] = g.newSession()
		}
	}
	return g
}

func (g *generator) newSession() *session {
	g.sessionSeq++
	s := &session{id: fmt.Sprintf("sess-%06d-%08x", g.sessionSeq, g.text.Uint32())}
	if n := g.cfg.Workload.SystemLen; n > 0 {
		s.messages = append(s.messages, message{Role: "system", Content: words(g.text, n)})
	}
	return s
}

func (g *generator) intn(r Range) int {
	if r.Max <= r.Min {
		return r.Min
	}
	return r.Min + g.pick.IntN(r.Max-r.Min+1)
}

func (g *generator) model() string {
	if len(g.cfg.LoRA) == 0 {
		return g.cfg.Model
	}
	x := g.lora.Float64()
	for _, l := range g.cfg.LoRA {
		if x < l.Fraction {
			return l.Adapter
		}
		x -= l.Fraction
	}
	return g.cfg.Model
}

// next returns the next request, or false when every multi-turn session
// is waiting for its previous answer.
func (g *generator) next() (*request, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	w := g.cfg.Workload
	var msgs []message
	var sess *session
	switch w.Kind {
	case WorkloadSharedPrefix:
		grp := g.pick.IntN(w.Groups)
		user := g.pick.IntN(w.UsersPerGroup)
		msgs = []message{
			{Role: "system", Content: g.systems[grp]},
			{Role: "user", Content: g.questions[grp][user]},
		}
	case WorkloadMultiTurn:
		n := len(g.sessions)
		for i := range n {
			idx := (g.cursor + i) % n
			if !g.sessions[idx].busy {
				g.cursor = (idx + 1) % n
				if g.sessions[idx].sent >= w.Turns {
					g.sessions[idx] = g.newSession()
				}
				sess = g.sessions[idx]
				break
			}
		}
		if sess == nil {
			return nil, false
		}
		sess.messages = append(sess.messages, message{Role: "user", Content: words(g.text, w.QuestionLen)})
		sess.sent++
		sess.busy = true
		msgs = sess.messages
	case WorkloadShortLong:
		if g.pick.Float64() < w.LongFraction {
			msgs = []message{
				{Role: "system", Content: g.systems[g.pick.IntN(w.Groups)]},
				{Role: "user", Content: words(g.text, w.QuestionLen)},
			}
		} else {
			msgs = []message{{Role: "user", Content: words(g.text, g.intn(w.Input))}}
		}
	default: // random
		msgs = []message{{Role: "user", Content: words(g.text, g.intn(w.Input))}}
	}
	out := g.intn(w.Output)
	req := &request{model: g.model(), maxTokens: out, session: sess}
	if sess != nil {
		req.sessionID = sess.id
	}
	rb := requestBody{
		Model:     req.model,
		MaxTokens: out,
		MinTokens: out,
		IgnoreEOS: true,
		Stream:    !g.cfg.NoStream,
	}
	if !g.cfg.NoStream {
		rb.StreamOptions = &streamOptions{IncludeUsage: true}
	}
	if g.cfg.API == APIChat {
		rb.Messages = msgs
	} else {
		rb.Prompt = joinPrompt(msgs)
	}
	body, err := json.Marshal(rb)
	if err != nil {
		// Only strings and numbers are marshalled; this cannot fail.
		panic(fmt.Sprintf("marshal request body: %v", err))
	}
	req.body = body
	return req, true
}

// joinPrompt flattens messages into one completions prompt; the system
// prompt stays an exact prefix.
func joinPrompt(msgs []message) string {
	var b strings.Builder
	for i, m := range msgs {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(m.Content)
	}
	return b.String()
}

// done feeds a finished multi-turn request's answer back into its session.
// An empty answer (failed request, non-text response) is replaced by
// generated text of the requested length so the conversation keeps growing
// as if the model had answered.
func (g *generator) done(req *request, answer string) {
	if req.session == nil {
		return
	}
	g.mu.Lock()
	if strings.TrimSpace(answer) == "" {
		answer = words(g.text, req.maxTokens)
	}
	req.session.messages = append(req.session.messages, message{Role: "assistant", Content: answer})
	req.session.busy = false
	g.mu.Unlock()
	select {
	case g.idle <- struct{}{}:
	default:
	}
}
