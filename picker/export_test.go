package picker

// Test hooks: methods only the package's own tests call.

// InFlight sums in-flight requests over every endpoint (handy in tests and
// status pages).
func (s *Server) InFlight() (requests, tokens int64) {
	for _, pv := range s.snap.Load().pools {
		for _, e := range pv.eps {
			requests += e.Load.InFlightRequests.Load()
			tokens += e.Load.InFlightTokens.Load()
		}
	}
	return requests, tokens
}
