package usage

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard/switchyard/store"
)

// DefaultSpan is the period /api/usage covers when from is not given.
const DefaultSpan = 24 * time.Hour

// row is one bucket in /api/usage's JSON: its start, then its counts.
type row struct {
	Start time.Time `json:"start"`
	total
}

// total is one tenant and model's counts in /api/usage's JSON.
type total struct {
	Tenant           string `json:"tenant"`
	Model            string `json:"model"`
	Requests         int64  `json:"requests"`
	Errors           int64  `json:"errors"`
	PromptTokens     int64  `json:"prompt_tokens"`
	CachedTokens     int64  `json:"cached_tokens"`
	CompletionTokens int64  `json:"completion_tokens"`
	TotalTokens      int64  `json:"total_tokens"`
}

func totalOf(tenant, model string, c store.UsageCounts) total {
	return total{Tenant: tenant, Model: model, Requests: c.Requests, Errors: c.Errors,
		PromptTokens: c.PromptTokens, CachedTokens: c.CachedTokens, CompletionTokens: c.CompletionTokens,
		TotalTokens: c.PromptTokens + c.CompletionTokens}
}

// document is /api/usage's JSON.
type document struct {
	From   time.Time `json:"from"`
	To     time.Time `json:"to"`
	Bucket string    `json:"bucket"`
	Rows   []row     `json:"rows"`
	Totals []total   `json:"totals"`
}

// Handler serves GET /api/usage?from=&to=[&tenant=][&format=csv]: the
// hourly buckets starting in [from, to) (RFC 3339 times; from is rounded
// down to its hour; defaults: to now, from DefaultSpan earlier), as JSON
// with per tenant and model totals, or as CSV (format=csv, or an Accept
// header preferring text/csv) with one line per bucket.
func (l *Ledger) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		to, err := parseTime(q.Get("to"), l.now())
		if err != nil {
			http.Error(w, "to: "+err.Error(), http.StatusBadRequest)
			return
		}
		from, err := parseTime(q.Get("from"), to.Add(-DefaultSpan))
		if err != nil {
			http.Error(w, "from: "+err.Error(), http.StatusBadRequest)
			return
		}
		if !from.Before(to) {
			http.Error(w, "from must be before to", http.StatusBadRequest)
			return
		}
		rows, err := l.Query(from, to)
		if err != nil {
			http.Error(w, "usage: "+err.Error(), http.StatusInternalServerError)
			return
		}
		if t := q.Get("tenant"); t != "" {
			kept := rows[:0]
			for _, r := range rows {
				if r.Tenant == t {
					kept = append(kept, r)
				}
			}
			rows = kept
		}
		if q.Get("format") == "csv" || (q.Get("format") == "" && wantsCSV(r.Header.Get("Accept"))) {
			writeCSV(w, rows)
			return
		}
		if f := q.Get("format"); f != "" && f != "json" {
			http.Error(w, fmt.Sprintf("format %q: want json or csv", f), http.StatusBadRequest)
			return
		}
		doc := document{From: store.UsageHour(from), To: to.UTC(), Bucket: "1h", Rows: []row{}, Totals: []total{}}
		for _, r := range rows {
			doc.Rows = append(doc.Rows, row{Start: r.Hour, total: totalOf(r.Tenant, r.Model, r.UsageCounts)})
		}
		for _, t := range Sum(rows) {
			doc.Totals = append(doc.Totals, totalOf(t.Tenant, t.Model, t.UsageCounts))
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(doc)
	})
}

func parseTime(s string, def time.Time) (time.Time, error) {
	if s == "" {
		return def, nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is not an RFC 3339 time such as 2026-11-26T10:00:00Z", s)
	}
	return t, nil
}

// wantsCSV reports whether an Accept header prefers text/csv to JSON.
func wantsCSV(accept string) bool {
	for _, part := range strings.Split(accept, ",") {
		mt, _, err := mime.ParseMediaType(strings.TrimSpace(part))
		if err != nil {
			continue
		}
		switch mt {
		case "text/csv":
			return true
		case "application/json":
			return false
		}
	}
	return false
}

// csvHeader names the CSV columns.
var csvHeader = []string{"start", "tenant", "model", "requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens"}

func writeCSV(w http.ResponseWriter, rows []store.UsageRow) {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	cw := csv.NewWriter(w)
	_ = cw.Write(csvHeader)
	i := func(v int64) string { return strconv.FormatInt(v, 10) }
	for _, r := range rows {
		c := r.UsageCounts
		_ = cw.Write([]string{r.Hour.Format(time.RFC3339), r.Tenant, r.Model, i(c.Requests), i(c.Errors),
			i(c.PromptTokens), i(c.CachedTokens), i(c.CompletionTokens), i(c.PromptTokens + c.CompletionTokens)})
	}
	cw.Flush()
}
