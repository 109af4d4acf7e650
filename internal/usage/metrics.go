package usage

import "github.com/prometheus/client_golang/prometheus"

var (
	mRequests = prometheus.NewDesc("switchyard_tenant_requests_total",
		"Requests of each tenant, per model (the client's declared name, \"other\", or \"\" for none).", []string{"tenant", "model"}, nil)
	mErrors = prometheus.NewDesc("switchyard_tenant_errors_total",
		"Requests of each tenant that failed: answered by the picker (403, 429, ...), an error status, or no response.", []string{"tenant", "model"}, nil)
	mTokens = prometheus.NewDesc("switchyard_tenant_tokens_total",
		"Tokens the responses' usage reported for each tenant, by type: prompt (cached included), cached, completion.", []string{"tenant", "model", "type"}, nil)
)

// Collector returns the Prometheus collector of the ledger's counters
// since start. Their labels are tenant and model names the configuration
// declares, so clients cannot grow the series.
func (l *Ledger) Collector() prometheus.Collector { return collector{l} }

type collector struct{ l *Ledger }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- mRequests
	ch <- mErrors
	ch <- mTokens
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	for _, t := range c.l.SinceStart() {
		counter := func(d *prometheus.Desc, v int64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
		}
		counter(mRequests, t.Requests, t.Tenant, t.Model)
		counter(mErrors, t.Errors, t.Tenant, t.Model)
		counter(mTokens, t.PromptTokens, t.Tenant, t.Model, "prompt")
		counter(mTokens, t.CachedTokens, t.Tenant, t.Model, "cached")
		counter(mTokens, t.CompletionTokens, t.Tenant, t.Model, "completion")
	}
}
