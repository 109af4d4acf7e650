package main

import (
	"context"
	"fmt"
	"net"
	"os"

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
	if rd == nil || rd.ConsulService == "" {
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

// registerReplica keeps this replica registered in Consul until ctx ends,
// then deregisters it (see consul.Register).
func (a *app) registerReplica(ctx context.Context) error {
	return consul.Register(ctx, a.consulClient, *a.registration, 0, a.log.With("component", "replica"))
}
