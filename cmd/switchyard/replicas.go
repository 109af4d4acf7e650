package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"

	"google.golang.org/grpc/credentials"

	"github.com/switchyard/switchyard/internal/ready"
	"github.com/switchyard/switchyard/picker/peers"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/registry/consul"
	"github.com/switchyard/switchyard/registry/hclfile"
)

// replicaSetup decides this process's identity among the configuration's
// replicas and, when the replicas block names a Consul service, the
// registration that lets the others (and every replica's Envoys) find it.
// The replicas block is read at start; a later edit of it needs a restart
// to change the registration.
func (a *app) replicaSetup(cfg *hclfile.Config, picker string) error {
	id := a.flags.replicaID
	if id == "" {
		host, _ := os.Hostname()
		_, port, _ := net.SplitHostPort(picker)
		id = fmt.Sprintf("%s-%s", host, port)
	}
	a.replicaID, a.pickerAddr = id, picker
	rd := cfg.State.ReplicaDiscovery
	if rd == nil {
		return nil
	}
	// Replicas share their picks over their picker ports, with the same
	// mutual TLS Envoy uses (each presents its own certificate).
	opts := peers.Options{Self: id, Address: picker, Report: a.peerReport, Logger: a.log.With("component", "peers"),
		NoReadings: !a.flags.shareScrapes}
	if a.tls != nil {
		opts.Credentials = func(addr string) credentials.TransportCredentials {
			host, _, _ := net.SplitHostPort(addr)
			return credentials.NewTLS(a.tls.ClientConfig(host))
		}
	}
	a.peerOpts = &opts
	if rd.ConsulService == "" {
		return nil
	}
	xdsAddr, err := advertised("xds", a.flags.xdsAddr, a.flags.xdsAdvertise)
	if err != nil {
		return err
	}
	adminAddr, err := advertised("admin", a.flags.adminAddr, a.flags.adminAdvertise)
	if err != nil {
		return err
	}
	// The agent checks readiness on the advertised admin address: the
	// same as the listen address (loopback) for an agent on this host
	// and the default flags, reachable from an agent elsewhere (a Consul
	// container) when -admin-advertise says where.
	check := adminAddr
	scheme := "http"
	if a.adminTLSConfig() != nil {
		scheme = "https"
	}
	client, err := consul.NewClient(consulOptions(cfg))
	if err != nil {
		return err
	}
	a.registration = &consul.Registration{Service: rd.ConsulService, ID: id, Address: picker,
		Admin: adminAddr, XDS: xdsAddr, CheckURL: scheme + "://" + check + "/readyz"}
	a.consulClient = client
	a.log.Info("replica: will register in Consul", "service", rd.ConsulService, "id", id, "picker", picker)
	return nil
}

// registerReplica keeps this replica registered in Consul until ctx ends
// or the drain begins, then deregisters it (see consul.Register).
func (a *app) registerReplica(ctx context.Context) error {
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	a.drain.OnDrain(stop)
	if err := consul.Register(rctx, a.consulClient, *a.registration, 0, a.log.With("component", "replica")); err != nil {
		return err
	}
	<-ctx.Done() // deregistered while draining: the component lives on
	return nil
}

// otherReplicas returns the picker addresses of the replicas of st, less
// this one.
func (a *app) otherReplicas(st *registry.State) []string {
	var others []string
	for _, r := range st.Replicas {
		if r.Address != a.pickerAddr {
			others = append(others, r.Address)
		}
	}
	return others
}

// sharePicks runs the pick sharing with the other replicas until ctx ends:
// the peers are the replicas of every published state, less this one.
func (a *app) sharePicks(ctx context.Context) error {
	done := make(chan error, 1)
	go func() { done <- a.mesh.Run(ctx) }()
	for {
		st, changed := a.view.Current()
		a.mesh.SetPeers(a.otherReplicas(st))
		select {
		case <-ctx.Done():
			return <-done
		case err := <-done:
			return err
		case <-changed:
		}
	}
}

// setupReadiness makes the process report itself ready only once it
// serves what it should (internal/ready): an xDS snapshot of what its
// sources say in this run (restored is the version of the state a
// previous run persisted, served until they answer), with the same
// ClusterLoadAssignment versions as the other replicas that are ready.
// Until then the picker's readiness health services and ADS's report
// NOT_SERVING (Envoy sends it no stream, and an Envoy choosing an ADS
// server picks another), and /readyz answers 503 (so does Consul's check).
func (a *app) setupReadiness(restored uint64, logger *slog.Logger) {
	o := ready.Options{
		Served: func() (map[string]string, bool) {
			st := a.xds.Stats()
			return st.Versions, st.ServedRegistryVersion > restored
		},
		Peers:  func() []string { st, _ := a.view.Current(); return a.otherReplicas(st) },
		Logger: logger.With("component", "ready"),
	}
	if a.mesh != nil {
		o.Ask = func(ctx context.Context, addr string) (ready.Peer, error) {
			r, err := a.mesh.Ask(ctx, addr)
			return ready.Peer{Ready: r.Ready, Versions: r.Versions}, err
		}
	}
	a.ready = ready.New(o)
	a.picker.HoldReadiness()
	a.xds.HoldServing()
	a.ready.OnReady(a.picker.ReleaseReadiness)
	a.ready.OnReady(a.xds.ReleaseServing)
}

// peerReport is what this replica tells another that asks (peers.Ask).
func (a *app) peerReport() peers.Report {
	return peers.Report{ID: a.replicaID, Ready: a.ready.Ready() && !a.drain.Draining(), Versions: a.xds.Stats().Versions}
}
