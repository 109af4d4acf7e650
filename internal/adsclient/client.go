// Package adsclient is a small Envoy-like ADS client for tests and
// benchmarks: it subscribes to listeners and clusters, follows them to
// their routes and endpoints as Envoy does, ACKs every response, and
// records what it received (resources, responses, bytes) so a caller can
// wait for a state and measure what reaching it cost. It speaks both the
// state-of-the-world protocol (StreamAggregatedResources) and incremental
// xDS (DeltaAggregatedResources).
package adsclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// The four types an Envoy fetches from switchyard, in ADS order.
var Types = []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType}

// Options configure a Client.
type Options struct {
	// NodeID is sent in the first request (Envoy's node.id).
	NodeID string
	// Delta selects incremental xDS instead of state of the world.
	Delta bool
}

// TypeStats is what a client received for one resource type.
type TypeStats struct {
	// Responses counts responses received.
	Responses int
	// Bytes sums the responses' encoded sizes.
	Bytes int64
	// Resources counts resources carried (changed or not); Removed counts
	// removals (delta only).
	Resources int
	Removed   int
	// Version is the version (SotW version_info, delta
	// system_version_info) of the latest response.
	Version string
	// Last is when the latest response arrived.
	Last time.Time
}

// Client is one ADS stream. Its methods are safe for concurrent use.
type Client struct {
	opts Options

	mu        sync.Mutex
	changed   chan struct{}
	clusters  map[string]*clusterv3.Cluster
	listeners map[string]*listenerv3.Listener
	routes    map[string]*routev3.RouteConfiguration
	// endpoints maps a ClusterLoadAssignment name to its addresses
	// ("ip:port"), sorted.
	endpoints map[string][]string
	stats     map[string]*TypeStats
	err       error
	done      chan struct{}
}

// Start opens the ADS stream on conn and runs the client until ctx ends or
// the stream fails (Err says why).
func Start(ctx context.Context, conn grpc.ClientConnInterface, opts Options) *Client {
	c := &Client{
		opts:      opts,
		changed:   make(chan struct{}),
		clusters:  map[string]*clusterv3.Cluster{},
		listeners: map[string]*listenerv3.Listener{},
		routes:    map[string]*routev3.RouteConfiguration{},
		endpoints: map[string][]string{},
		stats:     map[string]*TypeStats{},
		done:      make(chan struct{}),
	}
	for _, t := range Types {
		c.stats[t] = &TypeStats{}
	}
	go func() {
		defer close(c.done)
		ads := discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
		var err error
		if opts.Delta {
			err = c.runDelta(ctx, ads)
		} else {
			err = c.runSotW(ctx, ads)
		}
		c.mu.Lock()
		if ctx.Err() == nil {
			c.err = err
		}
		c.notifyLocked()
		c.mu.Unlock()
	}()
	return c
}

// Done is closed when the client has stopped.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err is why the client stopped (nil while running or after ctx ended).
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *Client) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// View is a consistent look at what a client holds, for Wait predicates.
type View struct {
	c *Client
}

// Endpoints returns the addresses of ClusterLoadAssignment name.
func (v View) Endpoints(name string) ([]string, bool) {
	e, ok := v.c.endpoints[name]
	return e, ok
}

// Clusters returns the names of the clusters held.
func (v View) Clusters() []string { return slices.Sorted(maps.Keys(v.c.clusters)) }

// Synced reports whether the client holds every resource the clusters and
// listeners it holds refer to: what Envoy needs to finish warming.
func (v View) Synced() bool {
	if len(v.c.clusters) == 0 || len(v.c.listeners) == 0 {
		return false
	}
	for _, n := range edsNames(v.c.clusters) {
		if _, ok := v.c.endpoints[n]; !ok {
			return false
		}
	}
	for _, n := range rdsNames(v.c.listeners) {
		if _, ok := v.c.routes[n]; !ok {
			return false
		}
	}
	return true
}

// Stats returns the client's statistics for typeURL.
func (v View) Stats(typeURL string) TypeStats { return *v.c.stats[typeURL] }

// Wait blocks until ok holds for the client's state and returns when it
// first did (the arrival of the response that made it hold), or an error
// when ctx ends or the client stops first.
func (c *Client) Wait(ctx context.Context, ok func(View) bool) (time.Time, error) {
	for {
		c.mu.Lock()
		if ok(View{c}) {
			at := c.lastLocked()
			c.mu.Unlock()
			return at, nil
		}
		ch, err := c.changed, c.err
		c.mu.Unlock()
		if err != nil {
			return time.Time{}, err
		}
		select {
		case <-ch:
		case <-c.done:
			c.mu.Lock()
			err := c.err
			c.mu.Unlock()
			if err == nil {
				err = errors.New("client stopped")
			}
			return time.Time{}, err
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
}

// Stats returns a copy of every type's statistics.
func (c *Client) Stats() map[string]TypeStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]TypeStats, len(c.stats))
	for t, s := range c.stats {
		out[t] = *s
	}
	return out
}

func (c *Client) lastLocked() time.Time {
	var at time.Time
	for _, s := range c.stats {
		if s.Last.After(at) {
			at = s.Last
		}
	}
	return at
}

func (c *Client) node() *corev3.Node {
	return &corev3.Node{Id: c.opts.NodeID, Cluster: "adsclient", UserAgentName: "adsclient"}
}

// apply records one response's resources (added or replaced) and removals
// and returns the names it now wants of the dependent types.
func (c *Client) apply(typeURL string, size int, version string, sotw bool, added []*anypb.Any, removed []string) error {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.stats[typeURL]
	if st == nil {
		return fmt.Errorf("unexpected type %s", typeURL)
	}
	st.Responses++
	st.Bytes += int64(size)
	st.Resources += len(added)
	st.Removed += len(removed)
	st.Version = version
	st.Last = now
	switch typeURL {
	case resource.ClusterType:
		if sotw {
			clear(c.clusters)
		}
		for _, a := range added {
			var m clusterv3.Cluster
			if err := a.UnmarshalTo(&m); err != nil {
				return fmt.Errorf("cluster: %w", err)
			}
			c.clusters[m.GetName()] = &m
		}
		for _, n := range removed {
			delete(c.clusters, n)
		}
	case resource.ListenerType:
		if sotw {
			clear(c.listeners)
		}
		for _, a := range added {
			var m listenerv3.Listener
			if err := a.UnmarshalTo(&m); err != nil {
				return fmt.Errorf("listener: %w", err)
			}
			c.listeners[m.GetName()] = &m
		}
		for _, n := range removed {
			delete(c.listeners, n)
		}
	case resource.RouteType:
		// Routes and endpoints are not state-of-the-world types: a
		// response carries the resources it updates, and the others stay
		// (as Envoy does).
		for _, a := range added {
			var m routev3.RouteConfiguration
			if err := a.UnmarshalTo(&m); err != nil {
				return fmt.Errorf("route: %w", err)
			}
			c.routes[m.GetName()] = &m
		}
		for _, n := range removed {
			delete(c.routes, n)
		}
	case resource.EndpointType:
		for _, a := range added {
			var m endpointv3.ClusterLoadAssignment
			if err := a.UnmarshalTo(&m); err != nil {
				return fmt.Errorf("endpoints: %w", err)
			}
			var addrs []string
			for _, l := range m.GetEndpoints() {
				for _, e := range l.GetLbEndpoints() {
					sa := e.GetEndpoint().GetAddress().GetSocketAddress()
					addrs = append(addrs, joinHostPort(sa.GetAddress(), sa.GetPortValue()))
				}
			}
			slices.Sort(addrs)
			c.endpoints[m.GetClusterName()] = addrs
		}
		for _, n := range removed {
			delete(c.endpoints, n)
		}
	}
	c.notifyLocked()
	return nil
}

func joinHostPort(host string, port uint32) string {
	for i := 0; i < len(host); i++ {
		if host[i] == ':' {
			return fmt.Sprintf("[%s]:%d", host, port)
		}
	}
	return fmt.Sprintf("%s:%d", host, port)
}

// wanted returns the names of typeURL's resources the held clusters or
// listeners refer to (nil for the wildcard types).
func (c *Client) wanted(typeURL string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch typeURL {
	case resource.EndpointType:
		return edsNames(c.clusters)
	case resource.RouteType:
		return rdsNames(c.listeners)
	}
	return nil
}

// edsNames lists the ClusterLoadAssignments EDS clusters refer to.
func edsNames(clusters map[string]*clusterv3.Cluster) []string {
	set := map[string]bool{}
	for name, cl := range clusters {
		if cl.GetType() != clusterv3.Cluster_EDS {
			continue
		}
		if sn := cl.GetEdsClusterConfig().GetServiceName(); sn != "" {
			name = sn
		}
		set[name] = true
	}
	return slices.Sorted(maps.Keys(set))
}

// rdsNames lists the route configurations listeners' HTTP connection
// managers refer to.
func rdsNames(listeners map[string]*listenerv3.Listener) []string {
	set := map[string]bool{}
	for _, l := range listeners {
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				var hcm hcmv3.HttpConnectionManager
				if f.GetTypedConfig().UnmarshalTo(&hcm) != nil {
					continue
				}
				if n := hcm.GetRds().GetRouteConfigName(); n != "" {
					set[n] = true
				}
			}
		}
	}
	return slices.Sorted(maps.Keys(set))
}

// dependent maps a type to the type whose names it determines.
var dependent = map[string]string{
	resource.ClusterType:  resource.EndpointType,
	resource.ListenerType: resource.RouteType,
}

// runSotW follows the state-of-the-world protocol as Envoy does on ADS:
// wildcard CDS and LDS, then EDS and RDS for the names they refer to; each
// response is ACKed with its version and nonce, and a changed name set is
// requested with the type's last ACKed version and nonce.
func (c *Client) runSotW(ctx context.Context, ads discoveryv3.AggregatedDiscoveryServiceClient) error {
	stream, err := ads.StreamAggregatedResources(ctx)
	if err != nil {
		return fmt.Errorf("open ADS stream: %w", err)
	}
	type typeState struct {
		version, nonce string
		names          []string
		requested      bool
	}
	state := map[string]*typeState{}
	for _, t := range Types {
		state[t] = &typeState{}
	}
	first := true
	send := func(typeURL string) error {
		st := state[typeURL]
		req := &discoveryv3.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: st.version, ResponseNonce: st.nonce, ResourceNames: st.names}
		if first {
			req.Node, first = c.node(), false
		}
		st.requested = true
		return stream.Send(req)
	}
	if err := send(resource.ClusterType); err != nil {
		return err
	}
	if err := send(resource.ListenerType); err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		typeURL := resp.GetTypeUrl()
		st := state[typeURL]
		if st == nil {
			return fmt.Errorf("response of unexpected type %s", typeURL)
		}
		if err := c.apply(typeURL, proto.Size(resp), resp.GetVersionInfo(), true, resp.GetResources(), nil); err != nil {
			return err
		}
		st.version, st.nonce = resp.GetVersionInfo(), resp.GetNonce()
		if err := send(typeURL); err != nil { // ACK
			return err
		}
		if dep, ok := dependent[typeURL]; ok {
			names := c.wanted(dep)
			ds := state[dep]
			if !ds.requested || !slices.Equal(names, ds.names) {
				ds.names = names
				if err := send(dep); err != nil {
					return err
				}
			}
		}
	}
}

// runDelta follows incremental xDS as Envoy does: wildcard CDS and LDS,
// then subscriptions to the EDS and RDS names they refer to, changed by
// subscribe/unsubscribe lists; each response is ACKed with its nonce.
func (c *Client) runDelta(ctx context.Context, ads discoveryv3.AggregatedDiscoveryServiceClient) error {
	stream, err := ads.DeltaAggregatedResources(ctx)
	if err != nil {
		return fmt.Errorf("open delta ADS stream: %w", err)
	}
	subscribed := map[string][]string{}
	first := true
	send := func(req *discoveryv3.DeltaDiscoveryRequest) error {
		if first {
			req.Node, first = c.node(), false
		}
		return stream.Send(req)
	}
	if err := send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType}); err != nil {
		return err
	}
	if err := send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resource.ListenerType}); err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		typeURL := resp.GetTypeUrl()
		added := make([]*anypb.Any, 0, len(resp.GetResources()))
		for _, r := range resp.GetResources() {
			added = append(added, r.GetResource())
		}
		if err := c.apply(typeURL, proto.Size(resp), resp.GetSystemVersionInfo(), false, added, resp.GetRemovedResources()); err != nil {
			return err
		}
		if err := send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce()}); err != nil { // ACK
			return err
		}
		if dep, ok := dependent[typeURL]; ok {
			names := c.wanted(dep)
			old, had := subscribed[dep]
			if had && slices.Equal(old, names) {
				continue
			}
			var sub, unsub []string
			for _, n := range names {
				if !slices.Contains(old, n) {
					sub = append(sub, n)
				}
			}
			for _, n := range old {
				if !slices.Contains(names, n) {
					unsub = append(unsub, n)
				}
			}
			subscribed[dep] = names
			if len(sub) == 0 && len(unsub) == 0 {
				continue
			}
			if err := send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: dep, ResourceNamesSubscribe: sub, ResourceNamesUnsubscribe: unsub}); err != nil {
				return err
			}
		}
	}
}
