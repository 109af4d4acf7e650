package metrics

import (
	"slices"
	"time"
)

// Scrape sharing between replicas. Each endpoint is read by one replica,
// its owner: the first of the live replicas in the endpoint's rendezvous
// order (highest score of replica and endpoint). The owner passes each
// reading on to the others (OnReading), which publish it (Ingest) instead
// of reading the endpoint themselves. Which replicas are live is the
// caller's (Manager.SetReplicas); this file decides what each process
// does with it.
//
// Views of who is live may differ for a while (a stream up one way, not
// yet the other). Every replica counts itself, so the replica first in an
// endpoint's order among those actually running always reads it: at
// worst two replicas read an endpoint, never none, as long as no view
// counts a replica that is gone (the caller's failure detection bounds
// that). Beyond that, each replica checks what it gets: when the readings
// of the replicas ranked before it in an endpoint's order turn stale, or
// they report that the endpoint fails, it reads the endpoint itself
// ("stands in"): the first after the owner at once for failures and one
// grace after staleness, the next one grace later, and so on, and stops
// once readings from before it come again.

// MinStandInGrace is the shortest grace a replica gives the replicas
// ranked before it in an endpoint's order (see standBy).
const MinStandInGrace = 100 * time.Millisecond

// score is replica's rendezvous score for endpoint k: FNV-1a over the
// replica ID and the key, mixed (splitmix64's finaliser) so that every
// bit of the ID moves every bit of the score.
func score(replica string, k Key) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := 0; i < len(replica); i++ {
		h = (h ^ uint64(replica[i])) * prime
	}
	h = (h ^ 0xff) * prime
	for i := 0; i < len(k.Pool); i++ {
		h = (h ^ uint64(k.Pool[i])) * prime
	}
	h = (h ^ 0xff) * prime
	for i := 0; i < len(k.Address); i++ {
		h = (h ^ uint64(k.Address[i])) * prime
	}
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}

// ahead reports whether replica a comes before b in k's order (higher
// score; equal scores by name).
func ahead(a string, sa uint64, b string, sb uint64) bool {
	return sa > sb || sa == sb && a < b
}

// ring is who reads endpoints together: this process and its live peers.
type ring struct {
	self  string
	peers []string // sorted, without self
}

// rank is self's place in k's order among the ring (0: the owner).
func (r *ring) rank(k Key) int {
	if r == nil || len(r.peers) == 0 {
		return 0
	}
	ss := score(r.self, k)
	n := 0
	for _, p := range r.peers {
		if ahead(p, score(p, k), r.self, ss) {
			n++
		}
	}
	return n
}

// before reports whether replica from is live and ranked before self in
// k's order.
func (r *ring) before(k Key, from string) bool {
	if r == nil || from == r.self {
		return false
	}
	if _, ok := slices.BinarySearch(r.peers, from); !ok {
		return false
	}
	return ahead(from, score(from, k), r.self, score(r.self, k))
}

// owner is the replica first in k's order ("" when it is self).
func (r *ring) owner(k Key) string {
	if r == nil || len(r.peers) == 0 {
		return ""
	}
	best, bs := r.self, score(r.self, k)
	for _, p := range r.peers {
		if s := score(p, k); ahead(p, s, best, bs) {
			best, bs = p, s
		}
	}
	if best == r.self {
		return ""
	}
	return best
}

// Owner returns the replica that reads k for this one in its current
// view (SetReplicas), or "" when this process does.
func Owner(self string, peers []string, k Key) string {
	r := &ring{self: self, peers: slices.Sorted(slices.Values(peers))}
	return r.owner(k)
}

// SetReplicas says which replicas read endpoints together: this process,
// named self, and the peers that are live now and share their readings
// (by replica ID). Each endpoint is read by its owner (the first of them
// in its rendezvous order), which passes its readings on (OnReading);
// the others publish those (Ingest) and stand in when they stop (see
// share.go). No peers: this process reads every endpoint. Every endpoint
// looks at once at where it now stands.
func (m *Manager) SetReplicas(self string, peers []string) {
	ps := slices.Sorted(slices.Values(peers))
	ps = slices.Compact(ps)
	if i := slices.Index(ps, self); i >= 0 {
		ps = slices.Delete(ps, i, i+1)
	}
	if r := m.ring.Load(); r != nil && r.self == self && slices.Equal(r.peers, ps) {
		return
	}
	m.ring.Store(&ring{self: self, peers: ps})
	for _, w := range *m.view.Load() {
		w.wake()
	}
}

// Owner returns the replica this process counts on to read k, "" when it
// reads k itself as the owner (or shares with nobody).
func (m *Manager) Owner(k Key) string { return m.ring.Load().owner(k) }

// Roles counts the endpoints this process reads as their owner, reads
// standing in for a replica ranked before it, and gets from others.
func (m *Manager) Roles() (own, standIn, shared int) {
	r := m.ring.Load()
	for k, w := range *m.view.Load() {
		switch {
		case !w.scraping.Load():
			shared++
		case r.rank(k) == 0:
			own++
		default:
			standIn++
		}
	}
	return own, standIn, shared
}

// KeyReading is one endpoint's reading.
type KeyReading struct {
	Key
	Reading
}

// OwnReadings returns the latest reading of every endpoint this process
// reads itself: what a replica that starts sharing with it needs at once
// rather than at each endpoint's next scrape (an idle one's is up to
// IdleInterval away).
func (m *Manager) OwnReadings() []KeyReading {
	var out []KeyReading
	for k, w := range *m.view.Load() {
		if !w.scraping.Load() {
			continue
		}
		s := w.h.Load()
		if s == nil || s.From != "" || s.ScrapedAt.IsZero() {
			continue
		}
		r := Reading{At: s.ScrapedAt, Interval: s.Interval, Cost: s.Cost, PageBytes: s.PageBytes, Filter: s.Filter, Models: s.ServedModels}
		if s.Err != nil {
			r.Err = s.Err.Error()
		} else {
			r.Values = s.Values
		}
		out = append(out, KeyReading{Key: k, Reading: r})
	}
	return out
}
