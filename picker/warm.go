package picker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/prefix"
	"github.com/switchyard/switchyard/picker/sched"
)

// Warm is the scheduling memory that makes a restart warm: what the picker
// believes each server holds in its prefix cache, which endpoint each
// session last used, and each endpoint's health and last scraped load. The
// picker fills it (ExportWarm) and reads it back (ImportWarm); where it is
// kept is the caller's business (switchyard serve uses the bbolt store).
type Warm struct {
	// Prefix holds one opaque blob per endpoint (EncodePrefix format).
	Prefix []PrefixBlob
	// Sessions are the unexpired session-affinity entries, by pool, each
	// pool's most recently used first.
	Sessions []WarmSession
	// Endpoints are the health and last metrics of every scraped endpoint.
	Endpoints []WarmEndpoint
}

// PrefixBlob is one endpoint's prefix-cache entries, encoded. Data may be
// shared with earlier and later exports: do not modify it.
type PrefixBlob struct {
	Pool, Endpoint string
	Data           []byte
}

// WarmSession is one session-affinity entry.
type WarmSession struct {
	Pool, ID, Endpoint string
	Expires            time.Time
}

// WarmEndpoint is an endpoint's health as the picker last judged it and
// its last successfully scraped load.
type WarmEndpoint struct {
	Pool, Endpoint string
	// Failing: the endpoint's scrapes were failing. Known is false when it
	// had not been scraped yet (neither healthy nor failing).
	Failing, Known bool
	Waiting        int
	Running        int
	KVUsage        float64
	ScrapedAt      time.Time // zero if never scraped successfully
}

// WarmLimits bound the prefix blobs ExportWarm produces (0: no bound).
type WarmLimits struct {
	// MaxPrefixBlob caps one endpoint's blob, MaxPrefixTotal all of them
	// (each endpoint then gets an equal share). The most recently used
	// blocks are kept.
	MaxPrefixBlob, MaxPrefixTotal int
}

// ExportWarm copies the picker's scheduling memory. It is safe to call
// while requests are served; each endpoint is copied consistently, the
// whole is not. Requests never wait for the export beyond the memmove of
// one endpoint's prefix LRU (see prefix.Index.ExportEndpoint), and the
// export yields the processor between endpoints, so on a small machine it
// does not hold a CPU that requests need. An endpoint whose prefix LRU has
// not changed since the previous export is not copied or encoded again:
// its blob is the previous one (shared; read only). Exports are
// serialised.
func (s *Server) ExportWarm(now time.Time, lim WarmLimits) Warm {
	var w Warm
	s.loads.mu.Lock()
	pools := maps.Clone(s.loads.pools)
	s.loads.mu.Unlock()

	wc := &s.warm
	wc.mu.Lock()
	defer wc.mu.Unlock()
	if wc.blobs == nil {
		wc.blobs = map[loadKey]warmBlob{}
	}
	names := make(map[string][]string, len(pools))
	endpoints := 0
	for pool, ps := range pools {
		names[pool] = ps.index.Endpoints()
		endpoints += len(names[pool])
	}
	maxPrefixBytes := lim.MaxPrefixBlob
	if lim.MaxPrefixTotal > 0 && endpoints > 0 {
		share := lim.MaxPrefixTotal / endpoints
		if maxPrefixBytes <= 0 || share < maxPrefixBytes {
			maxPrefixBytes = share
		}
	}
	seen := make(map[loadKey]bool, endpoints)
	for _, pool := range slices.Sorted(maps.Keys(pools)) {
		ps := pools[pool]
		// One hasher per pool for both the hashes' fingerprint and the
		// blobs' block size, so a block-size change meanwhile cannot pair
		// one with the other.
		h := ps.hasher.Load()
		fp := h.h.Fingerprint()
		for _, name := range names[pool] {
			limit := 0 // every hash
			if maxPrefixBytes > 0 {
				if limit = (maxPrefixBytes - prefixBlobOverhead - len(name)) / 8; limit <= 0 {
					continue
				}
			}
			k := loadKey{pool, name}
			version, known := ps.index.Version(name)
			if !known {
				continue
			}
			want := warmBlob{index: ps.index, version: version, fingerprint: fp, blockTokens: h.blockTokens, limit: limit}
			b, ok := wc.blobs[k]
			if !ok || !b.sameSource(want) {
				e, v, known := ps.index.ExportEndpoint(name, limit, wc.hashes[:0], &wc.scratch)
				if !known {
					continue
				}
				wc.hashes = e.Hashes[:0]
				b, b.version = want, v
				if len(e.Hashes) > 0 {
					b.data = encodePrefix(h.blockTokens, prefix.Dump{Fingerprint: fp, Endpoints: []prefix.EndpointDump{e}})
				}
				wc.blobs[k] = b
				runtime.Gosched()
			}
			seen[k] = true
			if b.data != nil {
				w.Prefix = append(w.Prefix, PrefixBlob{Pool: pool, Endpoint: name, Data: b.data})
			}
		}
		sessions := ps.sessions.Export(now)
		w.Sessions = slices.Grow(w.Sessions, len(sessions))
		for _, se := range sessions {
			w.Sessions = append(w.Sessions, WarmSession{Pool: pool, ID: se.Key, Endpoint: se.Addr, Expires: se.Expires})
		}
	}
	maps.DeleteFunc(wc.blobs, func(k loadKey, _ warmBlob) bool { return !seen[k] })
	sort.Slice(w.Prefix, func(i, j int) bool {
		a, b := w.Prefix[i], w.Prefix[j]
		return a.Pool < b.Pool || a.Pool == b.Pool && a.Endpoint < b.Endpoint
	})

	known := s.eh.knownStates()
	for _, pv := range s.snap.Load().pools {
		for _, e := range pv.eps {
			k := metrics.Key{Pool: e.Pool, Address: e.Address}
			ms := e.Snapshot()
			failing, isKnown := known[k]
			if ms == nil && !isKnown {
				continue
			}
			we := WarmEndpoint{Pool: e.Pool, Endpoint: e.Address, Failing: failing, Known: isKnown}
			if ms != nil && !ms.LastSuccess.IsZero() {
				we.Waiting, we.Running, we.KVUsage, we.ScrapedAt = ms.Waiting, ms.Running, ms.KVUsage, ms.LastSuccess
			}
			w.Endpoints = append(w.Endpoints, we)
			delete(known, k)
		}
	}
	for k, failing := range known {
		w.Endpoints = append(w.Endpoints, WarmEndpoint{Pool: k.Pool, Endpoint: k.Address, Failing: failing, Known: true})
	}
	sort.Slice(w.Endpoints, func(i, j int) bool {
		a, b := w.Endpoints[i], w.Endpoints[j]
		return a.Pool < b.Pool || a.Pool == b.Pool && a.Endpoint < b.Endpoint
	})
	return w
}

// ImportWarm loads memory a previous run exported, for the pools and
// endpoints of the picker's current state (call it after New, before Run;
// entries of pools or endpoints that no longer exist are skipped). Prefix
// blobs made with another hashing scheme are skipped, and every blob that
// does not decode is reported in the joined error; the rest still loads.
// Restored health keeps an endpoint that was failing out of EDS until it
// answers a scrape. Restored metrics are not used for scheduling: the first
// scrape, one interval after start, is fresher than anything persisted.
func (s *Server) ImportWarm(w Warm, now time.Time) (WarmStats, error) {
	var st WarmStats
	var errs []error
	snap := s.snap.Load()
	for _, b := range w.Prefix {
		pv := snap.pools[b.Pool]
		if pv == nil || pv.byAddr[b.Endpoint] == nil {
			continue
		}
		bt, d, err := decodePrefix(b.Data)
		if err != nil {
			errs = append(errs, fmt.Errorf("prefix blob of %s/%s: %w", b.Pool, b.Endpoint, err))
			continue
		}
		ps := pv.state
		if ps.hasher.Load().blockTokens != bt {
			ps.setBlockTokens(bt)
		}
		if d.Fingerprint != ps.hasher.Load().h.Fingerprint() {
			continue // another hashing scheme: the hashes would never match
		}
		for _, e := range d.Endpoints {
			if e.Endpoint == b.Endpoint {
				ps.index.Import(prefix.Dump{Fingerprint: d.Fingerprint, Endpoints: []prefix.EndpointDump{e}})
				st.PrefixBlocks += len(e.Hashes)
				st.PrefixEndpoints++
			}
		}
	}
	// Oldest first, so the most recently used session ends up most recent.
	sessions := append([]WarmSession(nil), w.Sessions...)
	sort.SliceStable(sessions, func(i, j int) bool { return sessions[i].Expires.Before(sessions[j].Expires) })
	for _, se := range sessions {
		pv := snap.pools[se.Pool]
		if pv == nil || pv.byAddr[se.Endpoint] == nil || !se.Expires.After(now) {
			continue
		}
		pv.state.sessions.Import(sched.SessionEntry{Key: se.ID, Addr: se.Endpoint, Expires: se.Expires})
		st.Sessions++
	}
	for _, we := range w.Endpoints {
		pv := snap.pools[we.Pool]
		if !we.Known || pv == nil || pv.byAddr[we.Endpoint] == nil {
			continue
		}
		s.eh.set(metrics.Key{Pool: we.Pool, Address: we.Endpoint}, we.Failing)
		if we.Failing {
			st.Failing++
		}
	}
	return st, errors.Join(errs...)
}

// warmCache is ExportWarm's memory between exports: the blob it made for
// each endpoint, with what it was made from, and scratch buffers.
type warmCache struct {
	mu      sync.Mutex // serialises exports
	blobs   map[loadKey]warmBlob
	scratch prefix.ExportScratch
	hashes  []uint64
}

// warmBlob is one endpoint's exported prefix blob (nil data: nothing to
// export) and the index, LRU version, hashing scheme and length limit it
// was made with.
type warmBlob struct {
	index                *prefix.Index
	version, fingerprint uint64
	blockTokens, limit   int
	data                 []byte
}

func (b warmBlob) sameSource(o warmBlob) bool {
	return b.index == o.index && b.version == o.version && b.fingerprint == o.fingerprint &&
		b.blockTokens == o.blockTokens && b.limit == o.limit
}

// WarmStats counts what ImportWarm restored.
type WarmStats struct {
	PrefixEndpoints, PrefixBlocks, Sessions, Failing int
}

// Prefix blob format: a version byte, the KV block size in tokens the
// hashes were made with (uvarint), then a prefix.Dump.
const (
	prefixBlobVersion  = 1
	prefixBlobOverhead = 1 + binary.MaxVarintLen64 + 64 // header plus Dump framing
)

func encodePrefix(blockTokens int, d prefix.Dump) []byte {
	b := make([]byte, 0, 1+binary.MaxVarintLen64+d.BinarySize())
	b = append(b, prefixBlobVersion)
	b = binary.AppendUvarint(b, uint64(blockTokens))
	b, _ = d.AppendBinary(b) // never fails
	return b
}

func decodePrefix(b []byte) (int, prefix.Dump, error) {
	if len(b) == 0 || b[0] != prefixBlobVersion {
		return 0, prefix.Dump{}, errors.New("unknown prefix blob version")
	}
	bt, n := binary.Uvarint(b[1:])
	if n <= 0 || bt == 0 || bt > 1<<16 {
		return 0, prefix.Dump{}, errors.New("bad block size")
	}
	var d prefix.Dump
	if err := d.UnmarshalBinary(b[1+n:]); err != nil {
		return 0, prefix.Dump{}, err
	}
	return int(bt), d, nil
}
