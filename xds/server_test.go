package xds

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/switchyard/switchyard/internal/adsclient"
	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

// runServer runs a Server without gRPC until the test ends.
func runServer(t *testing.T, view registry.View, opts Options) *Server {
	t.Helper()
	srv := NewServer(view, opts, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return srv
}

func waitRegistryVersion(t *testing.T, srv *Server, v uint64) Stats {
	t.Helper()
	var st Stats
	testutil.Eventually(t, 5*time.Second, fmt.Sprintf("registry version %d translated", v), func() error {
		st = srv.Stats()
		if st.RegistryVersion != v {
			return fmt.Errorf("at registry version %d", st.RegistryVersion)
		}
		return nil
	})
	return st
}

func servedEndpoints(t *testing.T, srv *Server, cluster string) []string {
	t.Helper()
	snap, err := srv.cache.GetSnapshot(DefaultNodeKey)
	if err != nil {
		t.Fatal(err)
	}
	cla, ok := snap.GetResources(resource.EndpointType)[cluster].(*endpointv3.ClusterLoadAssignment)
	if !ok {
		t.Fatalf("no ClusterLoadAssignment %q", cluster)
	}
	var out []string
	for _, l := range cla.GetEndpoints() {
		for _, e := range l.GetLbEndpoints() {
			sa := e.GetEndpoint().GetAddress().GetSocketAddress()
			out = append(out, fmt.Sprintf("%s:%d", sa.GetAddress(), sa.GetPortValue()))
		}
	}
	sort.Strings(out)
	return out
}

func TestServerKeepsLastSnapshotOnBadState(t *testing.T) {
	good := newState(1, "127.0.0.1:8080", pool("llama", registry.FailClosed, "10.0.0.1:8000"))
	pub := registry.NewPublisher(good)
	srv := runServer(t, pub, Options{})
	first := waitRegistryVersion(t, srv, 1)
	if first.Version == "" || first.Snapshots != 1 {
		t.Fatalf("first stats = %+v", first)
	}

	bad := newState(2, "not-an-address", pool("llama", registry.FailClosed, "10.0.0.2:8000"))
	pub.Publish(bad)
	st := waitRegistryVersion(t, srv, 2)
	if st.Failures != 1 || st.Version != first.Version || !strings.Contains(st.LastError, "not-an-address") {
		t.Fatalf("after bad state: %+v", st)
	}
	if got := servedEndpoints(t, srv, "pool/llama"); strings.Join(got, ",") != "10.0.0.1:8000" {
		t.Fatalf("served endpoints = %v, want the last good ones", got)
	}

	pub.Publish(newState(3, "127.0.0.1:8080", pool("llama", registry.FailClosed, "10.0.0.2:8000")))
	st = waitRegistryVersion(t, srv, 3)
	if st.Version == first.Version || st.LastError != "" || st.Snapshots != 2 {
		t.Fatalf("after recovery: %+v", st)
	}
}

func TestServerSkipsUnchangedResources(t *testing.T) {
	pub := registry.NewPublisher(newState(1, "127.0.0.1:8080", pool("llama", registry.FailClosed, "10.0.0.1:8000")))
	srv := runServer(t, pub, Options{})
	first := waitRegistryVersion(t, srv, 1)
	// A new registry version whose Envoy-visible content is identical
	// (only the scrape path changed) must not push a new xDS version.
	p := pool("llama", registry.FailClosed, "10.0.0.1:8000")
	p.MetricsPath = "/other"
	pub.Publish(newState(2, "127.0.0.1:8080", p))
	st := waitRegistryVersion(t, srv, 2)
	if st.Version != first.Version || st.Unchanged != 1 || st.Snapshots != 1 {
		t.Fatalf("stats = %+v", st)
	}
	// What is served is the translation of version 2 as well.
	if first.ServedRegistryVersion != 1 || st.ServedRegistryVersion != 2 {
		t.Fatalf("served registry version %d then %d, want 1 then 2", first.ServedRegistryVersion, st.ServedRegistryVersion)
	}
}

// TestHoldServing: the ADS health service reports SERVING only with a
// snapshot, neither held nor draining.
func TestHoldServing(t *testing.T) {
	pub := registry.NewPublisher(nil)
	srv := NewServer(pub, Options{}, nil)
	serving := func() bool {
		r, err := srv.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: HealthService})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}
	srv.HoldServing()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	pub.Publish(newState(1, "127.0.0.1:8080"))
	waitRegistryVersion(t, srv, 1)
	if serving() {
		t.Fatal("held server with a snapshot serving")
	}
	srv.ReleaseServing()
	if !serving() {
		t.Fatal("released server with a snapshot not serving")
	}
	srv.SetServing(false)
	srv.ReleaseServing()
	if serving() {
		t.Fatal("draining server serving after a release")
	}
}

// TestServerWithholdsUnhealthyEndpoints: endpoint health arrives in the
// registry state (Endpoint.ScrapeFailing) like any other change.
func TestServerWithholdsUnhealthyEndpoints(t *testing.T) {
	st := func(v uint64, failing bool) *registry.State {
		p := pool("llama", registry.FailClosed, "10.0.0.1:8000", "10.0.0.2:8000")
		p.Endpoints[1].ScrapeFailing = failing
		return newState(v, "127.0.0.1:8080", p)
	}
	pub := registry.NewPublisher(st(1, false))
	srv := runServer(t, pub, Options{})
	waitRegistryVersion(t, srv, 1)
	if got := servedEndpoints(t, srv, "pool/llama"); len(got) != 2 {
		t.Fatalf("endpoints = %v", got)
	}
	pub.Publish(st(2, true))
	testutil.Eventually(t, 5*time.Second, "unhealthy endpoint withheld", func() error {
		if got := servedEndpoints(t, srv, "pool/llama"); strings.Join(got, ",") != "10.0.0.1:8000" {
			return fmt.Errorf("endpoints = %v", got)
		}
		return nil
	})
	pub.Publish(st(3, false))
	testutil.Eventually(t, 5*time.Second, "recovered endpoint served again", func() error {
		if got := servedEndpoints(t, srv, "pool/llama"); len(got) != 2 {
			return fmt.Errorf("endpoints = %v", got)
		}
		return nil
	})
}

// TestVersionsAreContentAddresses: two servers (replicas, or one before
// and after a restart) serving the same state serve the same versions; a
// change of endpoints only changes the endpoints' version; a different
// configuration never gets a version it had before.
func TestVersionsAreContentAddresses(t *testing.T) {
	mk := func(v uint64, addrs ...string) *registry.State {
		return newState(v, "127.0.0.1:8080", pool("llama", registry.FailClosed, addrs...))
	}
	pubA := registry.NewPublisher(mk(1, "10.0.0.1:8000", "10.0.0.2:8000"))
	pubB := registry.NewPublisher(mk(7, "10.0.0.1:8000", "10.0.0.2:8000")) // another registry version, same content
	a, b := runServer(t, pubA, Options{}), runServer(t, pubB, Options{})
	va, vb := waitRegistryVersion(t, a, 1), waitRegistryVersion(t, b, 7)
	if va.Version == "" || !maps.Equal(va.Versions, vb.Versions) {
		t.Fatalf("same content, different versions:\n%v\n%v", va.Versions, vb.Versions)
	}
	if len(va.Versions) != 4 {
		t.Fatalf("versions %v, want one per resource type", va.Versions)
	}
	seen := map[string]string{va.Versions["ClusterLoadAssignment"]: "two endpoints"}

	// Endpoints change: only the endpoints' version moves.
	pubA.Publish(mk(2, "10.0.0.1:8000"))
	v2 := waitRegistryVersion(t, a, 2)
	for typ, v := range v2.Versions {
		if changed := v != va.Versions[typ]; changed != (typ == "ClusterLoadAssignment") {
			t.Errorf("%s version %q -> %q after an endpoints-only change", typ, va.Versions[typ], v)
		}
	}
	if prev, ok := seen[v2.Versions["ClusterLoadAssignment"]]; ok {
		t.Fatalf("one endpoint got the version of %s", prev)
	}
	// Back to the first content: the first versions again.
	pubA.Publish(mk(3, "10.0.0.1:8000", "10.0.0.2:8000"))
	if v3 := waitRegistryVersion(t, a, 3); !maps.Equal(v3.Versions, va.Versions) {
		t.Fatalf("the first content again: %v, want %v", v3.Versions, va.Versions)
	}
}

func TestTrackerClassifiesACKAndNACK(t *testing.T) {
	tr := newTracker(testLogger(t), nil)
	cb := tr.callbacks()
	ctx := context.Background()
	const cds = resource.ClusterType
	node := &corev3.Node{Id: "edge-1", Cluster: "fleet"}
	if err := cb.OnStreamOpen(ctx, 7, ""); err != nil {
		t.Fatal(err)
	}
	// Initial request: neither ACK nor NACK.
	_ = cb.OnStreamRequest(7, &discoveryv3.DiscoveryRequest{Node: node, TypeUrl: cds})
	cb.OnStreamResponse(ctx, 7, nil, &discoveryv3.DiscoveryResponse{TypeUrl: cds, VersionInfo: "v1", Nonce: "n1"})
	_ = cb.OnStreamRequest(7, &discoveryv3.DiscoveryRequest{TypeUrl: cds, VersionInfo: "v1", ResponseNonce: "n1"})
	cb.OnStreamResponse(ctx, 7, nil, &discoveryv3.DiscoveryResponse{TypeUrl: cds, VersionInfo: "v2", Nonce: "n2"})
	// A stale nonce is ignored.
	_ = cb.OnStreamRequest(7, &discoveryv3.DiscoveryRequest{TypeUrl: cds, VersionInfo: "v1", ResponseNonce: "n1"})
	_ = cb.OnStreamRequest(7, &discoveryv3.DiscoveryRequest{TypeUrl: cds, VersionInfo: "v1", ResponseNonce: "n2",
		ErrorDetail: &status.Status{Message: "bad cluster"}})

	acks, nacks := tr.totals()
	if acks != 1 || nacks != 1 {
		t.Fatalf("acks=%d nacks=%d, want 1 and 1", acks, nacks)
	}
	nodes := tr.snapshot()
	if len(nodes) != 1 {
		t.Fatalf("nodes = %+v", nodes)
	}
	n := nodes[0]
	if n.ID != "edge-1" || n.Cluster != "fleet" || n.Streams != 1 || n.Acked["Cluster"] != "v1" || n.LastNACK != "bad cluster" {
		t.Fatalf("node = %+v", n)
	}
	cb.OnStreamClosed(7, node)
	if got := tr.snapshot()[0].Streams; got != 0 {
		t.Fatalf("streams after close = %d", got)
	}
}

func TestServerWaitsForFirstRegistryState(t *testing.T) {
	pub := registry.NewPublisher(nil) // Empty(), version 0
	srv := runServer(t, pub, Options{})
	testutil.Eventually(t, 5*time.Second, "first attempt", func() error {
		if srv.Stats().Attempts == 0 {
			return fmt.Errorf("no attempt yet")
		}
		return nil
	})
	if _, err := srv.cache.GetSnapshot(DefaultNodeKey); err == nil || srv.Stats().Version != "" {
		t.Fatalf("served a snapshot for the unpublished empty state: %+v", srv.Stats())
	}
	pub.Publish(newState(1, "127.0.0.1:8080"))
	if st := waitRegistryVersion(t, srv, 1); st.Version == "" || st.Snapshots != 1 {
		t.Fatalf("stats = %+v", st)
	}
}

// A client is sent only the endpoints that changed, on either protocol:
// one endpoint change sends one ClusterLoadAssignment; a pool's cluster
// change also re-sends that pool's ClusterLoadAssignment (Envoy would
// otherwise leave the changed cluster warming), and no other.
func TestOnlyChangedEndpointsAreSent(t *testing.T) {
	const listen = "127.0.0.1:8080"
	st := func(v uint64, modeA registry.FailureMode, b ...string) *registry.State {
		return newState(v, listen, pool("a", modeA, "10.0.0.1:8000"), pool("b", registry.FailClosed, b...))
	}
	pub := registry.NewPublisher(st(1, registry.FailClosed, "10.0.1.1:8000", "10.0.1.2:8000"))
	srv, addr := startXDS(t, pub, Options{})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	delta := adsclient.Start(ctx, conn, adsclient.Options{NodeID: "delta", Delta: true})
	sotw := adsclient.Start(ctx, conn, adsclient.Options{NodeID: "sotw"})
	for _, c := range []*adsclient.Client{delta, sotw} {
		if _, err := c.Wait(ctx, adsclient.View.Synced); err != nil {
			t.Fatal(err)
		}
	}
	has := func(cluster string, n int) func(adsclient.View) bool {
		return func(v adsclient.View) bool { e, ok := v.Endpoints(cluster); return ok && len(e) == n }
	}
	eds := func(c *adsclient.Client) adsclient.TypeStats { return c.Stats()[resource.EndpointType] }

	d0, s0 := eds(delta), eds(sotw)
	pub.Publish(st(2, registry.FailClosed, "10.0.1.1:8000"))
	for _, c := range []*adsclient.Client{delta, sotw} {
		if _, err := c.Wait(ctx, has(ir.ClusterName("b"), 1)); err != nil {
			t.Fatal(err)
		}
	}
	d1, s1 := eds(delta), eds(sotw)
	if got := d1.Resources - d0.Resources; got != 1 || d1.Responses-d0.Responses != 1 {
		t.Fatalf("incremental: %d assignments in %d responses for one endpoint change, want 1 in 1", got, d1.Responses-d0.Responses)
	}
	if got := s1.Resources - s0.Resources; got != 1 || s1.Responses-s0.Responses != 1 {
		t.Fatalf("state of the world: %d assignments in %d responses for one endpoint change, want 1 in 1", got, s1.Responses-s0.Responses)
	}

	// Pool a fails open: a new cluster names a's assignment, which is
	// re-sent; b's is not.
	pub.Publish(st(3, registry.FailOpen, "10.0.1.1:8000"))
	if _, err := delta.Wait(ctx, func(v adsclient.View) bool {
		return slices.Contains(v.Clusters(), ir.FailOpenClusterName("a")) && v.Stats(resource.EndpointType).Resources > d1.Resources
	}); err != nil {
		t.Fatal(err)
	}
	if d2 := eds(delta); d2.Resources-d1.Resources != 1 {
		t.Fatalf("incremental: %d assignments re-sent after pool a's cluster change, want 1", d2.Resources-d1.Resources)
	}
	if _, err := sotw.Wait(ctx, func(v adsclient.View) bool {
		return slices.Contains(v.Clusters(), ir.FailOpenClusterName("a")) && v.Stats(resource.EndpointType).Resources > s1.Resources
	}); err != nil {
		t.Fatal(err)
	}
	if s2 := eds(sotw); s2.Resources-s1.Resources != 1 {
		t.Fatalf("state of the world: %d assignments re-sent after pool a's cluster change, want 1", s2.Resources-s1.Resources)
	}
	// Every pool keeps its endpoints on both clients.
	for _, c := range []*adsclient.Client{delta, sotw} {
		if _, err := c.Wait(ctx, func(v adsclient.View) bool {
			return has(ir.ClusterName("a"), 1)(v) && has(ir.ClusterName("b"), 1)(v)
		}); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 5*time.Second, "both nodes ACKed the served versions", func() error {
		want := srv.Stats().Versions
		for _, n := range srv.Nodes() {
			if !maps.Equal(n.Acked, want) {
				return fmt.Errorf("node %s (%s) holds %v, want %v", n.ID, n.Protocol, n.Acked, want)
			}
		}
		if len(srv.Nodes()) != 2 {
			return fmt.Errorf("%d nodes", len(srv.Nodes()))
		}
		return nil
	})
}
