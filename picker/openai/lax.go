package openai

import (
	"math"
	"strconv"
	"strings"
	"unsafe"
)

// vLLM's OpenAI server (and SGLang's, and TensorRT-LLM's) validates request
// bodies with pydantic in its default lax mode, which accepts more than
// JSON's own types: "stream": 1 or "yes" streams, "max_tokens": "5" or 5.0
// caps the output at 5. The picker must read the fields it accounts for
// exactly as the engine does, or a client could stream without the usage
// chunk being asked for, or run uncapped while the picker reserved a cap.
// laxBool and laxInt follow pydantic-core's rules for JSON input (its
// str_as_bool, str_as_int with clean_int_str, float_as_int, int_as_bool),
// checked against vLLM 0.32 (pydantic 2.14, pydantic-core 2.50).

// maxLaxInt bounds the integers laxInt returns: larger values (pydantic
// accepts them as Python ints) mean "unbounded" for every use here, and
// the bound keeps products of them far from overflowing.
const maxLaxInt = 1 << 40

// laxBool reads a raw JSON value as pydantic reads a bool field: true and
// false; the numbers 0 and 1 (1.0 too: an integral float); the strings
// "0", "1" and, in any ASCII case, "f", "n", "no", "off", "false", "t",
// "y", "on", "yes", "true" (no surrounding space). null is the field's
// None, which the engine treats as false. ok is false for anything else
// (the engine rejects the request).
func laxBool(v []byte) (val, ok bool) {
	if len(v) == 0 {
		return false, false
	}
	switch v[0] {
	case 't':
		return true, string(v) == "true"
	case 'f':
		return false, string(v) == "false"
	case 'n':
		return false, string(v) == "null"
	case '"':
		s, ok := jsonString(v)
		if !ok {
			return false, false
		}
		switch {
		case s == "0" || asciiFoldIn(s, "f", "n", "no", "off", "false"):
			return false, true
		case s == "1" || asciiFoldIn(s, "t", "y", "on", "yes", "true"):
			return true, true
		}
		return false, false
	case '{', '[':
		return false, false
	}
	f, err := strconv.ParseFloat(unsafe.String(&v[0], len(v)), 64)
	switch {
	case err != nil:
		return false, false
	case f == 0:
		return false, true
	case f == 1:
		return true, true
	}
	return false, false
}

// laxInt reads a raw JSON value as pydantic reads an int field: an integer;
// a float with no fractional part (5.0, 1e3); true and false (1 and 0); a
// string holding a decimal integer, with surrounding whitespace, a leading
// + or -, leading zeros, a fractional part of only zeros ("5.00") and
// single underscores between digits allowed ("1_000"), but no exponent.
// Values beyond maxLaxInt are clamped to it (and to -maxLaxInt). present
// is false for null (the field's None) and for anything the engine
// rejects (ok false).
func laxInt(v []byte) (n int64, present, ok bool) {
	if len(v) == 0 {
		return 0, false, false
	}
	switch v[0] {
	case 'n':
		return 0, false, string(v) == "null"
	case 't':
		return 1, true, string(v) == "true"
	case 'f':
		return 0, true, string(v) == "false"
	case '"':
		s, ok := jsonString(v)
		if !ok {
			return 0, false, false
		}
		n, ok := laxIntString(s)
		return n, ok, ok
	case '{', '[':
		return 0, false, false
	}
	s := unsafe.String(&v[0], len(v))
	if n, ok := decimalInt(s); ok {
		return n, true, true
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) || f != math.Trunc(f) {
		return 0, false, false
	}
	if f > -9.223372036854775808e18 && f < 9.223372036854775807e18 {
		return clampLax(int64(f)), true, true
	}
	return 0, false, false // pydantic: too large for an int from a float
}

// laxIntString is pydantic-core's str_as_int: the string as a JSON
// integer, else cleaned (clean_int_str) and tried again.
func laxIntString(s string) (int64, bool) {
	if n, ok := decimalInt(s); ok {
		return n, true
	}
	s = strings.TrimSpace(s) // Rust's str::trim: Unicode White_Space
	if rest, ok := strings.CutPrefix(s, "+"); ok {
		if strings.HasPrefix(rest, "-") {
			return 0, false
		}
		s = rest
	}
	neg := false
	if rest, ok := strings.CutPrefix(s, "-"); ok {
		if strings.HasPrefix(rest, "-") || strings.HasPrefix(rest, "+") {
			return 0, false
		}
		neg, s = true, rest
	}
	s, ok := stripLeadingZeros(s)
	if !ok {
		return 0, false
	}
	if i := strings.IndexByte(s, '.'); i >= 0 {
		if dec := s[i+1:]; dec != "" && strings.Trim(dec, "0") == "" {
			s = s[:i]
		}
	}
	if !strings.HasPrefix(s, "_") && !strings.HasSuffix(s, "_") && !strings.Contains(s, "__") {
		s = strings.ReplaceAll(s, "_", "")
	}
	if neg {
		s = "-" + s // "-0-5" stays invalid, as in pydantic
	}
	return decimalInt(s)
}

// stripLeadingZeros is pydantic-core's strip_leading_zeros: leading zeros
// (and underscores among them) go, one zero stays before a '.' or when
// the string is only zeros; a string starting with anything but a digit
// or '-' is rejected.
func stripLeadingZeros(s string) (string, bool) {
	if s == "" {
		return "", false
	}
	switch c := s[0]; {
	case c == '0':
	case c >= '1' && c <= '9' || c == '-':
		return s, true
	default:
		return "", false
	}
	for i := 1; i < len(s); i++ {
		switch c := s[i]; {
		case c == '0' || c == '_':
		case c >= '1' && c <= '9' || c == '-':
			return s[i:], true
		case c == '.':
			return s[i-1:], true
		default:
			return "", false
		}
	}
	return s[len(s)-1:], true
}

// decimalInt parses -?[0-9]+ (JSON's integer, leading zeros allowed: the
// cleaned strings have none left), clamped to maxLaxInt.
func decimalInt(s string) (int64, bool) {
	neg := strings.HasPrefix(s, "-")
	if neg {
		s = s[1:]
	}
	if s == "" {
		return 0, false
	}
	var n int64
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		if n < maxLaxInt {
			n = n*10 + int64(c-'0')
		}
	}
	n = min(n, maxLaxInt)
	if neg {
		n = -n
	}
	return n, true
}

func clampLax(n int64) int64 { return min(max(n, -maxLaxInt), maxLaxInt) }

// jsonString returns the value of a raw JSON string token; without
// escapes it aliases the token (no copy).
func jsonString(tok []byte) (string, bool) {
	if len(tok) < 2 || tok[0] != '"' || tok[len(tok)-1] != '"' {
		return "", false
	}
	if !NeedsDecode(tok) {
		return unsafe.String(unsafe.SliceData(tok[1:]), len(tok)-2), true
	}
	s := DecodeString(tok)
	return s, s != "" || len(tok) == 2
}

// asciiFoldIn reports whether s equals one of words ignoring ASCII case
// only (as Rust's eq_ignore_ascii_case: "ſ" is not "s" here).
func asciiFoldIn(s string, words ...string) bool {
	for _, w := range words {
		if len(s) != len(w) {
			continue
		}
		eq := true
		for i := 0; i < len(s); i++ {
			c := s[i]
			if c >= 'A' && c <= 'Z' {
				c += 'a' - 'A'
			}
			if c != w[i] {
				eq = false
				break
			}
		}
		if eq {
			return true
		}
	}
	return false
}
