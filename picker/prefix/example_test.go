package prefix_test

import (
	"fmt"
	"strings"

	"github.com/switchyard/switchyard/picker/prefix"
)

// A scorer's per-request use: hash the prompt, ask how much of it each
// candidate likely caches, pick, then record the pick.
func Example() {
	h := prefix.NewHasher(prefix.HashConfig{BlockTokens: 16}) // 64-char blocks
	idx := prefix.NewIndex(prefix.Config{})
	idx.SetCapacity("10.0.0.1:8000", 27904) // vLLM num_gpu_blocks, once scraped

	system := strings.Repeat("You are a helpful assistant. ", 10) // 290 chars
	first := h.Hash(nil, "llama", system+"Summarise this report.")
	idx.Add("10.0.0.1:8000", first)

	endpoints := []string{"10.0.0.1:8000", "10.0.0.2:8000"}
	matched := make([]int, len(endpoints))
	second := h.Hash(nil, "llama", system+"Translate this letter.")
	idx.MatchInto(second, endpoints, matched)
	fmt.Println(len(second), "blocks;", matched)
	// Output: 4 blocks; [4 0]
}
