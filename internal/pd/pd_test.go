package pd

import (
	"errors"
	"reflect"
	"testing"
	"time"
)

func TestSignVerify(t *testing.T) {
	if _, err := NewSigner([]byte("short")); err == nil {
		t.Fatal("NewSigner accepted a 5-byte key")
	}
	s, err := NewSigner([]byte("a-key-of-enough-bytes"))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_800_000_000, 0)
	s.now = func() time.Time { return now }
	other, _ := NewSigner([]byte("another-key-of-enough-bytes"))
	other.now = s.now
	sig := s.Sign("10.0.0.1:8000")
	for _, c := range []struct {
		desc     string
		signer   *Signer
		hostport string
		sig      string
		at       time.Time
		want     error
	}{
		{"valid", s, "10.0.0.1:8000", sig, now, nil},
		{"30 s later", s, "10.0.0.1:8000", sig, now.Add(30 * time.Second), nil},
		{"another server", s, "10.0.0.2:8000", sig, now, ErrBadSignature},
		{"another key", other, "10.0.0.1:8000", sig, now, ErrBadSignature},
		{"none", s, "10.0.0.1:8000", "", now, ErrNoSignature},
		{"garbage", s, "10.0.0.1:8000", "v1.x.y", now, ErrBadSignature},
		{"other version", s, "10.0.0.1:8000", "v2" + sig[2:], now, ErrBadSignature},
		{"too old", s, "10.0.0.1:8000", sig, now.Add(2 * time.Minute), ErrStale},
		{"from the future", s, "10.0.0.1:8000", sig, now.Add(-2 * time.Minute), ErrStale},
	} {
		at := c.at
		c.signer.now = func() time.Time { return at }
		if err := c.signer.Verify(c.hostport, c.sig, time.Minute); !errors.Is(err, c.want) {
			t.Errorf("%s: Verify = %v, want %v", c.desc, err, c.want)
		}
	}
}

func TestPrefillers(t *testing.T) {
	for in, want := range map[string][]string{
		"10.0.0.1:8000":                  {"10.0.0.1:8000"},
		" 10.0.0.1:8000 , 10.0.0.2:8000": {"10.0.0.1:8000", "10.0.0.2:8000"},
		",":                              nil,
		"":                               nil,
	} {
		if got := Prefillers(in); !reflect.DeepEqual(got, want) {
			t.Errorf("Prefillers(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPrefillAndDecodeRequests(t *testing.T) {
	client := map[string]any{"model": "m", "messages": []any{"hi"}, "stream": true,
		"stream_options": map[string]any{"include_usage": true}, "max_tokens": 100,
		"max_completion_tokens": 100, "min_tokens": 5, "temperature": 0.5}
	p := PrefillRequest(client)
	want := map[string]any{"model": "m", "messages": []any{"hi"}, "stream": false, "max_tokens": 1,
		"max_completion_tokens": 1, "temperature": 0.5,
		"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
			"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("PrefillRequest = %v\nwant %v", p, want)
	}
	if _, ok := PrefillRequest(map[string]any{"prompt": "x"})["max_completion_tokens"]; ok {
		t.Error("PrefillRequest added max_completion_tokens to a request without it")
	}
	if client["stream"] != true || client["min_tokens"] != 5 {
		t.Error("PrefillRequest modified the client's request")
	}
	d := DecodeRequest(client, map[string]any{"remote_engine_id": "e"})
	if d["stream"] != true || d["max_tokens"] != 100 || d["min_tokens"] != 5 || d["kv_transfer_params"] == nil {
		t.Errorf("DecodeRequest = %v", d)
	}
	if _, ok := client["kv_transfer_params"]; ok {
		t.Error("DecodeRequest modified the client's request")
	}
}
