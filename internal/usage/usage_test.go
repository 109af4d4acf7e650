package usage

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard/switchyard/picker/tenant"
	"github.com/switchyard/switchyard/store/storetest"
)

var t0 = time.Date(2026, 11, 26, 10, 30, 0, 0, time.UTC)

func fill(l *Ledger) {
	l.Record(tenant.Usage{Time: t0, Tenant: "team-a", Model: "m", Requests: 1, PromptTokens: 100, CachedTokens: 64, CompletionTokens: 10})
	l.Record(tenant.Usage{Time: t0.Add(10 * time.Minute), Tenant: "team-a", Model: "m", Requests: 1, Errors: 1})
	l.Record(tenant.Usage{Time: t0.Add(40 * time.Minute), Tenant: "team-a", Model: "m", Requests: 1, PromptTokens: 5, CompletionTokens: 1})
	l.Record(tenant.Usage{Time: t0, Tenant: "team-b", Model: "other", Requests: 1, PromptTokens: 7, CompletionTokens: 3})
}

func get(t *testing.T, h http.Handler, target, accept string) (int, string, string) {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, target, nil)
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	b, _ := io.ReadAll(rec.Body)
	return rec.Code, rec.Header().Get("Content-Type"), string(b)
}

func TestLedgerAPI(t *testing.T) {
	for _, withStore := range []bool{false, true} {
		l := New(nil, nil)
		if withStore {
			l = New(storetest.New(), nil)
		}
		l.now = func() time.Time { return t0.Add(2 * time.Hour) }
		fill(l)
		h := l.Handler()

		code, ct, body := get(t, h, "/api/usage?from=2026-11-26T10:59:00Z&to=2026-11-26T12:00:00Z", "")
		if code != 200 || ct != "application/json" {
			t.Fatalf("store %v: %d %s %s", withStore, code, ct, body)
		}
		var doc document
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			t.Fatal(err)
		}
		// from rounds down to 10:00: both hours are in.
		if len(doc.Rows) != 3 || doc.Rows[0].Start != t0.Truncate(time.Hour) || doc.Rows[2].Start != t0.Truncate(time.Hour).Add(time.Hour) {
			t.Fatalf("store %v: rows %+v", withStore, doc.Rows)
		}
		a := doc.Totals[0]
		if a.Tenant != "team-a" || a.Requests != 3 || a.Errors != 1 || a.PromptTokens != 105 || a.CachedTokens != 64 || a.CompletionTokens != 11 || a.TotalTokens != 116 {
			t.Fatalf("store %v: team-a total %+v", withStore, a)
		}

		code, ct, body = get(t, h, "/api/usage?from=2026-11-26T10:00:00Z&to=2026-11-26T11:00:00Z&tenant=team-a", "text/csv")
		want := "start,tenant,model,requests,errors,prompt_tokens,cached_tokens,completion_tokens,total_tokens\n" +
			"2026-11-26T10:00:00Z,team-a,m,2,1,100,64,10,110\n"
		if code != 200 || !strings.HasPrefix(ct, "text/csv") || body != want {
			t.Fatalf("store %v: CSV %d %s\n%s", withStore, code, ct, body)
		}
		if _, _, body2 := get(t, h, "/api/usage?from=2026-11-26T10:00:00Z&to=2026-11-26T11:00:00Z&tenant=team-a&format=csv", ""); body2 != want {
			t.Fatalf("format=csv: %s", body2)
		}
		// Defaults: the last 24 hours up to now.
		if _, _, body := get(t, h, "/api/usage", ""); !strings.Contains(body, `"team-b"`) {
			t.Fatalf("default period: %s", body)
		}
		today, err := l.Today()
		if err != nil || len(today) != 2 {
			t.Fatalf("today %v %v", today, err)
		}
	}
}

func TestLedgerAPIErrors(t *testing.T) {
	h := New(nil, nil).Handler()
	for _, q := range []string{"from=yesterday", "to=2026-13-01T00:00:00Z", "from=2026-11-26T12:00:00Z&to=2026-11-26T11:00:00Z", "format=xml"} {
		if code, _, body := get(t, h, "/api/usage?"+q, ""); code != 400 {
			t.Errorf("%s: %d %s", q, code, body)
		}
	}
}

func TestCollector(t *testing.T) {
	l := New(nil, nil)
	fill(l)
	reg := prometheus.NewRegistry()
	reg.MustRegister(l.Collector())
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	n := 0
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName()+"="+lp.GetValue())
			}
			got[f.GetName()+"{"+strings.Join(labels, ",")+"}"] = m.GetCounter().GetValue()
			n++
		}
	}
	for k, v := range map[string]float64{
		"switchyard_tenant_requests_total{model=m,tenant=team-a}":                   3,
		"switchyard_tenant_errors_total{model=m,tenant=team-a}":                     1,
		"switchyard_tenant_tokens_total{model=m,tenant=team-a,type=prompt}":         105,
		"switchyard_tenant_tokens_total{model=m,tenant=team-a,type=cached}":         64,
		"switchyard_tenant_tokens_total{model=m,tenant=team-a,type=completion}":     11,
		"switchyard_tenant_tokens_total{model=other,tenant=team-b,type=completion}": 3,
	} {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if n != 2*5 {
		t.Fatalf("%d series, want 10: %v", n, got)
	}
}
