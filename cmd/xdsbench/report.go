package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// stats summarizes latencies in milliseconds.
type stats struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func summarize(ds []time.Duration) stats {
	v := make([]float64, len(ds))
	for i, d := range ds {
		v[i] = ms(d)
	}
	return summarizeMS(v)
}

// summarizeMS uses the nearest-rank percentile.
func summarizeMS(v []float64) stats {
	if len(v) == 0 {
		return stats{}
	}
	v = slices.Clone(v)
	slices.Sort(v)
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(v)))) - 1
		return v[max(0, min(i, len(v)-1))]
	}
	return stats{N: len(v), P50: rank(0.5), P90: rank(0.9), P99: rank(0.99), Max: v[len(v)-1]}
}

type changeReport struct {
	Change   int    `json:"change"`
	Pool     string `json:"pool"`
	Endpoint string `json:"endpoint"`
	// Added is true when the change put the endpoint back.
	Added        bool    `json:"added"`
	ClientsP50MS float64 `json:"clients_p50_ms"`
	ClientsMaxMS float64 `json:"clients_max_ms"`
	EnvoyMS      float64 `json:"envoy_ms"`
	// PublishedMS and SnapshotMS: file write to serve logging the
	// registry publish and the xDS snapshot.
	PublishedMS           float64 `json:"published_ms"`
	SnapshotMS            float64 `json:"snapshot_ms"`
	EDSResponsesPerClient float64 `json:"eds_responses_per_client"`
	EDSResourcesPerClient float64 `json:"eds_resources_per_client"`
	BytesPerClient        int64   `json:"bytes_per_client"`
}

type hiccupReport struct {
	EDSResponsesPerClient float64 `json:"eds_responses_per_client"`
	BytesPerClient        int64   `json:"bytes_per_client"`
	Published             int     `json:"registry_publishes"`
	Snapshots             int     `json:"xds_snapshots"`
}

type report struct {
	Protocol       string `json:"protocol"`
	Endpoints      int    `json:"endpoints"`
	Pools          int    `json:"pools"`
	Clients        int    `json:"clients"`
	Envoys         int    `json:"envoys"`
	ScrapeInterval string `json:"scrape_interval"`
	Hiccup         string `json:"hiccup"`
	HiccupFor      string `json:"hiccup_for"`
	LoadAvgStart   string `json:"loadavg_start"`
	LoadAvgEnd     string `json:"loadavg_end"`

	InitialSync           stats   `json:"initial_sync"`
	EnvoyInitialSyncMS    float64 `json:"envoy_initial_sync_ms"`
	InitialBytesPerClient int64   `json:"initial_bytes_per_client"`

	Changes        []changeReport `json:"changes"`
	ChangeLatency  stats          `json:"change_latency_all_clients"`
	WorstPerChange stats          `json:"worst_client_per_change"`
	PublishedMS    []float64      `json:"published_ms"`
	// ChangesCPUPercent is serve's CPU (% of one core) during the changes.
	ChangesCPUPercent float64 `json:"changes_cpu_percent"`

	HiccupResult hiccupReport `json:"hiccup_result"`

	ServeNoClients usage `json:"serve_no_clients"`
	ServeClients   usage `json:"serve_clients"`
	PerClient      struct {
		RSSKiB         float64 `json:"rss_kib"`
		HeapKiB        float64 `json:"heap_kib"`
		IdleCPUPercent float64 `json:"idle_cpu_percent"`
		// CPUPerChangeMicros is serve's CPU beyond its idle rate during
		// the changes, per change and connected client.
		CPUPerChangeMicros float64 `json:"cpu_per_change_us"`
		// CPUPerChangeGrossMicros is all of serve's CPU during the
		// changes (idle work included), per change and client: an upper
		// bound.
		CPUPerChangeGrossMicros float64 `json:"cpu_per_change_gross_us"`
	} `json:"per_client"`
}

func (r *report) print(w io.Writer) {
	fmt.Fprintf(w, "xdsbench: %s, %d endpoints in %d pools, %d Go ADS clients + %d Envoy, scrape interval %s\n",
		r.Protocol, r.Endpoints, r.Pools, r.Clients, r.Envoys, or(r.ScrapeInterval, "default"))
	fmt.Fprintf(w, "loadavg: start %s, end %s\n", r.LoadAvgStart, r.LoadAvgEnd)
	fmt.Fprintf(w, "initial sync: clients p50 %.0f ms, max %.0f ms; Envoy %.0f ms; %d KiB per client\n",
		r.InitialSync.P50, r.InitialSync.Max, r.EnvoyInitialSyncMS, r.InitialBytesPerClient>>10)
	fmt.Fprintln(w, "\n| change | endpoint | clients p50 ms | clients max ms | Envoy ms | published ms | snapshot ms | EDS resp/client | CLAs/client | bytes/client |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
	for _, c := range r.Changes {
		op := "-"
		if c.Added {
			op = "+"
		}
		fmt.Fprintf(w, "| %d | %s%s/%s | %.0f | %.0f | %.0f | %.0f | %.0f | %.1f | %.1f | %d |\n", c.Change, op, c.Pool, c.Endpoint,
			c.ClientsP50MS, c.ClientsMaxMS, c.EnvoyMS, c.PublishedMS, c.SnapshotMS, c.EDSResponsesPerClient, c.EDSResourcesPerClient, c.BytesPerClient)
	}
	fmt.Fprintf(w, "\nchange reached a client: p50 %.0f ms, p99 %.0f ms, max %.0f ms (%d samples)\n",
		r.ChangeLatency.P50, r.ChangeLatency.P99, r.ChangeLatency.Max, r.ChangeLatency.N)
	fmt.Fprintf(w, "change reached every client and Envoy: p50 %.0f ms, p99 %.0f ms, max %.0f ms (%d changes)\n",
		r.WorstPerChange.P50, r.WorstPerChange.P99, r.WorstPerChange.Max, r.WorstPerChange.N)
	p := summarizeMS(r.PublishedMS)
	fmt.Fprintf(w, "file write to published state: p50 %.0f ms, max %.0f ms\n", p.P50, p.Max)
	fmt.Fprintf(w, "serve CPU during changes: %.0f%% of a core\n", r.ChangesCPUPercent)
	if r.Hiccup != "none" {
		h := r.HiccupResult
		fmt.Fprintf(w, "hiccup (%s for %s): %.1f EDS responses and %d bytes per client, %d registry publishes, %d xDS snapshots\n",
			r.Hiccup, r.HiccupFor, h.EDSResponsesPerClient, h.BytesPerClient, h.Published, h.Snapshots)
	}
	fmt.Fprintf(w, "serve, no client: %.0f%% CPU, RSS %d MiB, heap %d MiB, %.1f scrapes per endpoint per second\n",
		r.ServeNoClients.CPUPercent, r.ServeNoClients.RSS>>20, r.ServeNoClients.Heap>>20, r.ServeNoClients.ScrapesPerEndpointPerSecond)
	fmt.Fprintf(w, "serve, %d clients + %d Envoy: %.0f%% CPU, RSS %d MiB, heap %d MiB, %.1f scrapes per endpoint per second\n",
		r.Clients, r.Envoys, r.ServeClients.CPUPercent, r.ServeClients.RSS>>20, r.ServeClients.Heap>>20, r.ServeClients.ScrapesPerEndpointPerSecond)
	fmt.Fprintf(w, "per connected client: RSS %.0f KiB, heap %.0f KiB, idle CPU %.3f%% of a core, CPU per change %.0f µs beyond idle (%.0f µs gross)\n",
		r.PerClient.RSSKiB, r.PerClient.HeapKiB, r.PerClient.IdleCPUPercent, r.PerClient.CPUPerChangeMicros, r.PerClient.CPUPerChangeGrossMicros)
}

func or(s, d string) string {
	if strings.TrimSpace(s) == "" {
		return d
	}
	return s
}
