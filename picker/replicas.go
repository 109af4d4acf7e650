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
func (s *Server) UsePeers(m *peers.Mesh) { s.mesh = m }

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

// publish tells the other replicas about this stream's pick.
func (st *stream) publish(pool, endpoint string, tokens int64, hashes []uint64, session string) {
	m := st.s.mesh
	if m == nil {
		return
	}
	st.peerID = m.NextID()
	// The hashes live in the decision's scratch buffer: the mesh keeps
	// its own copy.
	m.Published(peers.Pick{ID: st.peerID, Pool: pool, Endpoint: endpoint, Tokens: tokens, Hashes: slices.Clone(hashes), Session: session})
}

// unpublish tells the other replicas this stream's pick ended.
func (st *stream) unpublish() {
	if st.s.mesh != nil && st.peerID != 0 {
		st.s.mesh.Finished(st.peerID)
		st.peerID = 0
	}
}
