package picker

import (
	"slices"
	"time"

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
