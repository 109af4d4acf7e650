// Package contract holds the wire names the picker and the xDS translator
// must agree on: the Endpoint Picker Protocol's headers and dynamic
// metadata keys, switchyard's own headers, and the Envoy cluster names the
// translator generates and the picker's health service. Each name is
// defined here once; picker and xds refer to it, so neither side can
// drift from the other.
package contract

// Endpoint Picker Protocol names (the picker sets them, Envoy reads them).
const (
	// DestinationHeader and DestinationKey carry the picked "ip:port"
	// list, as a request header and as dynamic metadata in LBNamespace.
	DestinationHeader = "x-gateway-destination-endpoint"
	DestinationKey    = "x-gateway-destination-endpoint"
	// SubsetHeader and SubsetKey carry a subset hint (the endpoints the
	// request may go to) given to the picker.
	SubsetHeader = "x-gateway-destination-endpoint-subset"
	SubsetKey    = "x-gateway-destination-endpoint-subset"
	// ServedHeader and ServedKey report the host Envoy actually served
	// from.
	ServedHeader = "x-gateway-destination-endpoint-served"
	ServedKey    = "x-gateway-destination-endpoint-served"
	// LBNamespace is the dynamic metadata namespace override_host reads.
	LBNamespace = "envoy.lb"
	// SubsetHintNamespace is the namespace of the subset hint.
	SubsetHintNamespace = "envoy.lb.subset_hint"
)

// switchyard's own names.
const (
	// PoolHeader is the request header the picker sets to the chosen
	// pool; routes match on it.
	PoolHeader = "x-switchyard-pool"
	// PickerCluster is the Envoy cluster of the picker's gRPC servers.
	PickerCluster = "switchyard/picker"
	// TracingCluster is the OTLP collector Envoy sends its spans to.
	TracingCluster = "switchyard/otlp"
	// PickerHealthService is the gRPC health service Envoy checks on the
	// picker; it turns SERVING once the picker has pool state.
	PickerHealthService = "envoy.service.ext_proc.v3.ExternalProcessor"
	// ModelNamespace and ModelKey name the dynamic metadata Envoy fills
	// itself from the request body's top-level "model", for routing
	// without the picker.
	ModelNamespace = "switchyard"
	ModelKey       = "model"
	// PDNamespace is the dynamic metadata namespace of the picker's
	// prefill/decode decision (keys decision, prefill, uncached_tokens),
	// for access logs; Envoy keeps it only when ext_proc's receiving
	// namespaces list it.
	PDNamespace = "switchyard.pd"
)
