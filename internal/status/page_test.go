package status

import (
	"bytes"
	"encoding/json"
	"html"
	"image"
	"image/color"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/picker/decisions"
)

// The status page in a real (headless) browser draws its four charts
// from /api/history, the latency table and the recent decisions. The
// screenshot is kept with SWITCHYARD_SCREENSHOT_DIR set.
func TestStatusPageChartsInChromium(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a browser")
	}
	testutil.ChromiumPath(t)
	src, pub, _ := liveSources(t)
	pub.Publish(state(1))

	// 15 minutes of samples with load that varies, as History keeps them.
	h := NewHistory(src.Picker, 0, 0)
	now := time.Now()
	f := func(v float64) float32 { return float32(v) }
	for i := 0; i < h.size; i++ {
		x := float64(i) / float64(h.size)
		pt := histPoint{t: now.Add(time.Duration(i-h.size) * h.interval), pools: map[string]int{"p": int(6 * x)}}
		for k, addr := range []string{"127.0.0.1:18001", "127.0.0.1:18002"} {
			ph := float64(k) * 1.3
			pt.keys = append(pt.keys, epKey{"p", addr})
			pt.eps = append(pt.eps, epSample{
				waiting: f(math.Round(4 + 3*math.Sin(8*x+ph))), running: f(8), kv: f(0.4 + 0.3*math.Sin(5*x+ph)),
				inFlight: f(math.Round(10 + 6*math.Cos(6*x+ph))),
				ttft50:   f(40 + 20*math.Sin(7*x+ph)), ttft90: f(90 + 30*math.Sin(7*x+ph)),
				eng50: f(30 + 15*math.Sin(7*x+ph)), eng90: f(70 + 20*math.Sin(7*x+ph)),
			})
		}
		h.points = append(h.points, pt)
	}
	src.History = h
	rec := decisions.New(decisions.Options{})
	rec.Add(&decisions.Record{Time: now, Model: "chat", Target: "m", Pool: "p", PoolSize: 2,
		Scorers:   []decisions.Scorer{{Name: "queue", Weight: 2}, {Name: "prefix", Weight: 3}},
		Endpoints: []string{"127.0.0.1:18001", "127.0.0.1:18002"}, Candidates: []int32{0, 1}, Totals: []float32{4.2, 1.5},
		Scores: []uint16{decisions.QuantizeScore(0.6), decisions.QuantizeScore(0.75), decisions.QuantizeScore(1), decisions.QuantizeScore(0)},
		Picked: "127.0.0.1:18001", Fallbacks: []string{"127.0.0.1:18002"}, Status: 200, Served: "127.0.0.1:18001",
		TTFT: 42 * time.Millisecond, Duration: time.Second, OutputTokens: 64, Queued: true, QueueWait: 12 * time.Millisecond, QueueOutcome: "dispatched"})
	src.Decisions = rec

	mux := http.NewServeMux()
	src.Register(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()

	dom := string(testutil.Headless(t, 1280, 2000, "--dump-dom", srv.URL+"/"))
	charts := regexp.MustCompile(`<div class="chart" id="(chart-[a-z]+)"><h3>[^<]*</h3><canvas [^>]*data-series="(\d+)" data-points="(\d+)"`).FindAllStringSubmatch(dom, -1)
	drawn := map[string][2]int{}
	for _, m := range charts {
		s, _ := strconv.Atoi(m[2])
		p, _ := strconv.Atoi(m[3])
		drawn[m[1]] = [2]int{s, p}
	}
	want := map[string][2]int{
		"chart-queue":    {3, 3 * h.size}, // two servers and the pool's admission queue
		"chart-kv":       {2, 2 * h.size},
		"chart-inflight": {2, 2 * h.size},
		"chart-ttft":     {4, 4 * h.size}, // p50 and p90 of each
	}
	for id, w := range want {
		if drawn[id] != w {
			t.Errorf("%s drew %d series and %d points, want %v", id, drawn[id][0], drawn[id][1], w)
		}
	}
	if missing := testutil.ContainsAll(dom, "127.0.0.1:18001 4.20: ", "chat → m", "queue=0.60 prefix=1.00", "queue=0.75 prefix=0.00", "12 ms, dispatched", "42.0 ms",
		"1 recorded since start", "router p50"); len(missing) > 0 {
		t.Errorf("page lacks %q:\n%s", missing, dom)
	}

	shot := filepath.Join(t.TempDir(), "status-charts.png")
	if dir := os.Getenv("SWITCHYARD_SCREENSHOT_DIR"); dir != "" {
		shot = filepath.Join(dir, "status-charts.png")
	}
	testutil.Headless(t, 1280, 2000, "--screenshot="+shot, srv.URL+"/")
	img := testutil.DecodePNG(t, shot)
	// The series colours of the first two endpoints appear as lines: many
	// pixels of each, not a legend swatch alone.
	for _, c := range []color.RGBA{{0x4a, 0x7b, 0xd0, 0xff}, {0xd0, 0x67, 0x4a, 0xff}} {
		if n := countNear(img, c); n < 400 {
			t.Errorf("screenshot has %d pixels of series colour %v: charts not drawn", n, c)
		}
	}
}

// countNear counts pixels within a small distance of c.
func countNear(img image.Image, c color.RGBA) int {
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			if absDiff(r>>8, uint32(c.R)) < 24 && absDiff(g>>8, uint32(c.G)) < 24 && absDiff(bl>>8, uint32(c.B)) < 24 {
				n++
			}
		}
	}
	return n
}

func absDiff(a, b uint32) uint32 {
	if a > b {
		return a - b
	}
	return b - a
}

// layoutProbe, added to the status page by TestStatusPageFitsAt1280,
// waits until the page has rendered every part the test fills, then
// writes what overflows the window horizontally into <pre id="probe">:
// the document's scroll and client widths, and each element whose right
// edge is past the window.
const layoutProbe = `<script>
(function probe() {
  const rendered = document.querySelector("#pools tbody tr") && document.querySelector("#decisions tbody tr") &&
    document.querySelectorAll(".chart canvas[data-points]").length === 4 && document.getElementById("xds").textContent.startsWith("snapshot");
  if (!rendered) return setTimeout(probe, 50);
  const d = document.documentElement, over = [];
  for (const e of document.querySelectorAll("body *")) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && r.right > d.clientWidth + 0.5) over.push(e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (e.className ? "." + e.className : "") + " right=" + Math.round(r.right));
  }
  document.body.append(Object.assign(document.createElement("pre"), { id: "probe",
    textContent: JSON.stringify({ scrollWidth: d.scrollWidth, clientWidth: d.clientWidth, over }) }));
})();
</script>`

// The status page fits a 1,280 px window: with realistic content (the
// xDS snapshot version, content-addressed versions Envoys acked, a long
// node ID, errors, three endpoints' charts, decisions) nothing is wider
// than the window and the page does not scroll sideways. The same page
// shows why an endpoint whose scrapes fail is still routed to.
func TestStatusPageFitsAt1280(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a browser")
	}
	testutil.ChromiumPath(t)
	r := build(sample())
	hex := "46e863b1a2c3d4e5f6a7b8c9" // 12 bytes, as xds versions are
	r.XDS.Version = "Cluster=" + hex + ",ClusterLoadAssignment=" + hex + ",Listener=" + hex + ",RouteConfiguration=" + hex
	r.Envoys[0].ID = "ip-10-0-12-34.eu-west-1.compute.internal/envoy-edge-7f9c6d5b8-xk2lp"
	r.Envoys[0].Acked = map[string]string{"Cluster": hex, "ClusterLoadAssignment": hex, "Listener": hex, "RouteConfiguration": hex}
	r.Envoys[0].LastNACK = "Proto constraint validation failed (ClusterValidationError.LoadAssignment: embedded message failed validation | caused by ClusterLoadAssignmentValidationError.Endpoints[0]): " + strings.Repeat(hex, 3)
	report, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}

	h := NewHistory(nil, 0, 0)
	now := time.Now()
	f := func(v float64) float32 { return float32(v) }
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000"}
	for i := 0; i < h.size; i++ {
		x := float64(i) / float64(h.size)
		pt := histPoint{t: now.Add(time.Duration(i-h.size) * h.interval), pools: map[string]int{"llama": int(6 * x)}}
		for k, addr := range addrs {
			ph := float64(k) * 1.3
			pt.keys = append(pt.keys, epKey{"llama", addr})
			pt.eps = append(pt.eps, epSample{waiting: f(math.Round(4 + 3*math.Sin(8*x+ph))), running: f(8), kv: f(0.4 + 0.3*math.Sin(5*x+ph)),
				inFlight: 3, ttft50: f(40), ttft90: f(90), eng50: f(30), eng90: f(70)})
		}
		h.points = append(h.points, pt)
	}
	rec := decisions.New(decisions.Options{})
	rec.Add(&decisions.Record{Time: now, Model: "chat", Target: "meta-llama/Llama-3.1-8B-Instruct", Pool: "llama", PoolSize: 3,
		Scorers:   []decisions.Scorer{{Name: "queue", Weight: 2}, {Name: "kv-cache", Weight: 1}, {Name: "prefix", Weight: 3}},
		Endpoints: addrs, Candidates: []int32{0, 1, 2}, Totals: []float32{4.2, 3.1, 1.5},
		Scores: []uint16{decisions.QuantizeScore(0.6), decisions.QuantizeScore(0.5), decisions.QuantizeScore(1),
			decisions.QuantizeScore(0.75), decisions.QuantizeScore(0.2), decisions.QuantizeScore(0.5),
			decisions.QuantizeScore(0.1), decisions.QuantizeScore(0.9), decisions.QuantizeScore(0)},
		Picked: addrs[0], Fallbacks: addrs[1:], Status: 200, Served: addrs[0], TTFT: 42 * time.Millisecond, OutputTokens: 64})

	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(bytes.Replace(statusPage, []byte("</body>"), []byte(layoutProbe+"</body>"), 1))
	})
	mux.HandleFunc("GET /api/status", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(report) })
	mux.HandleFunc("GET /api/history", h.serve)
	mux.HandleFunc("GET /api/decisions", (&Sources{Decisions: rec}).serveDecisions)
	srv := httptest.NewServer(mux)
	defer srv.Close()

	dom := string(testutil.Headless(t, 1280, 2000, "--dump-dom", srv.URL+"/"))
	m := regexp.MustCompile(`<pre id="probe">([^<]*)</pre>`).FindStringSubmatch(dom)
	if m == nil {
		t.Fatalf("the page did not render everything the test fills:\n%s", dom)
	}
	var probe struct {
		ScrollWidth, ClientWidth int
		Over                     []string
	}
	if err := json.Unmarshal([]byte(html.UnescapeString(m[1])), &probe); err != nil {
		t.Fatalf("probe %q: %v", m[1], err)
	}
	if probe.ClientWidth != 1280 {
		t.Fatalf("window %d px wide, want 1280", probe.ClientWidth)
	}
	if probe.ScrollWidth > probe.ClientWidth {
		t.Errorf("the page scrolls sideways: %d px wide in a %d px window", probe.ScrollWidth, probe.ClientWidth)
	}
	if len(probe.Over) > 0 {
		t.Errorf("%d elements end past the window's right edge, e.g. %q", len(probe.Over), probe.Over[:min(len(probe.Over), 10)])
	}

	// The endpoint refusing every connection alone in its pool: failing,
	// with its scrapes' error and why it is still routed to.
	soloRow := regexp.MustCompile(`<tr><td>10\.0\.2\.1:8000</td><td>(.*?)</td>`).FindStringSubmatch(dom)
	if soloRow == nil {
		t.Fatalf("no row for 10.0.2.1:8000:\n%s", dom)
	}
	if missing := testutil.ContainsAll(html.UnescapeString(soloRow[1]), "failing, still routed", "none succeeded yet", "connection refused",
		`<div class="meta small routed-reason">still routed: no other endpoint of its pool answers its metrics scrapes`); len(missing) > 0 {
		t.Errorf("state of 10.0.2.1:8000 lacks %q: %s", missing, soloRow[1])
	}
	// One withheld beside an answering endpoint shows no such reason.
	if row := regexp.MustCompile(`<tr><td>10\.0\.0\.2:8000</td><td>(.*?)</td>`).FindStringSubmatch(dom); row == nil ||
		!strings.Contains(row[1], ">unhealthy<") || strings.Contains(row[1], "routed") {
		t.Errorf("state of 10.0.0.2:8000: %v", row)
	}
}
