package status

import (
	"image"
	"image/color"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
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
