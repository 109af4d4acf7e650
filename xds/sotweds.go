package xds

import (
	"context"
	"errors"
	"fmt"
	"sync"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// sotwEndpoints serves ClusterLoadAssignments to state-of-the-world
// streams, sending each only the assignments that changed since what it
// was last sent. The protocol allows it: only listeners and clusters must
// come whole in every response; an endpoints response names the
// assignments it updates, and Envoy keeps the others (a cluster whose
// assignment a response lacks keeps its hosts). go-control-plane's
// snapshot cache re-sends every assignment on any change: at 1,000
// endpoints in 20 pools, 24 KiB to every Envoy for one endpoint. Each
// assignment is also encoded once per version and shared by every
// stream's response, where the snapshot cache encodes it per stream.
//
// Versions are the snapshot's: the response version is the endpoint
// type's (a content address, the same in every replica), an assignment's
// the one resourceVersions gives it (folding in its clusters', so a new
// or changed cluster gets its assignment again). Incremental streams are
// served by the snapshot cache, which holds the same assignments.
type sotwEndpoints struct {
	mu      sync.Mutex
	version string
	entries map[string]endpointEntry
	watches map[uint64]endpointWatch
	nextID  uint64
}

type endpointEntry struct {
	version string
	any     *anypb.Any
}

type endpointWatch struct {
	req *cachev3.Request
	sub cachev3.Subscription
	out chan cachev3.Response
}

var _ cachev3.Cache = (*sotwEndpoints)(nil)

func newSotwEndpoints() *sotwEndpoints {
	return &sotwEndpoints{entries: map[string]endpointEntry{}, watches: map[uint64]endpointWatch{}}
}

// set makes items (with their versions, by name) the served assignments
// under version, and answers every waiting stream that is owed a change.
func (c *sotwEndpoints) set(version string, items []types.Resource, versions map[string]string) error {
	next := make(map[string]endpointEntry, len(items))
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range items {
		name := cachev3.GetResourceName(r)
		v := versions[name]
		if e, ok := c.entries[name]; ok && e.version == v {
			next[name] = e
			continue
		}
		a := &anypb.Any{}
		if err := anypb.MarshalFrom(a, r, proto.MarshalOptions{Deterministic: true}); err != nil {
			return fmt.Errorf("encode endpoints %q: %w", name, err)
		}
		next[name] = endpointEntry{version: v, any: a}
	}
	c.version, c.entries = version, next
	for id, w := range c.watches {
		if resp := c.responseLocked(w.req, w.sub); resp != nil {
			w.out <- resp
			delete(c.watches, id)
		}
	}
	return nil
}

// responseLocked returns the response owed to a stream subscribed as sub
// whose latest request is req, or nil when it is owed nothing.
func (c *sotwEndpoints) responseLocked(req *cachev3.Request, sub cachev3.Subscription) cachev3.Response {
	if c.version == "" {
		return nil
	}
	known := sub.ReturnedResources()
	if len(known) == 0 && req.GetVersionInfo() == c.version {
		// A stream reconnecting with the served version holds every
		// assignment: nothing to send.
		return nil
	}
	names := sub.SubscribedResources()
	if sub.IsWildcard() {
		names = make(map[string]struct{}, len(c.entries))
		for n := range c.entries {
			names[n] = struct{}{}
		}
	}
	var changed []*anypb.Any
	returned := make(map[string]string, len(names))
	for n := range names {
		e, ok := c.entries[n]
		if !ok {
			continue
		}
		if known[n] != e.version {
			changed = append(changed, e.any)
		}
		returned[n] = e.version
	}
	if len(changed) == 0 {
		return nil
	}
	return &cachev3.PassthroughResponse{
		Request:           req,
		ReturnedResources: returned,
		DiscoveryResponse: &discoveryv3.DiscoveryResponse{
			VersionInfo: c.version,
			TypeUrl:     resource.EndpointType,
			Resources:   changed,
		},
	}
}

// CreateWatch answers at once when the stream is owed a change, else
// waits for set.
func (c *sotwEndpoints) CreateWatch(req *cachev3.Request, sub cachev3.Subscription, out chan cachev3.Response) (func(), error) {
	if req.GetTypeUrl() != resource.EndpointType {
		return nil, fmt.Errorf("endpoints cache asked for %s", req.GetTypeUrl())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if resp := c.responseLocked(req, sub); resp != nil {
		out <- resp
		return func() {}, nil
	}
	c.nextID++
	id := c.nextID
	c.watches[id] = endpointWatch{req: req, sub: sub, out: out}
	return func() {
		c.mu.Lock()
		delete(c.watches, id)
		c.mu.Unlock()
	}, nil
}

// CreateDeltaWatch is not used: incremental streams go to the snapshot
// cache.
func (c *sotwEndpoints) CreateDeltaWatch(*cachev3.DeltaRequest, cachev3.Subscription, chan cachev3.DeltaResponse) (func(), error) {
	return nil, errors.New("endpoints cache serves state-of-the-world streams only")
}

// Fetch is not supported (REST xDS is not served).
func (c *sotwEndpoints) Fetch(context.Context, *cachev3.Request) (cachev3.Response, error) {
	return nil, errors.New("fetch is not supported")
}
