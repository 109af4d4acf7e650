package main

import (
	"net/http"
	"time"

	// Named apart from the e2e tests' own status type.
	adminstatus "github.com/switchyard/switchyard/internal/status"
)

// adminHandler serves the admin address: the status package's read-only
// endpoints (status page, /api/status, /metrics, health probes) and the
// one state-changing request, which adminauth guards.
func (a *app) adminHandler() http.Handler {
	mux := http.NewServeMux()
	a.statusSources().Register(mux)
	// Re-read the configuration now, like SIGHUP.
	mux.HandleFunc("POST /api/reload", func(w http.ResponseWriter, r *http.Request) {
		a.log.Info("configuration reload requested over the admin API", "peer", r.RemoteAddr)
		a.manager.Reload()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write([]byte("reloading\n"))
	})
	// Tenants' usage for billing (JSON, or CSV), read-only like the rest.
	mux.Handle("GET /api/usage", a.usage.Handler())
	return mux
}

// statusSources names the components the status report reads.
func (a *app) statusSources() *adminstatus.Sources {
	return &adminstatus.Sources{
		Version: versionString(), ReplicaID: a.replicaID, PickerAddr: a.pickerAddr,
		View: a.view, Registry: a.manager, Picker: a.picker, XDS: a.xds, Consul: a.consul, Mesh: a.mesh,
		TLS: a.tls, AllowedSANs: a.flags.tls.sans(),
		Store: a.store, StorePath: a.flags.storePath, Warm: a.warm,
		Draining:  a.drain.Draining,
		Ready:     func() (bool, string) { return a.ready.Ready(), a.ready.Reason() },
		Usage:     a.usage,
		Peers:     a.replicaStatus,
		Decisions: a.obs.decisions, History: a.history,
	}
}

// replicaStatusInterval is how often a replica reads the others' reports.
const replicaStatusInterval = 5 * time.Second

// adminClient returns how to reach another replica's admin address: nil
// for plain HTTP, or HTTPS clients with this replica's certificate when
// the admin address serves mutual TLS.
func (a *app) adminClient() func(host string) *http.Client {
	if a.adminTLSConfig() == nil {
		return nil
	}
	return func(host string) *http.Client {
		return &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
			TLSClientConfig: a.tls.ClientConfig(host), ForceAttemptHTTP2: true}}
	}
}
