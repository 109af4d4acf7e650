package xds

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
)

// NodeStatus is what the server knows about one Envoy node.
type NodeStatus struct {
	ID      string
	Cluster string
	// Protocol is the ADS variant of the node's latest stream:
	// ProtocolSotW or ProtocolDelta.
	Protocol string
	// Streams is the number of open xDS streams from the node; 0 means it
	// is disconnected.
	Streams   int
	FirstSeen time.Time
	LastSeen  time.Time
	// Acked maps a resource type ("Cluster", "Listener", ...) to the
	// version the node holds: the last one it ACKed, or the one it
	// reported when it connected (a reconnecting Envoy already holding
	// the served content is sent nothing, so it never ACKs it here).
	Acked map[string]string
	ACKs  uint64
	NACKs uint64
	// LastNACK is the error detail of the node's most recent NACK.
	LastNACK string
}

// The ADS protocol variants a node may use.
const (
	ProtocolSotW  = "sotw"
	ProtocolDelta = "delta"
)

// tracker implements the go-control-plane callbacks: it remembers which
// node owns each stream, which nonce was last sent per stream and type, and
// classifies requests answering that nonce as ACK or NACK.
type tracker struct {
	log *slog.Logger
	// held reports the served version of a type when versions (an
	// incremental-xDS Envoy's initial_resource_versions) are what is
	// served for the names given ("" when not, or nothing is served yet).
	held func(typeURL string, versions map[string]string, names []string) string

	mu      sync.Mutex
	streams map[int64]*streamState
	nodes   map[string]*NodeStatus
	acks    uint64
	nacks   uint64
}

type streamState struct {
	node   string
	nonces map[string]sent // by type URL
	// seen marks the types an incremental stream has requested.
	seen map[string]bool
	// initial holds, by type, what an incremental stream said it held
	// when it first asked for the type, until it is confirmed held or
	// the type is answered.
	initial map[string]heldState
}

type heldState struct {
	versions map[string]string
	names    []string
}

type sent struct {
	nonce   string
	version string
}

func newTracker(log *slog.Logger, held func(string, map[string]string, []string) string) *tracker {
	return &tracker{log: log, held: held, streams: map[int64]*streamState{}, nodes: map[string]*NodeStatus{}}
}

// callbacks tracks both protocols. The state-of-the-world and incremental
// servers number their streams independently from 1, so incremental
// streams are kept under negated ids.
func (t *tracker) callbacks() serverv3.Callbacks {
	open := func(id int64) {
		t.mu.Lock()
		t.streams[id] = &streamState{nonces: map[string]sent{}, seen: map[string]bool{}}
		t.mu.Unlock()
	}
	return serverv3.CallbackFuncs{
		StreamOpenFunc: func(_ context.Context, id int64, _ string) error {
			open(id)
			return nil
		},
		DeltaStreamOpenFunc: func(_ context.Context, id int64, _ string) error {
			open(-id)
			return nil
		},
		StreamClosedFunc:      t.closed,
		DeltaStreamClosedFunc: func(id int64, node *corev3.Node) { t.closed(-id, node) },
		StreamRequestFunc:     t.onRequest,
		StreamResponseFunc:    t.onResponse,
		StreamDeltaRequestFunc: func(id int64, req *discoveryv3.DeltaDiscoveryRequest) error {
			return t.onDeltaRequest(-id, req)
		},
		StreamDeltaResponseFunc: func(id int64, _ *discoveryv3.DeltaDiscoveryRequest, resp *discoveryv3.DeltaDiscoveryResponse) {
			t.sent(-id, resp.GetTypeUrl(), resp.GetNonce(), resp.GetSystemVersionInfo())
		},
	}
}

func (t *tracker) closed(id int64, _ *corev3.Node) {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.streams[id]
	delete(t.streams, id)
	if st == nil || st.node == "" {
		return
	}
	if n := t.nodes[st.node]; n != nil {
		n.Streams--
		n.LastSeen = time.Now()
		if n.Streams == 0 {
			t.log.Info("Envoy disconnected", "node", n.ID, "cluster", n.Cluster)
		}
	}
}

// stream returns the state of stream id and its node (nil before the
// node is known), registering the node from the request's node field.
// t.mu must be held.
func (t *tracker) stream(id int64, node *corev3.Node, protocol string) (*streamState, *NodeStatus) {
	st := t.streams[id]
	if st == nil {
		st = &streamState{nonces: map[string]sent{}, seen: map[string]bool{}}
		t.streams[id] = st
	}
	now := time.Now()
	if st.node == "" && node != nil {
		st.node = node.GetId()
		n := t.nodes[st.node]
		if n == nil {
			t.prune(now)
			n = &NodeStatus{ID: st.node, FirstSeen: now, Acked: map[string]string{}}
			t.nodes[st.node] = n
		}
		n.Cluster = node.GetCluster()
		n.Streams++
		n.Protocol = protocol
		t.log.Info("Envoy connected", "node", n.ID, "cluster", n.Cluster, "protocol", protocol,
			"envoy", node.GetUserAgentName()+"/"+buildVersion(node))
	}
	n := t.nodes[st.node]
	if n != nil {
		n.LastSeen = now
	}
	return st, n
}

// answered classifies a request answering the response last sent on its
// stream for its type as ACK or NACK, and records it.
func (t *tracker) answered(n *NodeStatus, typeURL string, last sent, version string, nack *status.Status) {
	typ := shortType(typeURL)
	if nack != nil {
		n.NACKs++
		t.nacks++
		n.LastNACK = nack.GetMessage()
		t.log.Error("Envoy rejected configuration (NACK)", "node", n.ID, "cluster", n.Cluster,
			"type", typ, "rejected_version", last.version, "kept_version", version, "error", nack.GetMessage())
		return
	}
	n.ACKs++
	t.acks++
	n.Acked[typ] = version
	t.log.Debug("Envoy ACK", "node", n.ID, "type", typ, "version", version)
}

// onDeltaRequest tracks an incremental-xDS request. Its nonce names the
// response it answers; a response's version is its system_version_info
// (the type's served version). A reconnecting Envoy lists what it holds
// in initial_resource_versions; when that is what is served, nothing is
// sent to it, so the type counts as held at the served version.
func (t *tracker) onDeltaRequest(id int64, req *discoveryv3.DeltaDiscoveryRequest) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	st, n := t.stream(id, req.GetNode(), ProtocolDelta)
	if n == nil {
		return nil
	}
	typeURL := req.GetTypeUrl()
	first := !st.seen[typeURL]
	st.seen[typeURL] = true
	last, ok := st.nonces[typeURL]
	if req.GetResponseNonce() != "" && ok && req.GetResponseNonce() == last.nonce {
		version := last.version
		if req.GetErrorDetail() != nil {
			version = n.Acked[shortType(typeURL)]
		}
		delete(st.initial, typeURL)
		t.answered(n, typeURL, last, version, req.GetErrorDetail())
		return nil
	}
	if first && len(req.GetInitialResourceVersions()) > 0 && t.held != nil {
		h := heldState{versions: req.GetInitialResourceVersions(), names: req.GetResourceNamesSubscribe()}
		if v := t.held(typeURL, h.versions, h.names); v != "" {
			n.Acked[shortType(typeURL)] = v
		} else {
			// Nothing served yet (a restarted switchyard still loading),
			// or something else: known once a snapshot is set.
			if st.initial == nil {
				st.initial = map[string]heldState{}
			}
			st.initial[typeURL] = h
		}
	}
	return nil
}

// recheck confirms what incremental streams said they held against a new
// snapshot: a type held at its served version is sent nothing, so this is
// the only way to learn the node has it.
func (t *tracker) recheck() {
	if t.held == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, st := range t.streams {
		n := t.nodes[st.node]
		if n == nil {
			continue
		}
		for typeURL, h := range st.initial {
			if v := t.held(typeURL, h.versions, h.names); v != "" {
				n.Acked[shortType(typeURL)] = v
				delete(st.initial, typeURL)
			}
		}
	}
}

// sent records the nonce and version of a response sent on a stream.
func (t *tracker) sent(id int64, typeURL, nonce, version string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if st := t.streams[id]; st != nil {
		st.nonces[typeURL] = sent{nonce: nonce, version: version}
	}
}

func (t *tracker) onRequest(id int64, req *discoveryv3.DiscoveryRequest) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	st, n := t.stream(id, req.GetNode(), ProtocolSotW)
	if n == nil {
		return nil
	}
	typ := shortType(req.GetTypeUrl())
	last, ok := st.nonces[req.GetTypeUrl()]
	if req.GetResponseNonce() == "" || !ok || req.GetResponseNonce() != last.nonce {
		// An initial request or a stale nonce: neither ACK nor NACK. An
		// Envoy (re)connecting reports the version it holds, which a
		// restarted or another replica serving the same content will not
		// send again (versions are content addresses): record it as held.
		if _, answered := st.nonces[req.GetTypeUrl()]; !answered && req.GetVersionInfo() != "" && req.GetErrorDetail() == nil {
			n.Acked[typ] = req.GetVersionInfo()
		}
		return nil
	}
	t.answered(n, req.GetTypeUrl(), last, req.GetVersionInfo(), req.GetErrorDetail())
	return nil
}

// forgetAfter is how long a disconnected node stays on the status page.
const forgetAfter = time.Hour

// prune forgets nodes disconnected for longer than forgetAfter, so a fleet
// whose node ids change on every restart does not grow the map forever.
func (t *tracker) prune(now time.Time) {
	for id, n := range t.nodes {
		if n.Streams == 0 && now.Sub(n.LastSeen) > forgetAfter {
			delete(t.nodes, id)
		}
	}
}

func (t *tracker) onResponse(_ context.Context, id int64, _ *discoveryv3.DiscoveryRequest, resp *discoveryv3.DiscoveryResponse) {
	t.sent(id, resp.GetTypeUrl(), resp.GetNonce(), resp.GetVersionInfo())
}

func buildVersion(n *corev3.Node) string {
	if v := n.GetUserAgentBuildVersion().GetVersion(); v != nil {
		return formatSemver(v.GetMajorNumber(), v.GetMinorNumber(), v.GetPatch())
	}
	return n.GetUserAgentVersion()
}

func (t *tracker) totals() (acks, nacks uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.acks, t.nacks
}

func (t *tracker) snapshot() []NodeStatus {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]NodeStatus, 0, len(t.nodes))
	for _, n := range t.nodes {
		c := *n
		c.Acked = make(map[string]string, len(n.Acked))
		for k, v := range n.Acked {
			c.Acked[k] = v
		}
		out = append(out, c)
	}
	sortNodes(out)
	return out
}

func formatSemver(major, minor, patch uint32) string {
	return strconv.FormatUint(uint64(major), 10) + "." + strconv.FormatUint(uint64(minor), 10) + "." + strconv.FormatUint(uint64(patch), 10)
}
