package picker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
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
	// Sessions are the unexpired session-affinity entries.
	Sessions []WarmSession
	// Endpoints are the health and last metrics of every scraped endpoint.
	Endpoints []WarmEndpoint
}

// PrefixBlob is one endpoint's prefix-cache entries, encoded.
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
// whole is not.
func (s *Server) ExportWarm(now time.Time, lim WarmLimits) Warm {
	var w Warm
	s.loads.mu.Lock()
	pools := make(map[string]*poolState, len(s.loads.pools))
	for name, ps := range s.loads.pools {
		pools[name] = ps
	}
	s.loads.mu.Unlock()
	// One hasher per pool for both the dump and its blobs' block size, so
	// a block-size change meanwhile cannot pair one with the other.
	type poolDump struct {
		d           prefix.Dump
		blockTokens int
	}
	dumps := make(map[string]poolDump, len(pools))
	endpoints := 0
	for pool, ps := range pools {
		h := ps.hasher.Load()
		d := ps.index.Export(h.h.Fingerprint())
		dumps[pool] = poolDump{d: d, blockTokens: h.blockTokens}
		endpoints += len(d.Endpoints)
	}
	maxPrefixBytes := lim.MaxPrefixBlob
	if lim.MaxPrefixTotal > 0 && endpoints > 0 {
		share := lim.MaxPrefixTotal / endpoints
		if maxPrefixBytes <= 0 || share < maxPrefixBytes {
			maxPrefixBytes = share
		}
	}
	for pool, ps := range pools {
		pd := dumps[pool]
		for _, e := range pd.d.Endpoints {
			if len(e.Hashes) == 0 {
				continue
			}
			if maxPrefixBytes > 0 {
				room := (maxPrefixBytes - prefixBlobOverhead - len(e.Endpoint)) / 8
				if room <= 0 {
					continue
				}
				if len(e.Hashes) > room {
					e.Hashes = e.Hashes[:room]
				}
			}
			w.Prefix = append(w.Prefix, PrefixBlob{Pool: pool, Endpoint: e.Endpoint,
				Data: encodePrefix(pd.blockTokens, prefix.Dump{Fingerprint: pd.d.Fingerprint, Endpoints: []prefix.EndpointDump{e}})})
		}
		for _, se := range ps.sessions.Export(now) {
			w.Sessions = append(w.Sessions, WarmSession{Pool: pool, ID: se.Key, Endpoint: se.Addr, Expires: se.Expires})
		}
	}
	sort.Slice(w.Prefix, func(i, j int) bool {
		a, b := w.Prefix[i], w.Prefix[j]
		return a.Pool < b.Pool || a.Pool == b.Pool && a.Endpoint < b.Endpoint
	})
	sort.Slice(w.Sessions, func(i, j int) bool { return w.Sessions[i].ID < w.Sessions[j].ID })

	known := s.eh.states()
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
	dump, _ := d.MarshalBinary() // never fails
	b := make([]byte, 0, 1+binary.MaxVarintLen64+len(dump))
	b = append(b, prefixBlobVersion)
	b = binary.AppendUvarint(b, uint64(blockTokens))
	return append(b, dump...)
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
