// Package quality owns the picker's routing-quality harness: it runs real
// cmd/vllm-sim processes behind the picker and drives them with
// cmd/loadgen's load.Run, comparing scheduling profiles by time to first
// token, throughput and prefix-cache hit rate. Everything lives in its
// tests:
//
//	go test ./picker/quality -run QualitySmoke            # seconds, in the normal suite
//	SWITCHYARD_QUALITY=1 go test ./picker/quality -run 'Quality$' -v -timeout 30m
//
// Requests reach the simulators through a small in-process data plane
// (proxy_test.go) that speaks ext_proc to the picker over real gRPC exactly
// as Envoy does in FULL_DUPLEX_STREAMED mode (request headers and body,
// then response headers and end of stream), then forwards to the first
// endpoint of x-gateway-destination-endpoint. It replaces Envoy because a
// 2-core machine cannot run Envoy, the picker, four simulators and the
// load generator at these rates without the proxy becoming the bottleneck;
// the picker's Envoy wiring is covered by picker/envoy_test.go.
package quality
