package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/switchyard/switchyard/internal/apikey"
)

func TestKeyNewPrintsKeyAndItsHash(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI(t, "key", "new")
	if code != 0 {
		t.Fatalf("key new: exit %d, %s", code, stderr)
	}
	var key, hash string
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "key":
			key = strings.TrimSpace(v)
		case "hash":
			hash = strings.TrimSpace(v)
		}
	}
	if !strings.HasPrefix(key, apikey.Prefix) || hash != apikey.Hash(key) {
		t.Fatalf("key new printed key %q hash %q:\n%s", key, hash, stdout)
	}
}

func TestKeyHashReadsStdin(t *testing.T) {
	t.Parallel()
	var out, errb bytes.Buffer
	if code := keyCmd([]string{"hash"}, strings.NewReader("sy-example\n"), &out, &errb); code != 0 {
		t.Fatalf("key hash: exit %d, %s", code, errb.String())
	}
	if got := strings.TrimSpace(out.String()); got != apikey.Hash("sy-example") {
		t.Fatalf("key hash printed %q", got)
	}
	out.Reset()
	if code := keyCmd([]string{"hash"}, strings.NewReader(""), &out, &errb); code != 1 {
		t.Fatalf("key hash without input: exit %d", code)
	}
	if code, _, _ := runCLI(t, "key", "nope"); code != 2 {
		t.Fatalf("key nope: exit %d, want 2", code)
	}
}
