package store

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/switchyard/switchyard/registry"
)

// pending is what the writer has not committed yet. A nil map or slice with
// its *Set flag false means "unchanged".
type pending struct {
	state       *registry.State
	metrics     map[EndpointKey]Metrics
	metricsSet  bool
	health      map[EndpointKey]Health
	healthSet   bool
	sessions    []Session
	sessionsSet bool
	prefix      map[EndpointKey][]byte // nil value: delete
	consul      map[string]uint64      // 0: delete
}

func (p *pending) empty() bool {
	return p.state == nil && !p.metricsSet && !p.healthSet && !p.sessionsSet && len(p.prefix) == 0 && len(p.consul) == 0
}

// under returns p with newer's changes applied on top (newer wins).
func (p pending) under(newer pending) pending {
	if newer.state != nil {
		p.state = newer.state
	}
	if newer.metricsSet {
		p.metrics, p.metricsSet = newer.metrics, true
	}
	if newer.healthSet {
		p.health, p.healthSet = newer.health, true
	}
	if newer.sessionsSet {
		p.sessions, p.sessionsSet = newer.sessions, true
	}
	if len(newer.prefix) > 0 {
		if p.prefix == nil {
			p.prefix = map[EndpointKey][]byte{}
		}
		maps.Copy(p.prefix, newer.prefix)
	}
	if len(newer.consul) > 0 {
		if p.consul == nil {
			p.consul = map[string]uint64{}
		}
		maps.Copy(p.consul, newer.consul)
	}
	return p
}

// record applies fn to the pending set under the lock and wakes the writer.
// It does nothing once the store is closed.
func (s *File) record(fn func(p *pending)) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	fn(&s.pend)
	s.mu.Unlock()
	select {
	case s.dirty <- struct{}{}:
	default:
	}
}

// SaveState records st as the state to persist. The store keeps the
// pointer until the next flush, so st must not be modified afterwards
// (published registry states never are).
func (s *File) SaveState(st *registry.State) {
	if st == nil {
		return
	}
	s.record(func(p *pending) { p.state = st })
}

// SaveMetrics replaces the persisted metrics of every endpoint with m.
// Entries with non-finite numbers or over-long keys are dropped.
func (s *File) SaveMetrics(m map[EndpointKey]Metrics) {
	cp := make(map[EndpointKey]Metrics, len(m))
	for k, v := range m {
		if validEndpointKey(k) && !math.IsNaN(v.KVUsage) && !math.IsInf(v.KVUsage, 0) {
			cp[k] = v
		}
	}
	s.record(func(p *pending) { p.metrics, p.metricsSet = cp, true })
}

// SaveHealth replaces the persisted health and drain state of every
// endpoint with h.
func (s *File) SaveHealth(h map[EndpointKey]Health) {
	cp := make(map[EndpointKey]Health, len(h))
	for k, v := range h {
		if validEndpointKey(k) {
			cp[k] = v
		}
	}
	s.record(func(p *pending) { p.health, p.healthSet = cp, true })
}

// SavePrefix records the picker's prefix-cache blob for one endpoint; a nil
// or empty blob deletes it. The blob is copied. It fails with ErrTooLarge
// when the blob exceeds Options.MaxPrefixBlob, or when storing it would
// push all blobs together past Options.MaxPrefixTotal; the previous blob
// then stays in force.
func (s *File) SavePrefix(pool, endpoint string, blob []byte) error {
	k := EndpointKey{Pool: pool, Address: endpoint}
	if !validEndpointKey(k) {
		return fmt.Errorf("store: prefix key %q/%q is empty or longer than %d bytes", pool, endpoint, MaxKeyLen)
	}
	if len(blob) > s.opts.MaxPrefixBlob {
		return fmt.Errorf("store: prefix blob for %s/%s is %d bytes, limit %d: %w", pool, endpoint, len(blob), s.opts.MaxPrefixBlob, ErrTooLarge)
	}
	var cp []byte
	if len(blob) > 0 {
		cp = append([]byte(nil), blob...)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	total := s.prefixTotal - s.prefixSizes[k] + len(cp)
	if total > s.opts.MaxPrefixTotal {
		s.mu.Unlock()
		return fmt.Errorf("store: prefix blobs would total %d bytes, limit %d: %w", total, s.opts.MaxPrefixTotal, ErrTooLarge)
	}
	s.prefixTotal = total
	if cp == nil {
		delete(s.prefixSizes, k)
	} else {
		s.prefixSizes[k] = len(cp)
	}
	s.mu.Unlock()
	s.record(func(p *pending) {
		if p.prefix == nil {
			p.prefix = map[EndpointKey][]byte{}
		}
		p.prefix[k] = cp
	})
	return nil
}

// SaveSessions replaces the persisted session-affinity map. Expired
// entries, entries without an id or endpoint and over-long ids are
// dropped; beyond Options.MaxSessions, the entries that expire last are
// kept.
func (s *File) SaveSessions(sessions []Session) {
	now := s.opts.Now()
	cp := make([]Session, 0, len(sessions))
	seen := make(map[string]int, len(sessions))
	for _, se := range sessions {
		if se.ID == "" || len(se.ID) > MaxKeyLen || se.Endpoint == "" || !se.Expires.After(now) {
			continue
		}
		if i, dup := seen[se.ID]; dup {
			if se.Expires.After(cp[i].Expires) {
				cp[i] = se
			}
			continue
		}
		seen[se.ID] = len(cp)
		cp = append(cp, se)
	}
	if len(cp) > s.opts.MaxSessions {
		sort.Slice(cp, func(i, j int) bool {
			if !cp[i].Expires.Equal(cp[j].Expires) {
				return cp[i].Expires.After(cp[j].Expires)
			}
			return cp[i].ID < cp[j].ID
		})
		cp = slices.Clip(cp[:s.opts.MaxSessions])
	}
	s.record(func(p *pending) { p.sessions, p.sessionsSet = cp, true })
}

// SaveConsulIndex records the last Consul index seen for a selector key;
// index 0 deletes it.
func (s *File) SaveConsulIndex(key string, index uint64) {
	if key == "" || len(key) > MaxKeyLen {
		return
	}
	s.record(func(p *pending) {
		if p.consul == nil {
			p.consul = map[string]uint64{}
		}
		p.consul[key] = index
	})
}

func validEndpointKey(k EndpointKey) bool {
	return k.Pool != "" && k.Address != "" && len(k.Pool)+1+len(k.Address) <= MaxKeyLen
}

// Flush commits everything saved so far and waits for the commit.
func (s *File) Flush(ctx context.Context) error {
	reply := make(chan error, 1)
	select {
	case s.flushReq <- reply:
	case <-s.done:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-reply:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run is the single background writer.
func (s *File) run() {
	defer close(s.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	armed := false
	arm := func() {
		if !armed {
			timer.Reset(s.opts.FlushInterval)
			armed = true
		}
	}
	for {
		select {
		case <-s.dirty:
			arm()
		case <-timer.C:
			armed = false
			if s.flush() != nil {
				arm() // retry after another interval
			}
		case reply := <-s.flushReq:
			reply <- s.flush()
		case <-s.closing:
			timer.Stop()
			s.writeErr = s.flush()
			return
		}
	}
}

// flush commits the pending batch in one transaction. On failure the batch
// is put back under anything saved meanwhile, so nothing is lost.
func (s *File) flush() error {
	s.mu.Lock()
	b := s.pend
	s.pend = pending{}
	s.mu.Unlock()
	usage, upto := s.journal.take()
	if b.empty() && usage == nil {
		return nil
	}
	var skipped []error
	err := s.db.Update(func(tx *bolt.Tx) error {
		var err error
		if skipped, err = s.apply(tx, &b); err != nil {
			return err
		}
		if usage != nil {
			more, err := putUsage(tx, usage, upto)
			skipped = append(skipped, more...)
			return err
		}
		return nil
	})
	if usage != nil {
		s.journal.done(usage, upto, err)
	}
	for _, e := range skipped {
		s.log.Warn("store record not saved", "path", s.path, "err", e)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		err = fmt.Errorf("store %s: flush: %w", s.path, err)
		s.pend = b.under(s.pend)
		if s.lastErr == nil {
			s.log.Error("store flush failed; will retry", "err", err)
		}
		s.lastErr = err
		return err
	}
	s.lastErr = nil
	s.flushes.Add(1)
	return nil
}

// apply writes batch b in tx. Records that cannot be encoded are skipped
// and returned, so one bad value never blocks every later flush.
func (s *File) apply(tx *bolt.Tx, b *pending) (skipped []error, err error) {
	if b.state != nil {
		if data, err := encodeRecord("state", fromState(b.state)); err != nil {
			skipped = append(skipped, err)
		} else if err := tx.Bucket(bucketState).Put(keyState, data); err != nil {
			return skipped, err
		}
	}
	replace := func(name []byte) (*bolt.Bucket, error) {
		if err := tx.DeleteBucket(name); err != nil {
			return nil, err
		}
		return tx.CreateBucket(name)
	}
	if b.metricsSet {
		bk, err := replace(bucketMetrics)
		if err != nil {
			return skipped, err
		}
		for _, k := range sortedKeys(b.metrics) {
			m := b.metrics[k]
			data, err := encodeRecord("metrics", metricsRecord{V: recordVersion, Waiting: m.Waiting, Running: m.Running, KVUsage: m.KVUsage, ScrapedAt: m.ScrapedAt})
			if err != nil {
				skipped = append(skipped, err)
				continue
			}
			if err := bk.Put(endpointKey(k), data); err != nil {
				return skipped, err
			}
		}
	}
	if b.healthSet {
		bk, err := replace(bucketHealth)
		if err != nil {
			return skipped, err
		}
		for _, k := range sortedKeys(b.health) {
			h := b.health[k]
			data, err := encodeRecord("health", healthRecord{V: recordVersion, Healthy: h.Healthy, Draining: h.Draining, Reason: h.Reason, Since: h.Since})
			if err != nil {
				skipped = append(skipped, err)
				continue
			}
			if err := bk.Put(endpointKey(k), data); err != nil {
				return skipped, err
			}
		}
	}
	if b.sessionsSet {
		bk, err := replace(bucketSessions)
		if err != nil {
			return skipped, err
		}
		// Sorted puts keep bbolt's pages dense and the write cheap.
		sort.Slice(b.sessions, func(i, j int) bool { return b.sessions[i].ID < b.sessions[j].ID })
		for _, se := range b.sessions {
			data, err := encodeRecord("session", sessionRecord{V: recordVersion, Pool: se.Pool, Endpoint: se.Endpoint, Expires: se.Expires})
			if err != nil {
				skipped = append(skipped, err)
				continue
			}
			if err := bk.Put([]byte(se.ID), data); err != nil {
				return skipped, err
			}
		}
	}
	pb := tx.Bucket(bucketPrefix)
	for _, k := range sortedKeys(b.prefix) {
		blob := b.prefix[k]
		if blob == nil {
			err = pb.Delete(endpointKey(k))
		} else {
			err = pb.Put(endpointKey(k), blob)
		}
		if err != nil {
			return skipped, err
		}
	}
	cb := tx.Bucket(bucketConsul)
	for k, idx := range b.consul {
		if idx == 0 {
			err = cb.Delete([]byte(k))
		} else {
			err = cb.Put([]byte(k), u64(idx))
		}
		if err != nil {
			return skipped, err
		}
	}
	now, _ := s.opts.Now().UTC().MarshalText()
	if err := tx.Bucket(bucketMeta).Put(keyFlushedAt, now); err != nil {
		return skipped, err
	}
	return skipped, nil
}

// sortedKeys returns m's keys in bbolt key order.
func sortedKeys[V any](m map[EndpointKey]V) []EndpointKey {
	keys := slices.Collect(maps.Keys(m))
	// Pool, then address, is the order of "pool NUL address" keys.
	slices.SortFunc(keys, func(a, b EndpointKey) int {
		if c := strings.Compare(a.Pool, b.Pool); c != 0 {
			return c
		}
		return strings.Compare(a.Address, b.Address)
	})
	return keys
}
