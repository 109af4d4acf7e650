// Package deploy owns the checks for switchyard's container deployment:
// docker-compose.yaml at the repository root, the Dockerfiles next to each
// command (cmd/switchyard/Dockerfile, cmd/vllm-sim/Dockerfile), .dockerignore,
// and the configuration the compose stack mounts from examples/compose/
// (switchyard HCL, Consul service definitions, the Envoy bootstrap).
//
// Most tests need no container engine: they load the compose file with
// the compose-spec reference parser (schema and cross-reference checks
// included), then check what a broken deployment would get wrong:
// services, images and build files, health checks, start and stop order,
// restart policies, published ports, each replica's command, certificate
// and store volume, static IPs that match the Consul registrations and the
// replicas' advertised addresses, an Envoy bootstrap that lists every
// replica, that every mounted file exists and is accepted by the program
// that reads it (switchyard validate, consul validate, envoy --mode
// validate), and that the Dockerfiles build the right command as a
// non-root user. One test runs what the stack runs on loopback: a real
// Consul with the simulators' definitions and both replicas with their
// compose commands, which register, list each other and admit each
// other's certificates.
//
// TestComposeStack runs the stack itself in a real engine (package
// composetest; `make test` installs the engine, Compose v2 and stand-ins
// for the images with deploy/engine/install.sh): moved to a free subnet
// and loopback ports under a project name of its own, it answers through
// Envoy and survives the faults docs/deployment.md lists, with the failed
// requests counted.
//
// TestMultihost runs the multi-host example (examples/multihost, one
// compose file per role) as eight hosts: compose projects on Docker
// networks of their own joined by a router container, so partitions and
// lost hosts are cut in the router; it counts the failed requests of
// each fault and the convergence after each heal.
//
// The package has no non-test code. It is a Go module of its own
// (deploy/go.mod, using the repository's module through a replace), so the
// compose-spec parser and its dependencies stay out of switchyard's go.mod;
// make test runs it after the main module.
//
//	go -C deploy test ./...
//	go -C deploy test -run TestEnvoyBootstrap -update .   # regenerate the compose bootstrap
//	make test-compose                                     # the stack in a real engine, verbose
//	make test-multihost                                   # the multi-host example, verbose
package deploy
