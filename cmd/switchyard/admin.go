package main

import (
	_ "embed"
	"encoding/json"
	"net/http"
	"time"

	"github.com/switchyard/switchyard/picker/peers"
)

//go:embed status.html
var statusPage []byte

// adminHandler serves the admin address: liveness and readiness probes for
// process supervisors and compose health checks, and /api/status, the JSON
// view of everything serve knows (the status page renders it).
func (a *app) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write(statusPage)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if st, _ := a.view.Current(); st.Version == 0 {
			writeText(w, http.StatusServiceUnavailable, "not ready: no configuration published yet\n")
			return
		}
		if a.draining.Load() {
			writeText(w, http.StatusServiceUnavailable, "not ready: draining before shutdown\n")
			return
		}
		writeText(w, http.StatusOK, "ready\n")
	})
	mux.Handle("GET /metrics", a.metricsHandler())
	// The one state-changing request (adminauth guards it): re-read the
	// configuration now, like SIGHUP.
	mux.HandleFunc("POST /api/reload", func(w http.ResponseWriter, r *http.Request) {
		a.log.Info("configuration reload requested over the admin API", "peer", r.RemoteAddr)
		a.manager.Reload()
		writeText(w, http.StatusAccepted, "reloading\n")
	})
	mux.HandleFunc("GET /api/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(a.status())
	})
	return mux
}

func writeText(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(body))
}

// statusDoc is the /api/status document.
type statusDoc struct {
	Time            time.Time     `json:"time"`
	Version         string        `json:"version"`
	RegistryVersion uint64        `json:"registry_version"`
	ConfigError     string        `json:"config_error,omitempty"`
	Pools           []poolStatus  `json:"pools"`
	Models          []modelStatus `json:"models"`
	Picker          pickerStatus  `json:"picker"`
	XDS             xdsStatus     `json:"xds"`
	Envoys          []envoyStatus `json:"envoys"`
	// ReplicaID names this switchyard among the replicas.
	ReplicaID string `json:"replica_id"`
	// Replicas are the switchyard replicas of the configuration (empty:
	// one switchyard).
	Replicas []replicaStatus `json:"replicas"`
	Store    *storeStatus    `json:"store,omitempty"` // nil without -store
	TLS      *tlsStatus      `json:"tls,omitempty"`   // nil without TLS
}

// storeStatus describes the bbolt store: where it is, what the start
// restored from it, and the picker-memory saves since.
type storeStatus struct {
	Path      string    `json:"path"`
	LastError string    `json:"last_error,omitempty"`
	Restored  warmCount `json:"restored"`
	// WarmSaves counts durable saves of the picker's memory; LastWarmSave
	// is when the latest finished.
	WarmSaves    int64     `json:"warm_saves"`
	LastWarmSave time.Time `json:"last_warm_save,omitzero"`
}

type warmCount struct {
	PrefixEndpoints int `json:"prefix_endpoints"`
	PrefixBlocks    int `json:"prefix_blocks"`
	Sessions        int `json:"sessions"`
	FailingEps      int `json:"failing_endpoints"`
}

type replicaStatus struct {
	ID      string `json:"id"`
	Address string `json:"address"`
	Admin   string `json:"admin,omitempty"`
	XDS     string `json:"xds,omitempty"`
	Source  string `json:"source"`
	Self    bool   `json:"self"`
	// Sharing is true while this replica's picks stream to it; Sent and
	// Dropped count those events.
	Sharing bool   `json:"sharing"`
	Sent    uint64 `json:"events_sent"`
	Dropped uint64 `json:"events_dropped"`
	// From is the replica ID its stream to this one announced, and LagMS
	// the age of its latest batch on arrival (clocks of both hosts).
	From  string  `json:"from,omitempty"`
	LagMS float64 `json:"lag_ms,omitempty"`
}

type xdsStatus struct {
	Version string `json:"version"`
	// Versions are the served version of each resource type: content
	// addresses, equal on every replica serving the same configuration.
	Versions        map[string]string `json:"versions"`
	RegistryVersion uint64            `json:"registry_version"`
	Snapshots       uint64            `json:"snapshots"`
	Failures        uint64            `json:"failures"`
	LastError       string            `json:"last_error,omitempty"`
	ACKs            uint64            `json:"acks"`
	NACKs           uint64            `json:"nacks"`
	Warnings        []string          `json:"warnings,omitempty"`
}

type envoyStatus struct {
	ID        string            `json:"id"`
	Cluster   string            `json:"cluster"`
	Streams   int               `json:"streams"`
	FirstSeen time.Time         `json:"first_seen"`
	LastSeen  time.Time         `json:"last_seen"`
	Acked     map[string]string `json:"acked"`
	ACKs      uint64            `json:"acks"`
	NACKs     uint64            `json:"nacks"`
	LastNACK  string            `json:"last_nack,omitempty"`
}

type poolStatus struct {
	Name        string `json:"name"`
	Engine      string `json:"engine"`
	FailureMode string `json:"failure_mode"`
	Saturated   bool   `json:"saturated"`
	// Guard is set while the pool's discovery guard holds endpoints that
	// their source reports failing (too many failed at once).
	Guard     *guardStatus     `json:"guard,omitempty"`
	Endpoints []endpointStatus `json:"endpoints"`
}

type guardStatus struct {
	Held  []string  `json:"held"`
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
}

type endpointStatus struct {
	Address  string `json:"address"`
	Draining bool   `json:"draining"`
	// Held: its discovery source reports it failing, but the pool's
	// discovery guard keeps it routable for now.
	Held             bool  `json:"held,omitempty"`
	InFlightRequests int64 `json:"in_flight_requests"`
	InFlightTokens   int64 `json:"in_flight_tokens"`
	Picked           int64 `json:"picked"`
	Served           int64 `json:"served"`
	// Healthy is false while the endpoint's metrics scrapes fail (it is
	// then withheld from Envoy if its pool has healthy endpoints).
	Healthy bool `json:"healthy"`
	// Scraped load; absent until the first successful scrape.
	Waiting      *int     `json:"waiting,omitempty"`
	Running      *int     `json:"running,omitempty"`
	KVCacheUsage *float64 `json:"kv_cache_usage,omitempty"`
	// KV-cache geometry and LoRA state as the server reports them (vLLM's
	// cache_config_info and lora_requests_info); absent when it does not.
	BlockSize       int      `json:"block_size,omitempty"`
	NumBlocks       int      `json:"num_blocks,omitempty"`
	MaxLoras        int      `json:"max_loras,omitempty"`
	RunningAdapters []string `json:"running_adapters,omitempty"`
	WaitingAdapters []string `json:"waiting_adapters,omitempty"`
	// Models the endpoint serves as the picker sees them, and where that
	// came from: "config" (a models list) or "server" (its /v1/models).
	// Absent while unknown: the endpoint then gets every model of its pool.
	Models     []string `json:"models,omitempty"`
	ModelsFrom string   `json:"models_from,omitempty"`
	// TTFT is the learned time-to-first-token model, for pools on the
	// predicted-ttft profile once a first token has been observed.
	TTFT *ttftStatus `json:"ttft,omitempty"`
}

// ttftStatus is an endpoint's learned TTFT model (milliseconds): the fixed
// part and the prefill per 1,000 uncached prompt tokens, the observations
// behind them, the prefill work in flight, and how far predictions were
// from what was observed.
type ttftStatus struct {
	BaseMS            float64 `json:"base_ms"`
	PrefillPer1kMS    float64 `json:"prefill_per_1k_tokens_ms"`
	Observations      float64 `json:"observations"`
	PrefillRequests   int64   `json:"prefill_requests"`
	PrefillTokens     int64   `json:"prefill_tokens"`
	Compared          int64   `json:"compared"`
	MeanErrorMS       float64 `json:"mean_error_ms"`
	MeanAbsoluteError float64 `json:"mean_absolute_error_ms"`
}

type modelStatus struct {
	Name     string   `json:"name"`
	Pool     string   `json:"pool"`
	Priority int      `json:"priority"`
	Targets  []string `json:"targets,omitempty"`
}

type pickerStatus struct {
	Requests       int64         `json:"requests"`
	Picked         int64         `json:"picked"`
	Rewritten      int64         `json:"rewritten"`
	FallbackServed int64         `json:"fallback_served"`
	ResponseBodies int64         `json:"response_body_messages"`
	PeerPicks      int64         `json:"peer_picks"`
	Rejected       map[int]int64 `json:"rejected"`
}

func (a *app) status() statusDoc {
	st, _ := a.view.Current()
	ps := a.picker.Stats()
	doc := statusDoc{
		Time:            time.Now().UTC(),
		Version:         versionString(),
		RegistryVersion: st.Version,
		Picker: pickerStatus{Requests: ps.Requests, Picked: ps.Picked, Rewritten: ps.Rewritten,
			FallbackServed: ps.FallbackServed, ResponseBodies: ps.ResponseBodies, PeerPicks: ps.PeerPicks, Rejected: ps.Rejected},
	}
	doc.TLS = a.tlsStatus()
	xs := a.xds.Stats()
	doc.XDS = xdsStatus{Version: xs.Version, Versions: xs.Versions, RegistryVersion: xs.RegistryVersion, Snapshots: xs.Snapshots,
		Failures: xs.Failures, LastError: xs.LastError, ACKs: xs.ACKs, NACKs: xs.NACKs, Warnings: xs.Warnings}
	doc.ReplicaID = a.replicaID
	doc.Replicas = []replicaStatus{}
	var ms peers.Stats
	if a.mesh != nil {
		ms = a.mesh.Stats()
	}
	for _, r := range st.Replicas {
		rs := replicaStatus{ID: r.ID, Address: r.Address, Admin: r.Admin, XDS: r.XDS,
			Source: r.Source, Self: r.Address == a.pickerAddr}
		for _, p := range ms.Peers {
			if p.Address == r.Address {
				rs.Sharing, rs.Sent, rs.Dropped = p.Connected, p.Sent, p.Dropped
			}
		}
		for _, in := range ms.Inbound {
			if in.From == r.ID {
				rs.From, rs.LagMS = in.From, float64(in.Lag)/float64(time.Millisecond)
			}
		}
		doc.Replicas = append(doc.Replicas, rs)
	}
	doc.Envoys = []envoyStatus{}
	for _, n := range a.xds.Nodes() {
		doc.Envoys = append(doc.Envoys, envoyStatus{ID: n.ID, Cluster: n.Cluster, Streams: n.Streams,
			FirstSeen: n.FirstSeen, LastSeen: n.LastSeen, Acked: n.Acked, ACKs: n.ACKs, NACKs: n.NACKs, LastNACK: n.LastNACK})
	}
	if err := a.manager.LastError(); err != nil {
		doc.ConfigError = err.Error()
	}
	if a.store != nil {
		ss := &storeStatus{Path: a.flags.storePath}
		if err := a.store.LastError(); err != nil {
			ss.LastError = err.Error()
		}
		if a.warm != nil {
			r := a.warm.restored
			ss.Restored = warmCount{PrefixEndpoints: r.PrefixEndpoints, PrefixBlocks: r.PrefixBlocks, Sessions: r.Sessions, FailingEps: r.Failing}
			ss.WarmSaves = a.warm.saves.Load()
			if ns := a.warm.lastSave.Load(); ns != 0 {
				ss.LastWarmSave = time.Unix(0, ns).UTC()
			}
		}
		doc.Store = ss
	}
	byPool := map[string][]endpointStatus{}
	eh := a.picker.EndpointHealth()
	for _, e := range ps.Endpoints {
		es := endpointStatus{Address: e.Address, Draining: e.Draining,
			InFlightRequests: e.InFlightRequests, InFlightTokens: e.InFlightTokens, Picked: e.Picked, Served: e.Served,
			Healthy: !eh.Unhealthy(e.Pool, e.Address)}
		switch {
		case len(e.Models) > 0:
			es.Models, es.ModelsFrom = e.Models, "config"
		case e.Metrics != nil && e.Metrics.ServedModels != nil:
			es.Models, es.ModelsFrom = e.Metrics.ServedModels, "server"
		}
		if m := e.Metrics; m != nil && !m.LastSuccess.IsZero() {
			v := m.Values
			es.Waiting, es.Running, es.KVCacheUsage = &v.Waiting, &v.Running, &v.KVUsage
			es.BlockSize, es.NumBlocks = v.BlockSize, v.NumBlocks
			es.MaxLoras, es.RunningAdapters, es.WaitingAdapters = v.MaxLoras, v.RunningAdapters, v.WaitingAdapters
			es.Healthy = es.Healthy && !m.Failing
		}
		if m := e.TTFT; m.Compared > 0 || e.PrefillRequests > 0 {
			ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
			es.TTFT = &ttftStatus{BaseMS: ms(m.Base), PrefillPer1kMS: ms(m.PerToken), Observations: m.Observed,
				PrefillRequests: e.PrefillRequests, PrefillTokens: e.PrefillTokens,
				Compared: m.Compared, MeanErrorMS: ms(m.MeanError), MeanAbsoluteError: ms(m.MeanAbs)}
		}
		byPool[e.Pool] = append(byPool[e.Pool], es)
	}
	saturated := a.picker.Saturated(time.Now())
	guards := map[string]*guardStatus{}
	for _, g := range a.manager.Status().Guards {
		guards[g.Pool] = &guardStatus{Held: g.Held, Since: g.Since.UTC(), Until: g.Until.UTC()}
	}
	for _, name := range st.PoolNames() {
		p := st.Pools[name]
		eps := byPool[name]
		if eps == nil {
			eps = []endpointStatus{}
		}
		for i := range eps {
			for _, e := range p.Endpoints {
				if e.Address == eps[i].Address {
					eps[i].Held = e.Held
				}
			}
		}
		doc.Pools = append(doc.Pools, poolStatus{Name: name, Engine: string(p.Engine),
			FailureMode: string(p.FailureMode), Saturated: saturated[name], Guard: guards[name], Endpoints: eps})
	}
	for _, name := range st.ModelNames() {
		m := st.Models[name]
		ms := modelStatus{Name: name, Pool: m.Pool, Priority: m.Priority}
		for _, t := range m.Targets {
			ms.Targets = append(ms.Targets, t.Name)
		}
		doc.Models = append(doc.Models, ms)
	}
	return doc
}
