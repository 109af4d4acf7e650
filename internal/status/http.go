package status

import (
	_ "embed"
	"encoding/json"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/switchyard/switchyard/picker/decisions"
)

//go:embed status.html
var statusPage []byte

// Register adds the read-only admin endpoints to mux:
//
//	GET /            the status page, which renders /api/status every second
//	GET /api/status  the Report as JSON
//	GET /metrics     the Report, the Go runtime and the process for Prometheus
//	GET /api/decisions  the latest decision records, newest first; query
//	                 parameters model, pool, endpoint, status (a code or a
//	                 class such as 5xx) and limit (default 100) filter them
//	GET /api/history the status page's charts: the last 15 minutes of
//	                 per-endpoint load and TTFT, sampled every 5 s
//	GET /healthz     liveness: 200 while the process serves HTTP
//	GET /readyz      readiness: 200 once the process serves what it
//	                 should (Sources.Ready), 503 with the reason before
//	                 that and while draining
func (s *Sources) Register(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write(statusPage)
	})
	mux.HandleFunc("GET /api/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(s.Read(time.Now()))
	})
	mux.Handle("GET /metrics", s.metricsHandler())
	mux.HandleFunc("GET /api/decisions", s.serveDecisions)
	mux.HandleFunc("GET /api/history", func(w http.ResponseWriter, r *http.Request) {
		if s.History == nil {
			writeText(w, http.StatusNotFound, "no history is kept\n")
			return
		}
		s.History.serve(w, r)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ok, why := s.readiness(); !ok {
			writeText(w, http.StatusServiceUnavailable, "not ready: "+why+"\n")
			return
		}
		writeText(w, http.StatusOK, "ready\n")
	})
}

// metricsHandler serves /metrics from a registry of its own.
func (s *Sources) metricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collector{read: func(now time.Time) *Report { return build(s.gather(now, true)) }},
	)
	if s.Usage != nil {
		reg.MustRegister(s.Usage.Collector())
	}
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

func writeText(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(body))
}

// serveDecisions answers /api/decisions.
func (s *Sources) serveDecisions(w http.ResponseWriter, r *http.Request) {
	if s.Decisions == nil {
		writeText(w, http.StatusNotFound, "decision records are off\n")
		return
	}
	f, err := decisions.ParseFilter(r.URL.Query())
	if err != nil {
		writeText(w, http.StatusBadRequest, err.Error()+"\n")
		return
	}
	out := struct {
		Stats   Decisions           `json:"stats"`
		Records []*decisions.Record `json:"records"`
	}{Records: s.Decisions.Query(f)}
	out.Stats = *decisionsOf(s.Decisions.Stats())
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(&out)
}
