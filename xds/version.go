package xds

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"sort"
	"strings"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
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
	h := sha256.New()
	opts := proto.MarshalOptions{Deterministic: true}
	var n [8]byte
	for _, r := range items {
		b, err := opts.Marshal(r)
		if err != nil {
			return "", fmt.Errorf("encode %T: %w", r, err)
		}
		binary.BigEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	sum := h.Sum(nil)
	return hex.EncodeToString(sum[:12]), nil
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

// resourceVersions returns the version of every type in res, keyed by type
// URL.
func resourceVersions(res translator.Resources) (map[string]string, error) {
	out := make(map[string]string, len(res))
	for typ, items := range res {
		v, err := contentVersion(items)
		if err != nil {
			return nil, err
		}
		out[typ] = v
	}
	for typ, dep := range dependsOn {
		if v, ok := out[typ]; ok {
			sum := sha256.Sum256([]byte(v + "/" + out[dep]))
			out[typ] = hex.EncodeToString(sum[:12])
		}
	}
	return out, nil
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
