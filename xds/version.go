package xds

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"sort"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"

	"github.com/switchyard/switchyard/xds/translator"
)

// Versions are content addresses: the version of a resource type is a hash
// of every resource of that type, so
//   - the same content always has the same version, in every process:
//     replicas serving the same configuration hand Envoy the same versions,
//     an Envoy that reconnects to another replica (or to a restarted one)
//     with the same content gets nothing new, and a change of one type
//     (endpoints, say) bumps only that type's version, so Envoy is not sent
//     the unchanged listeners, routes and clusters again;
//   - different content never gets a version it had before (Envoy ignores
//     a response whose version equals the one it holds), without any
//     counter to persist.
//
// The hash covers each resource's deterministic protobuf encoding (the
// translator packs Any fields deterministically too); 96 bits make a
// collision between two configurations practically impossible.
func contentVersion(items []types.Resource) (string, error) {
	v, _, err := contentVersions(items)
	return v, err
}

// contentVersions returns the version of a type (as contentVersion) and
// the version of each of its resources by name: the hash of the
// resource's own encoding. Each resource is encoded once for both.
func contentVersions(items []types.Resource) (string, map[string]string, error) {
	h := sha256.New()
	opts := proto.MarshalOptions{Deterministic: true}
	per := make(map[string]string, len(items))
	var n [8]byte
	var buf []byte
	for _, r := range items {
		b, err := opts.MarshalAppend(buf[:0], r)
		if err != nil {
			return "", nil, fmt.Errorf("encode %T: %w", r, err)
		}
		buf = b
		binary.BigEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
		// What go-control-plane sends Envoy as the resource's version.
		per[cachev3.GetResourceName(r)] = cachev3.HashResource(b)
	}
	sum := h.Sum(nil)
	return hex.EncodeToString(sum[:12]), per, nil
}

// dependsOn lists, for a resource type, the type whose version its own
// version includes. Envoy fetches endpoints for a new or changed cluster
// (and routes for a new or changed listener) with the version it already
// holds; an endpoints version that did not move would get no answer from
// the snapshot cache when the request names nothing new (a second cluster
// sharing a ClusterLoadAssignment through service_name), leaving the
// cluster warming. Folding the cluster version into the endpoint version
// (and the listener version into the route version) re-sends them after
// every such change, while an endpoints-only change still moves only the
// endpoints' version.
var dependsOn = map[string]string{
	resource.EndpointType: resource.ClusterType,
	resource.RouteType:    resource.ListenerType,
}

// versions are a snapshot's versions: one per type (what state-of-the-world
// responses carry) and one per resource (what incremental xDS compares).
type versions struct {
	// types maps a type URL to its version.
	types map[string]string
	// resources maps a type URL to its resources' versions by name.
	resources map[string]map[string]string
}

// resourceVersions returns the versions of res. A type's version folds in
// the version of the type it depends on (dependsOn). A resource's version
// is the hash of its encoding (the version go-control-plane sends Envoy
// with it), folding in, for a ClusterLoadAssignment, the versions of the
// clusters that name it, and for a route configuration those of the
// listeners that name it. Envoy, on incremental xDS, does not fetch a
// resource it already holds when a new or changed cluster (or listener)
// subscribes to it again: that cluster would stay warming until its
// initial fetch timeout. Folding moves the version of exactly the
// resources such a change needs sent again. The price: an incremental
// Envoy reconnecting reports the plain hashes, so it is sent its
// endpoints and routes again (never its clusters and listeners).
func resourceVersions(res translator.Resources) (versions, error) {
	out := versions{types: make(map[string]string, len(res)), resources: make(map[string]map[string]string, len(res))}
	for typ, items := range res {
		v, per, err := contentVersions(items)
		if err != nil {
			return versions{}, err
		}
		out.types[typ] = v
		out.resources[typ] = per
	}
	for typ, dep := range dependsOn {
		if v, ok := out.types[typ]; ok {
			sum := sha256.Sum256([]byte(v + "/" + out.types[dep]))
			out.types[typ] = hex.EncodeToString(sum[:12])
		}
	}
	fold := func(typ, dep string, refs map[string][]string) {
		per := out.resources[typ]
		for name, v := range per {
			by := refs[name]
			if len(by) == 0 {
				continue
			}
			sort.Strings(by)
			h := sha256.New()
			h.Write([]byte(v))
			for _, r := range by {
				h.Write([]byte("/" + r + "=" + out.resources[dep][r]))
			}
			per[name] = hex.EncodeToString(h.Sum(nil))
		}
	}
	fold(resource.EndpointType, resource.ClusterType, edsReferences(res[resource.ClusterType]))
	fold(resource.RouteType, resource.ListenerType, rdsReferences(res[resource.ListenerType]))
	return out, nil
}

// edsReferences maps a ClusterLoadAssignment name to the EDS clusters
// that name it (their service_name, or their own name).
func edsReferences(clusters []types.Resource) map[string][]string {
	refs := map[string][]string{}
	for _, r := range clusters {
		c, ok := r.(*clusterv3.Cluster)
		if !ok || c.GetType() != clusterv3.Cluster_EDS {
			continue
		}
		name := c.GetEdsClusterConfig().GetServiceName()
		if name == "" {
			name = c.GetName()
		}
		refs[name] = append(refs[name], c.GetName())
	}
	return refs
}

// rdsReferences maps a route configuration name to the listeners whose
// HTTP connection managers name it.
func rdsReferences(listeners []types.Resource) map[string][]string {
	refs := map[string][]string{}
	for _, r := range listeners {
		l, ok := r.(*listenerv3.Listener)
		if !ok {
			continue
		}
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				var hcm hcmv3.HttpConnectionManager
				if f.GetTypedConfig().UnmarshalTo(&hcm) != nil {
					continue
				}
				if n := hcm.GetRds().GetRouteConfigName(); n != "" {
					refs[n] = append(refs[n], l.GetName())
				}
			}
		}
	}
	return refs
}

// summaryVersion names a whole snapshot in one string for logs and the
// status page: the short type names and versions, sorted.
func summaryVersion(versions map[string]string) string {
	parts := make([]string, 0, len(versions))
	for typ, v := range versions {
		parts = append(parts, shortType(typ)+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}
