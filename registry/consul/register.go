package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/hashicorp/consul/api"
)

// Registration is a switchyard replica's own Consul service, the one the
// other replicas (and every replica's Envoys, through the picker cluster)
// find it by: its picker address as the service address and port, its
// admin and ADS addresses in meta, and an HTTP check on its /readyz that
// the local agent runs.
type Registration struct {
	// Service is the replicas block's consul_service.
	Service string
	// ID identifies this replica; unique among the replicas.
	ID string
	// Address is the picker (ext_proc) "ip:port" other hosts reach.
	Address string
	// Admin and XDS are the admin and ADS "ip:port" (optional).
	Admin, XDS string
	// CheckURL is the readiness URL the agent polls (admin /readyz).
	CheckURL string
	// CheckInterval is how often (default 1s, Consul's minimum).
	CheckInterval time.Duration
}

// DeregisterCriticalAfter is how long the agent keeps a replica whose
// check is critical before it removes the registration: a replica that died
// without deregistering (SIGKILL, OOM kill) next to an agent that lives on
// would otherwise stay listed, critical, forever. One minute is Consul's
// smallest value (its reaper runs every 30 s). A replica that is alive but
// was reaped, say after a long stall, registers again at its next resync.
const DeregisterCriticalAfter = time.Minute

// DefaultResync is how often Register makes sure the agent still has the
// registration (a dev agent, or one whose data directory was lost, forgets
// services registered over its API when it restarts).
const DefaultResync = 5 * time.Second

// Register registers reg with the agent and keeps it registered until ctx
// ends; then it deregisters it, so the other replicas drop this one at once
// instead of after its check fails. It returns nil after ctx ends; failures
// to reach the agent are logged and retried.
func Register(ctx context.Context, client *api.Client, reg Registration, resync time.Duration, log *slog.Logger) error {
	svc, err := reg.service()
	if err != nil {
		return err
	}
	if resync <= 0 {
		resync = DefaultResync
	}
	agent := client.Agent()
	registered := false
	ensure := func() {
		if registered {
			if _, _, err := agent.Service(reg.ID, (&api.QueryOptions{}).WithContext(ctx)); err == nil {
				return
			}
		}
		if err := agent.ServiceRegisterOpts(svc, api.ServiceRegisterOpts{}.WithContext(ctx)); err != nil {
			if ctx.Err() == nil {
				log.Warn("consul: cannot register this replica; retrying", "service", reg.Service, "id", reg.ID, "err", err)
			}
			registered = false
			return
		}
		if !registered {
			log.Info("consul: registered this replica", "service", reg.Service, "id", reg.ID, "address", reg.Address)
		}
		registered = true
	}
	ensure()
	tick := time.NewTicker(resync)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := agent.ServiceDeregisterOpts(reg.ID, (&api.QueryOptions{}).WithContext(dctx)); err != nil {
				log.Warn("consul: deregistering this replica failed; its check will take it out", "id", reg.ID, "err", err)
			} else {
				log.Info("consul: deregistered this replica", "id", reg.ID)
			}
			return nil
		case <-tick.C:
			ensure()
		}
	}
}

// service builds the agent registration.
func (r Registration) service() (*api.AgentServiceRegistration, error) {
	if r.Service == "" || r.ID == "" {
		return nil, errors.New("consul: a replica registration needs a service name and an id")
	}
	host, port, err := net.SplitHostPort(r.Address)
	if err != nil {
		return nil, fmt.Errorf("consul: replica address %q: %w", r.Address, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p > 65535 {
		return nil, fmt.Errorf("consul: replica address %q: bad port", r.Address)
	}
	interval := r.CheckInterval
	if interval <= 0 {
		interval = time.Second
	}
	svc := &api.AgentServiceRegistration{
		ID: r.ID, Name: r.Service, Address: host, Port: p,
		Meta: map[string]string{},
	}
	if r.Admin != "" {
		svc.Meta[MetaAdmin] = r.Admin
	}
	if r.XDS != "" {
		svc.Meta[MetaXDS] = r.XDS
	}
	if r.CheckURL != "" {
		svc.Check = &api.AgentServiceCheck{
			CheckID: "switchyard-ready:" + r.ID, Name: "switchyard /readyz",
			HTTP: r.CheckURL, Interval: interval.String(), Timeout: (interval / 2).String(),
			TLSSkipVerify:                  true, // the admin server's certificate names the replica, not the agent's view of it
			DeregisterCriticalServiceAfter: DeregisterCriticalAfter.String(),
		}
	}
	return svc, nil
}
