package tenant

import (
	"bytes"
	"testing"
)

// FuzzCredentials feeds arbitrary Authorization and x-api-key values to
// the parser: it must never panic, and a key it returns is non-empty,
// bounded, free of white space, and is the token the headers carry.
func FuzzCredentials(f *testing.F) {
	for _, s := range [][2]string{
		{"Bearer sy-abc", ""}, {"bearer\tk", "k"}, {"Basic x", ""}, {"", "k"}, {"Bearer", ""}, {"Bearer a b", ""},
		{"BEARER " + string(bytes.Repeat([]byte("x"), 2000)), ""}, {"Bearer \x00\xff", "\x00\xff"},
	} {
		f.Add(s[0], s[1], true, s[1] != "")
	}
	f.Fuzz(func(t *testing.T, auth, apiKey string, hasAuth, hasAPIKey bool) {
		var c Credentials
		if hasAuth {
			c.Add("authorization", []byte(auth))
		}
		if hasAPIKey {
			c.Add("x-api-key", []byte(apiKey))
		}
		key, err := c.Key()
		if err != nil {
			if key != nil {
				t.Fatalf("error %v with key %q", err, key)
			}
			return
		}
		if len(key) == 0 || len(key) > MaxKeyBytes || bytes.ContainsAny(key, " \t\r\n") {
			t.Fatalf("bad key %q from %q / %q", key, auth, apiKey)
		}
		inAuth := hasAuth && bytes.HasSuffix(bytes.TrimRight([]byte(auth), " \t"), key)
		inAPIKey := hasAPIKey && bytes.Equal(bytes.Trim([]byte(apiKey), " \t"), key)
		if !inAuth && !inAPIKey {
			t.Fatalf("key %q is in neither header (%q / %q)", key, auth, apiKey)
		}
		if hasAuth && hasAPIKey && !(inAuth && inAPIKey) {
			t.Fatalf("two headers, key %q taken from one only (%q / %q)", key, auth, apiKey)
		}
	})
}
