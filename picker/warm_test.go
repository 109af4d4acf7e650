package picker

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/registry"
)

// teach fills a picker's memory as traffic would: prefix blocks on two
// endpoints, two sessions, one failing endpoint.
func teach(t *testing.T, s *Server, now time.Time) {
	t.Helper()
	ps := s.snap.Load().pools["alpha"].state
	h := ps.hasher.Load().h
	prompt := strings.Repeat("You are a careful assistant. ", 100)
	ps.index.Add("10.0.0.2:8000", h.Hash(nil, "llama", prompt))
	ps.index.Add("10.0.0.3:8000", h.Hash(nil, "llama", "short "+prompt[:300]))
	ps.sessions.Put("conv-old", "10.0.0.1:8000", now.Add(-time.Minute))
	ps.sessions.Put("conv-new", "10.0.0.3:8000", now)
	s.eh.set(metrics.Key{Pool: "alpha", Address: "10.0.0.1:8000"}, true)
	s.eh.set(metrics.Key{Pool: "alpha", Address: "10.0.0.2:8000"}, false)
}

func TestWarmRoundTrip(t *testing.T) {
	now := time.Now()
	before := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	teach(t, before, now)
	w := before.ExportWarm(now, WarmLimits{})
	if len(w.Prefix) != 2 || len(w.Sessions) != 2 || len(w.Endpoints) != 2 {
		t.Fatalf("export: %d prefix blobs, %d sessions, %d endpoints; want 2, 2, 2", len(w.Prefix), len(w.Sessions), len(w.Endpoints))
	}

	after := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	st, err := after.ImportWarm(w, now)
	if err != nil {
		t.Fatal(err)
	}
	if st.PrefixEndpoints != 2 || st.Sessions != 2 || st.Failing != 1 || st.PrefixBlocks == 0 {
		t.Errorf("import stats %+v", st)
	}
	if got := after.ExportWarm(now, WarmLimits{}); !reflect.DeepEqual(got, w) {
		t.Errorf("memory differs after a round trip:\n got %+v\nwant %+v", got, w)
	}
	// The restored index answers like the old one.
	ps := after.snap.Load().pools["alpha"].state
	hashes := ps.hasher.Load().h.Hash(nil, "llama", strings.Repeat("You are a careful assistant. ", 100))
	hits := ps.index.Match(hashes, nil)
	if len(hits) == 0 || hits[0].Endpoint != "10.0.0.2:8000" {
		t.Errorf("restored index matches %+v, want 10.0.0.2:8000 first", hits)
	}
	if a, ok := ps.sessions.Get("conv-new", now); !ok || a != "10.0.0.3:8000" {
		t.Errorf("restored session conv-new -> %q, %v", a, ok)
	}
	// A failing endpoint stays withheld until it answers a scrape (Run
	// tells the health tracker which endpoints are scraped).
	after.eh.setTargets(metrics.TargetsFromState(testState()))
	if !after.eh.Unhealthy("alpha", "10.0.0.1:8000") {
		t.Error("endpoint failing before the restart is not withheld after it")
	}
}

func TestWarmImportSkipsWhatNoLongerFits(t *testing.T) {
	now := time.Now()
	before := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	teach(t, before, now)
	w := before.ExportWarm(now, WarmLimits{})
	w.Prefix = append(w.Prefix, PrefixBlob{Pool: "alpha", Endpoint: "10.0.0.1:8000", Data: []byte("garbage")})
	w.Sessions = append(w.Sessions, WarmSession{Pool: "alpha", ID: "expired", Endpoint: "10.0.0.2:8000", Expires: now.Add(-time.Second)})

	// 10.0.0.3 left the pool while switchyard was down.
	st := testState()
	st.Pools["alpha"].Endpoints = st.Pools["alpha"].Endpoints[:2]
	after := New(registry.NewPublisher(st), Options{DisableMetrics: true}, nil)
	stats, err := after.ImportWarm(w, now)
	if err == nil || !strings.Contains(err.Error(), "alpha/10.0.0.1:8000") {
		t.Errorf("a corrupt blob must be reported with its endpoint, got %v", err)
	}
	if stats.PrefixEndpoints != 1 || stats.Sessions != 1 {
		t.Errorf("import stats %+v: want only 10.0.0.2's prefix and conv-old (conv-new's endpoint left, the third expired)", stats)
	}
}

func TestWarmExportRespectsLimits(t *testing.T) {
	now := time.Now()
	s := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	teach(t, s, now)
	full := s.ExportWarm(now, WarmLimits{})
	capped := s.ExportWarm(now, WarmLimits{MaxPrefixBlob: 1 << 20, MaxPrefixTotal: 2 * (prefixBlobOverhead + 20 + 8*10)})
	for i, b := range capped.Prefix {
		if len(b.Data) > prefixBlobOverhead+20+8*10 {
			t.Errorf("blob %s is %d bytes, over its share", b.Endpoint, len(b.Data))
		}
		if b.Endpoint == "10.0.0.2:8000" && len(b.Data) >= len(full.Prefix[i].Data) {
			t.Errorf("blob %s was not truncated (%d bytes, uncapped %d)", b.Endpoint, len(b.Data), len(full.Prefix[i].Data))
		}
	}
}

// TestWarmExportReusesUnchangedBlobs: an endpoint whose prefix LRU did not
// change since the last export keeps its blob (the same bytes, not copied
// again); a changed one gets a new blob.
func TestWarmExportReusesUnchangedBlobs(t *testing.T) {
	now := time.Now()
	s := New(registry.NewPublisher(testState()), Options{DisableMetrics: true}, nil)
	teach(t, s, now)
	first := s.ExportWarm(now, WarmLimits{})
	second := s.ExportWarm(now, WarmLimits{})
	if !reflect.DeepEqual(first, second) {
		t.Fatal("two exports of unchanged memory differ")
	}
	for i := range first.Prefix {
		if &first.Prefix[i].Data[0] != &second.Prefix[i].Data[0] {
			t.Errorf("blob of %s encoded again though unchanged", first.Prefix[i].Endpoint)
		}
	}
	ps := s.snap.Load().pools["alpha"].state
	ps.index.Add("10.0.0.3:8000", ps.hasher.Load().h.Hash(nil, "llama", strings.Repeat("another prompt ", 40)))
	third := s.ExportWarm(now, WarmLimits{})
	for i, b := range third.Prefix {
		same := &b.Data[0] == &first.Prefix[i].Data[0]
		if changed := b.Endpoint == "10.0.0.3:8000"; same == changed {
			t.Errorf("%s: blob reused %v, endpoint changed %v", b.Endpoint, same, changed)
		}
	}
	if len(third.Prefix[1].Data) <= len(first.Prefix[1].Data) {
		t.Error("the changed endpoint's blob did not grow")
	}
}
