package apikey

import (
	"errors"
	"strings"
	"testing"
)

func TestNewKeysAreDistinctAndHashed(t *testing.T) {
	k1, h1, err := New()
	if err != nil {
		t.Fatal(err)
	}
	k2, h2, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if k1 == k2 || h1 == h2 {
		t.Fatalf("two new keys are equal: %q %q", k1, k2)
	}
	if !strings.HasPrefix(k1, Prefix) || len(k1) != len(Prefix)+43 {
		t.Fatalf("key %q: want %q and 43 base64url characters", k1, Prefix)
	}
	if h1 != Hash(k1) {
		t.Fatalf("hash line %q is not Hash(key) %q", h1, Hash(k1))
	}
	d, err := ParseHash(h1)
	if err != nil {
		t.Fatal(err)
	}
	if d != Sum([]byte(k1)) {
		t.Fatal("parsed digest differs from the key's")
	}
}

func TestHashKnownValue(t *testing.T) {
	// sha256("abc"), FIPS 180-2 appendix B.1.
	const want = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
	if got := Hash("abc"); got != want {
		t.Fatalf("Hash(abc) = %s, want %s", got, want)
	}
	up := "  sha256:BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD "
	if got, err := Canonical(up); err != nil || got != want {
		t.Fatalf("Canonical(upper case) = %q, %v", got, err)
	}
}

func TestParseHashErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", "want \"sha256:\""},
		{"md5:abc", "want \"sha256:\""},
		{"sha256:abc", "3 hex digits"},
		{"sha256:" + strings.Repeat("zz", 32), "not hexadecimal"},
		{"sy-abcdef", "this is a key, not its hash"},
	} {
		_, err := ParseHash(tc.in)
		if err == nil || !errors.Is(err, ErrNotHash) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseHash(%q) = %v, want an ErrNotHash containing %q", tc.in, err, tc.want)
		}
	}
	// The error for a pasted key never repeats the key.
	if _, err := ParseHash("sy-secretsecret"); strings.Contains(err.Error(), "secretsecret") {
		t.Errorf("error repeats the key: %v", err)
	}
}

func TestParseFile(t *testing.T) {
	content := "# team-a\n\n" + Hash("one") + "\n  " + Hash("two") + "  \nnot-a-hash\n"
	hashes, errs := ParseFile([]byte(content))
	if len(hashes) != 2 || hashes[0] != Hash("one") || hashes[1] != Hash("two") {
		t.Fatalf("hashes %q", hashes)
	}
	if len(errs) != 1 || errs[0].Line != 5 {
		t.Fatalf("errors %v, want one on line 5", errs)
	}
}
