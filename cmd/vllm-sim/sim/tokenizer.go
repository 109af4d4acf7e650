package sim

import (
	"hash/fnv"
	"strings"
)

// VocabSize is the size of the simulated vocabulary; token ids are in
// [0, VocabSize).
const VocabSize = 128000

// Tokenize turns text into token ids deterministically: the text is split on
// whitespace and every word is cut into pieces of at most four bytes, each
// piece one token whose id is a hash of the piece. Two texts with a common
// word prefix therefore share a token prefix, which is what makes prefix
// caching in the simulator behave like the real thing.
func Tokenize(text string) []uint32 {
	words := strings.Fields(text)
	toks := make([]uint32, 0, len(words)+len(words)/2)
	for _, w := range words {
		for i := 0; i < len(w); i += 4 {
			end := min(i+4, len(w))
			toks = append(toks, pieceID(w[i:end]))
		}
	}
	return toks
}

// CountTokens returns len(Tokenize(text)) without allocating the ids.
func CountTokens(text string) int {
	n := 0
	for _, w := range strings.Fields(text) {
		n += (len(w) + 3) / 4
	}
	return n
}

func pieceID(piece string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(piece))
	return h.Sum32() % VocabSize
}

// Message is one chat message.
type Message struct {
	Role    string
	Content string
}

// RenderChat renders chat messages through the simulator's chat template:
// every message becomes "<|role|> content" on its own line, and the prompt
// ends with the assistant marker. Conversations sharing leading messages
// share a rendered (and so tokenized) prefix.
func RenderChat(msgs []Message) string { return RenderChatPrompt(msgs, true) }

// RenderChatPrompt is RenderChat with the assistant marker (the
// generation prompt) only when addGenerationPrompt is set: a
// conversation rendered without it is a prefix of its continuations.
func RenderChatPrompt(msgs []Message, addGenerationPrompt bool) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|> ")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	if addGenerationPrompt {
		b.WriteString("<|assistant|>")
	}
	return b.String()
}

// fillerWords are what the simulated model "generates", one token each,
// with their leading space. Read-only.
var fillerWords = [...]string{
	" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog",
	" and", " then", " runs", " far", " away", " into", " deep", " wood",
}

// FillerToken returns the text of generated token number i (0-based),
// including its leading space.
func FillerToken(i int) string {
	return fillerWords[i%len(fillerWords)]
}

// fillerID returns the token id of generated token number i.
func fillerID(i int) uint32 {
	return pieceID(fillerWords[i%len(fillerWords)][1:])
}
