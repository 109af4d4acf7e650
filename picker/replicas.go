package picker

import (
	"context"
	"slices"
	"time"

	"github.com/switchyard/switchyard/picker/metrics"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/picker/sched"
)

// UsePeers makes the picker share its picks with the other replicas
// through m and apply theirs (the Server is m's Applier). Call it before
// serving; a nil m shares nothing.
func (s *Server) UsePeers(m *peers.Mesh) {
	s.mesh = m
	// The replica stage joins (or leaves) the chains.
	st, _ := s.view.Current()
	s.apply(st)
}

var _ peers.Applier = (*Server)(nil)

// Picked implements peers.Applier: another replica sent a request to
// endpoint p.Endpoint. It counts in flight there, and the pool's observers
// (prefix index, sessions) learn it exactly as for a local pick, so every
// replica routes as if it saw every request.
func (s *Server) Picked(from string, p peers.Pick) {
	pv := s.snap.Load().pools[p.Pool]
	ep := pv.lookup(p.Endpoint)
	if ep == nil {
		return
	}
	ep.Load.InFlightRequests.Add(1)
	ep.Load.InFlightTokens.Add(p.Tokens)
	// The scraper reads an endpoint that gets traffic at its interval,
	// whichever replica sent it.
	ep.Load.PeerPicked.Add(1)
	now := time.Now()
	if pv.predictor != nil {
		// Priced before its blocks are recorded there.
		s.peerPicked(pv, ep, from, p, now)
	}
	if len(p.Hashes) > 0 || p.Session != "" {
		req := sched.Request{Hashes: p.Hashes, Session: p.Session, Now: now}
		pv.profile.Picked(&req, ep)
	}
	s.stats.peerPicks.Add(1)
}

// Released implements peers.Applier: another replica's request on
// p.Endpoint ended (or that replica went away).
func (s *Server) Released(from string, p peers.Pick) {
	s.peerReleased(from, p.ID)
	ep := s.snap.Load().pools[p.Pool].lookup(p.Endpoint)
	if ep == nil {
		return
	}
	ep.Load.InFlightRequests.Add(-1)
	ep.Load.InFlightTokens.Add(-p.Tokens)
}

// replicaStage shares the request's pick with the other replicas
// (UsePeers): the pick, its move to a fallback that served, and its end.
// Its per-request state is request.peerID.
type replicaStage struct {
	mesh *peers.Mesh
}

var (
	_ pickedStage   = (*replicaStage)(nil)
	_ servedStage   = (*replicaStage)(nil)
	_ releasedStage = (*replicaStage)(nil)
)

// replicaStageFor is in the chain when the picker shares its picks.
func replicaStageFor(s *Server, _ *snapshot, _ *poolView) any {
	if s.mesh != nil {
		return &replicaStage{mesh: s.mesh}
	}
	return nil
}

// picked tells the other replicas about the pick.
func (rs *replicaStage) picked(r *request, o *pickOutcome) {
	rs.publish(r, o.pool.name, r.primary.Address, r.tokens, o.req.Hashes, o.req.Session)
}

// served moves the pick to the fallback that served, for the other
// replicas too.
func (rs *replicaStage) served(r *request, _ string, moved bool) {
	if moved {
		rs.unpublish(r)
		rs.publish(r, r.pool.name, r.primary.Address, r.tokens, nil, "")
	}
}

// released tells the other replicas the pick ended.
func (rs *replicaStage) released(r *request) { rs.unpublish(r) }

// publish tells the other replicas about this request's pick.
func (rs *replicaStage) publish(r *request, pool, endpoint string, tokens int64, hashes []uint64, session string) {
	r.peerID = rs.mesh.NextID()
	// The hashes live in the decision's scratch buffer: the mesh keeps
	// its own copy.
	rs.mesh.Published(peers.Pick{ID: r.peerID, Pool: pool, Endpoint: endpoint, Tokens: tokens, Hashes: slices.Clone(hashes), Session: session})
}

// unpublish tells the other replicas this request's pick ended.
func (rs *replicaStage) unpublish(r *request) {
	if r.peerID != 0 {
		rs.mesh.Finished(r.peerID)
		r.peerID = 0
	}
}

// Scrape sharing (picker/peers, picker/metrics' share.go): each endpoint
// is read by one replica, which passes its readings on; the others
// publish them as their own. The mesh says which replicas share now; the
// metrics manager works out who reads what.

var _ peers.ReadingApplier = (*Server)(nil)

// Reading implements peers.ReadingApplier: another replica's reading of
// an endpoint, published unless this replica reads the endpoint itself
// (metrics.Manager.Ingest).
func (s *Server) Reading(from string, r peers.Reading) {
	mgr := s.sharing.Load()
	if mgr == nil {
		return
	}
	rd := metrics.Reading{At: r.At}
	if err := rd.UnmarshalBinary(r.Data); err != nil {
		s.log.Warn("peers: unreadable scrape reading", "peer", from, "pool", r.Pool, "endpoint", r.Endpoint, "err", err)
		return
	}
	// An endpoint not scraped here is one of a state this replica has not
	// applied yet (or no longer): nothing to publish.
	if mgr.Ingest(metrics.Key{Pool: r.Pool, Address: r.Endpoint}, from, rd) == nil {
		s.stats.peerReadings.Add(1)
	}
}

// Readings implements peers.ReadingApplier: the latest readings of the
// endpoints this replica reads.
func (s *Server) Readings() []peers.Reading {
	mgr := s.sharing.Load()
	if mgr == nil {
		return nil
	}
	own := mgr.OwnReadings()
	out := make([]peers.Reading, 0, len(own))
	for _, kr := range own {
		if r, ok := s.encodeReading(kr.Key, kr.Reading); ok {
			out = append(out, r)
		}
	}
	return out
}

// shareReading passes this replica's reading of k on to the others
// (metrics.Options.OnReading).
func (s *Server) shareReading(k metrics.Key, r metrics.Reading) {
	if pr, ok := s.encodeReading(k, r); ok {
		s.mesh.PublishReading(pr)
	}
}

func (s *Server) encodeReading(k metrics.Key, r metrics.Reading) (peers.Reading, bool) {
	data, err := r.AppendBinary(nil)
	if err != nil {
		s.log.Warn("peers: scrape reading not shared", "pool", k.Pool, "endpoint", k.Address, "err", err)
		return peers.Reading{}, false
	}
	return peers.Reading{Pool: k.Pool, Endpoint: k.Address, At: r.At, Data: data}, true
}

// shareScrapes runs while Run scrapes with a mesh that shares readings:
// it tells the others this replica reads endpoints for them, and follows
// which replicas share, until ctx ends.
func (s *Server) shareScrapes(ctx context.Context, mgr *metrics.Manager) {
	s.sharing.Store(mgr)
	s.mesh.SetSharing(true)
	defer func() {
		s.mesh.SetSharing(false)
		s.sharing.Store(nil)
	}()
	for {
		_, changed := s.mesh.Sharers()
		s.updateOwners()
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// updateOwners gives the metrics manager the replicas that read
// endpoints with this one now, and how many processes read each endpoint:
// one for those sharing (this replica among them), plus every other
// replica of the state that does not share with this one (an older one
// in a rolling upgrade, one not connected yet), which reads every
// endpoint itself.
func (s *Server) updateOwners() {
	mgr := s.sharing.Load()
	if mgr == nil {
		return
	}
	s.ownersMu.Lock()
	defer s.ownersMu.Unlock()
	st, _ := s.view.Current()
	sharers, _ := s.mesh.Sharers()
	ids := make([]string, len(sharers))
	for i, sh := range sharers {
		ids[i] = sh.ID
	}
	mgr.SetReplicas(s.mesh.Self(), ids)
	others := 0
	if st != nil {
		for _, r := range st.Replicas {
			if !(r.Address != "" && r.Address == s.mesh.Address() || r.ID == s.mesh.Self()) {
				others++
			}
		}
	}
	mgr.SetScrapers(1 + max(0, others-len(ids)))
}
