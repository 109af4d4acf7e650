package picker

import (
	"bytes"
	"unsafe"
)

// promptText returns the part of a JSON request body that carries the
// prompt, the raw value of its top-level "messages" (chat) or "prompt"
// (completions) key, for prefix hashing: requests that share a system
// prompt share a prefix of these bytes whatever order the client wrote the
// other fields in. Without either key it returns the whole body. The
// result aliases body (no copy; body must not change while it is used).
func promptText(body []byte) string {
	lo, hi := promptSpan(body)
	if hi <= lo {
		return ""
	}
	return unsafe.String(&body[lo], hi-lo)
}

// promptSpan finds the value of the top-level "messages" or "prompt" key
// in an already validated JSON object; (0, len(body)) if there is none.
func promptSpan(body []byte) (int, int) {
	i := skipWS(body, 0)
	if i >= len(body) || body[i] != '{' {
		return 0, len(body)
	}
	i++
	for {
		i = skipWS(body, i)
		if i >= len(body) || body[i] != '"' {
			return 0, len(body)
		}
		kEnd := skipString(body, i)
		key := body[i+1 : max(kEnd-1, i+1)]
		i = skipWS(body, kEnd)
		if i >= len(body) || body[i] != ':' {
			return 0, len(body)
		}
		i = skipWS(body, i+1)
		vEnd := skipValue(body, i)
		if vEnd <= i {
			return 0, len(body)
		}
		if string(key) == "messages" || string(key) == "prompt" {
			return i, vEnd
		}
		i = skipWS(body, vEnd)
		if i >= len(body) || body[i] != ',' {
			return 0, len(body)
		}
		i++
	}
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index after the string starting at b[i] == '"'.
// It jumps from quote to quote (bytes.IndexByte is vectorised), and a quote
// ends the string when an even number of backslashes precedes it.
func skipString(b []byte, i int) int {
	for j := i + 1; j < len(b); {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b)
		}
		q := j + k
		n := 0
		for p := q - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
	return len(b)
}

// skipValue returns the index after the JSON value starting at b[i].
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = skipString(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	default: // number, true, false, null
		j := i
		for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\n' && b[j] != '\t' && b[j] != '\r' {
			j++
		}
		return j
	}
}
