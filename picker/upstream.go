package picker

// upstreamKeyStage sends a pool's own API key (registry.Pool's
// UpstreamAPIKey) to its model servers: it is in the chain of the pools
// that have one. It keeps no per-request state.
type upstreamKeyStage struct {
	bearer string // the authorization header's value
}

var _ answerStage = (*upstreamKeyStage)(nil)

// upstreamKeyStageFor is in the chain of a pool with an upstream key.
func upstreamKeyStageFor(_ *Server, _ *snapshot, pv *poolView) any {
	if pv != nil && pv.upstreamKey != "" {
		return &upstreamKeyStage{bearer: "Bearer " + pv.upstreamKey}
	}
	return nil
}

// answer sets the pool's own API key on the request going upstream, in
// place of the client's (removed by the tenant stage).
func (us *upstreamKeyStage) answer(_ *request, d *decisionBlock) {
	for i, k := range d.hm.RemoveHeaders {
		if k == "authorization" {
			// Set below; removing it as well would leave Envoy's order of
			// operations to decide.
			d.hm.RemoveHeaders = append(d.hm.RemoveHeaders[:i:i], d.hm.RemoveHeaders[i+1:]...)
			break
		}
	}
	d.hm.SetHeaders = append(d.hm.SetHeaders, setHeader("authorization", us.bearer))
}
