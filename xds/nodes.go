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
)

// NodeStatus is what the server knows about one Envoy node.
type NodeStatus struct {
	ID      string
	Cluster string
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

// tracker implements the go-control-plane callbacks: it remembers which
// node owns each stream, which nonce was last sent per stream and type, and
// classifies requests answering that nonce as ACK or NACK.
type tracker struct {
	log *slog.Logger

	mu      sync.Mutex
	streams map[int64]*streamState
	nodes   map[string]*NodeStatus
	acks    uint64
	nacks   uint64
}

type streamState struct {
	node   string
	nonces map[string]sent // by type URL
}

type sent struct {
	nonce   string
	version string
}

func newTracker(log *slog.Logger) *tracker {
	return &tracker{log: log, streams: map[int64]*streamState{}, nodes: map[string]*NodeStatus{}}
}

func (t *tracker) callbacks() serverv3.Callbacks {
	return serverv3.CallbackFuncs{
		StreamOpenFunc: func(_ context.Context, id int64, typeURL string) error {
			t.mu.Lock()
			t.streams[id] = &streamState{nonces: map[string]sent{}}
			t.mu.Unlock()
			return nil
		},
		StreamClosedFunc: func(id int64, node *corev3.Node) {
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
		},
		StreamRequestFunc:  t.onRequest,
		StreamResponseFunc: t.onResponse,
	}
}

func (t *tracker) onRequest(id int64, req *discoveryv3.DiscoveryRequest) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.streams[id]
	if st == nil {
		st = &streamState{nonces: map[string]sent{}}
		t.streams[id] = st
	}
	now := time.Now()
	if st.node == "" && req.GetNode() != nil {
		st.node = req.GetNode().GetId()
		n := t.nodes[st.node]
		if n == nil {
			t.prune(now)
			n = &NodeStatus{ID: st.node, FirstSeen: now, Acked: map[string]string{}}
			t.nodes[st.node] = n
		}
		n.Cluster = req.GetNode().GetCluster()
		n.Streams++
		t.log.Info("Envoy connected", "node", n.ID, "cluster", n.Cluster,
			"envoy", req.GetNode().GetUserAgentName()+"/"+buildVersion(req.GetNode()))
	}
	n := t.nodes[st.node]
	if n == nil {
		return nil
	}
	n.LastSeen = now
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
	if d := req.GetErrorDetail(); d != nil {
		n.NACKs++
		t.nacks++
		n.LastNACK = d.GetMessage()
		t.log.Error("Envoy rejected configuration (NACK)", "node", n.ID, "cluster", n.Cluster,
			"type", typ, "rejected_version", last.version, "kept_version", req.GetVersionInfo(), "error", d.GetMessage())
		return nil
	}
	n.ACKs++
	t.acks++
	n.Acked[typ] = req.GetVersionInfo()
	t.log.Debug("Envoy ACK", "node", n.ID, "type", typ, "version", req.GetVersionInfo())
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
	t.mu.Lock()
	defer t.mu.Unlock()
	if st := t.streams[id]; st != nil {
		st.nonces[resp.GetTypeUrl()] = sent{nonce: resp.GetNonce(), version: resp.GetVersionInfo()}
	}
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
