// Command scalebench measures from outside what watching a fleet of model
// servers costs switchyard (issue 25): it starts `vllm-sim -fleet N` (N
// simulated vLLM servers in one process, each on its own loopback port,
// each serving vLLM 0.32's ~48 KB metrics page), a `switchyard serve`
// whose one pool lists them, lets it settle, and then reports over a
// window: switchyard's CPU (from /proc), the scrapes each endpoint
// answered per second (counted by the fleet), switchyard's CPU per scrape,
// its RSS and Go heap, and how old its view of each endpoint is (sampled
// from /api/status after the window, so that reading the status does not
// count in the CPU figures).
//
// Two modes: "idle" is the fleet as it is, nobody sending requests (the
// picker reads each endpoint at its idle interval); "busy" sets the pool's
// idle_scrape_interval to its scrape_interval, so every endpoint is read
// as if the picker were sending it requests (the worst case).
//
//	scalebench -sizes 100,1000 -modes idle,busy
//
// With -legacy (for a switchyard built before issue 25) the configuration
// leaves out idle_scrape_interval and serve gets no -debug-addr; only the
// idle mode applies (every endpoint was then read at its interval).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/internal/procstat"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "scalebench:", err)
		os.Exit(1)
	}
}

type options struct {
	sizes      []int
	modes      []string
	window     time.Duration
	warmup     time.Duration
	interval   time.Duration
	switchyard string
	sim        string
	legacy     bool
	heapDir    string
	keep       bool
	delay      time.Duration
}

func parseFlags(args []string) (*options, error) {
	o := &options{}
	exe, _ := os.Executable()
	dir := filepath.Dir(exe)
	fs := flag.NewFlagSet("scalebench", flag.ContinueOnError)
	sizes := fs.String("sizes", "100,1000", "fleet sizes to measure, comma-separated")
	modes := fs.String("modes", "idle,busy", "idle (nobody sends requests) and/or busy (every endpoint read at scrape_interval)")
	fs.DurationVar(&o.window, "window", 30*time.Second, "measurement window per run")
	fs.DurationVar(&o.warmup, "warmup", 10*time.Second, "time after every endpoint answered its first scrape before measuring")
	fs.DurationVar(&o.interval, "interval", 50*time.Millisecond, "the pool's scrape_interval")
	fs.StringVar(&o.switchyard, "switchyard", filepath.Join(dir, "switchyard"), "switchyard binary")
	fs.StringVar(&o.sim, "sim", filepath.Join(dir, "vllm-sim"), "vllm-sim binary")
	fs.BoolVar(&o.legacy, "legacy", false, "the switchyard binary predates issue 25 (no idle_scrape_interval, no -debug-addr)")
	fs.StringVar(&o.heapDir, "heap-dir", "", "write each run's heap profile of switchyard here (go tool pprof -sample_index=inuse_space FILE)")
	fs.BoolVar(&o.keep, "keep", false, "keep the run directories (configuration, logs)")
	fs.DurationVar(&o.delay, "metrics-delay", 0, "the fleet's -metrics-delay: each page answered this late, as real vLLM's (~4 ms), so the engine budget spaces scrapes as for real servers")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	for _, s := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-sizes: %q is not a fleet size", s)
		}
		o.sizes = append(o.sizes, n)
	}
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if m != "idle" && m != "busy" {
			return nil, fmt.Errorf("-modes: %q is neither idle nor busy", m)
		}
		if m == "busy" && o.legacy {
			continue
		}
		o.modes = append(o.modes, m)
	}
	if o.legacy && o.heapDir != "" {
		return nil, errors.New("-heap-dir needs serve's -debug-addr, which -legacy binaries lack")
	}
	return o, nil
}

// result is one run's figures.
type result struct {
	size              int
	mode              string
	cpuCores          float64 // switchyard's CPU in cores over the window
	fleetCores        float64 // the fleet's
	scrapesPerEpSec   float64 // mean over endpoints
	minScrapesPerEp   float64 // the least-scraped endpoint's rate
	cpuPerScrape      time.Duration
	rssMiB            float64
	pageBytes         int
	ageP50, ageP99    time.Duration
	ageMax            time.Duration
	stale, endpoints  int
	interval, maxAge  time.Duration // as the status reports them (median)
	heapMiB           float64
	goroutines        int
	loadBefore, after string
}

func run(args []string, out io.Writer) error {
	o, err := parseFlags(args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	ctx, stop := signalContext()
	defer stop()
	var results []result
	for _, n := range o.sizes {
		for _, mode := range o.modes {
			r, err := measure(ctx, o, n, mode)
			if err != nil {
				return fmt.Errorf("%d endpoints, %s: %w", n, mode, err)
			}
			results = append(results, r)
			fmt.Fprintln(os.Stderr, r.line())
		}
	}
	fmt.Fprintf(out, "\nscrape_interval %v; pages answered after %v; window %v after %v warm-up; %s\n\n", o.interval, o.delay, o.window, o.warmup, binaryNote(o))
	fmt.Fprintln(out, "| fleet | mode | switchyard CPU | scrapes per endpoint per second (least) | CPU per scrape | RSS | Go heap | view age p50 / p99 / max | stale | interval | page | fleet CPU | load avg |")
	fmt.Fprintln(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range results {
		heap := "-"
		if r.heapMiB > 0 {
			heap = fmt.Sprintf("%.0f MiB", r.heapMiB)
		}
		fmt.Fprintf(out, "| %d | %s | %.2f cores | %.2f (%.2f) | %.0f µs | %.0f MiB | %s | %s / %s / %s | %d of %d | %s | %.1f KB | %.2f cores | %s → %s |\n",
			r.size, r.mode, r.cpuCores, r.scrapesPerEpSec, r.minScrapesPerEp, float64(r.cpuPerScrape)/1e3, r.rssMiB, heap,
			ms(r.ageP50), ms(r.ageP99), ms(r.ageMax), r.stale, r.endpoints, ms(r.interval), float64(r.pageBytes)/1000, r.fleetCores, r.loadBefore, r.after)
	}
	return nil
}

func binaryNote(o *options) string {
	if o.legacy {
		return "switchyard " + o.switchyard + " (before issue 25)"
	}
	return "switchyard " + o.switchyard
}

func ms(d time.Duration) string {
	if d < 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f ms", float64(d)/1e6)
}

func (r result) line() string {
	return fmt.Sprintf("%d endpoints, %s: %.2f cores, %.2f scrapes/endpoint/s, %.0f µs/scrape, RSS %.0f MiB, age p99 %s, stale %d",
		r.size, r.mode, r.cpuCores, r.scrapesPerEpSec, float64(r.cpuPerScrape)/1e3, r.rssMiB, ms(r.ageP99), r.stale)
}

// measure runs one fleet size in one mode.
func measure(ctx context.Context, o *options, n int, mode string) (result, error) {
	r := result{size: n, mode: mode}
	dir, err := os.MkdirTemp("", fmt.Sprintf("scalebench-%d-%s-", n, mode))
	if err != nil {
		return r, err
	}
	if !o.keep {
		defer os.RemoveAll(dir)
	} else {
		fmt.Fprintln(os.Stderr, "run directory:", dir)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	// The fleet.
	addrsFile := filepath.Join(dir, "fleet.addrs")
	statsAddr, err := freeAddr()
	if err != nil {
		return r, err
	}
	fleet, err := start(ctx, dir, "fleet", o.sim, "-fleet", strconv.Itoa(n), "-port", "0", "-model", "llama3-8b",
		"-log-level", "warn", "-fleet-addrs-file", addrsFile, "-fleet-stats-addr", statsAddr, "-metrics-delay", o.delay.String())
	if err != nil {
		return r, err
	}
	defer fleet.stop()
	var addrs []string
	if err := poll(ctx, 60*time.Second, "the fleet listening", func() error {
		if err := fleet.exited(); err != nil {
			return err
		}
		b, err := os.ReadFile(addrsFile)
		if err != nil {
			return err
		}
		addrs = strings.Fields(string(b))
		return nil
	}); err != nil {
		return r, err
	}

	// switchyard on a pool of them.
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "pool \"fleet\" {\n  engine = \"vllm\"\n  endpoints = [\n")
	for _, a := range addrs {
		fmt.Fprintf(&cfg, "    %q,\n", a)
	}
	fmt.Fprintf(&cfg, "  ]\n  scheduling {\n    scrape_interval = %q\n", o.interval.String())
	if mode == "busy" {
		fmt.Fprintf(&cfg, "    idle_scrape_interval = %q\n", o.interval.String())
	}
	fmt.Fprintf(&cfg, "  }\n}\n\nmodel \"llama3-8b\" {\n  pool = \"fleet\"\n}\n")
	cfgPath := filepath.Join(dir, "switchyard.hcl")
	if err := os.WriteFile(cfgPath, []byte(cfg.String()), 0o644); err != nil {
		return r, err
	}
	var ports [4]string
	for i := range ports {
		if ports[i], err = freeAddr(); err != nil {
			return r, err
		}
	}
	admin := ports[2]
	syArgs := []string{"serve", "-config", cfgPath, "-extproc-addr", ports[0], "-xds-addr", ports[1], "-admin-addr", admin, "-log-level", "warn"}
	if !o.legacy {
		syArgs = append(syArgs, "-debug-addr", ports[3])
	}
	sy, err := start(ctx, dir, "switchyard", o.switchyard, syArgs...)
	if err != nil {
		return r, err
	}
	defer sy.stop()
	if err := poll(ctx, 120*time.Second, "every endpoint scraped", func() error {
		if err := sy.exited(); err != nil {
			return err
		}
		st, err := status(admin)
		if err != nil {
			return err
		}
		got := 0
		for _, e := range st {
			if e.Waiting != nil {
				got++
			}
		}
		if got < n {
			return fmt.Errorf("%d of %d endpoints scraped", got, n)
		}
		return nil
	}); err != nil {
		return r, err
	}
	select {
	case <-time.After(o.warmup):
	case <-ctx.Done():
		return r, ctx.Err()
	}

	// The window: switchyard's CPU and the fleet's scrape counts.
	r.loadBefore = loadAvg()
	counts0, err := fleetCounts(statsAddr)
	if err != nil {
		return r, err
	}
	cpu0, err := procstat.CPU(sy.pid())
	if err != nil {
		return r, err
	}
	fleet0, err := procstat.CPU(fleet.pid())
	if err != nil {
		return r, err
	}
	t0 := time.Now()
	select {
	case <-time.After(o.window):
	case <-ctx.Done():
		return r, ctx.Err()
	}
	cpu1, err := procstat.CPU(sy.pid())
	if err != nil {
		return r, err
	}
	fleet1, err := procstat.CPU(fleet.pid())
	if err != nil {
		return r, err
	}
	elapsed := time.Since(t0)
	r.fleetCores = float64(fleet1-fleet0) / float64(elapsed)
	counts1, err := fleetCounts(statsAddr)
	if err != nil {
		return r, err
	}
	r.after = loadAvg()
	cpu := cpu1 - cpu0
	r.cpuCores = float64(cpu) / float64(elapsed)
	var total int64
	r.minScrapesPerEp = -1
	for a, c := range counts1 {
		d := c - counts0[a]
		total += d
		rate := float64(d) / elapsed.Seconds()
		if r.minScrapesPerEp < 0 || rate < r.minScrapesPerEp {
			r.minScrapesPerEp = rate
		}
	}
	r.scrapesPerEpSec = float64(total) / elapsed.Seconds() / float64(n)
	if total > 0 {
		r.cpuPerScrape = cpu / time.Duration(total)
	}
	rss, err := procstat.RSS(sy.pid())
	if err != nil {
		return r, err
	}
	r.rssMiB = float64(rss) / (1 << 20)

	// Freshness: the age of every endpoint's view, sampled ten times.
	var ages []time.Duration
	var intervals []time.Duration
	for i := range 10 {
		st, err := status(admin)
		if err != nil {
			return r, err
		}
		for _, e := range st {
			if e.Scrape == nil {
				continue
			}
			if e.Scrape.AgeMS != nil {
				ages = append(ages, time.Duration(*e.Scrape.AgeMS*1e6))
			}
			if e.Scrape.Stale {
				r.stale++
			}
			if i == 0 {
				intervals = append(intervals, time.Duration(e.Scrape.IntervalMS*1e6))
				r.pageBytes = max(r.pageBytes, e.Scrape.PageBytes)
			}
		}
		r.endpoints = len(st)
		time.Sleep(time.Duration(137+i*31) * time.Millisecond) // spread the samples over the intervals
	}
	r.stale /= 10
	r.ageP50, r.ageP99, r.ageMax = -1, -1, -1
	if len(ages) > 0 {
		slices.Sort(ages)
		r.ageP50, r.ageP99, r.ageMax = ages[len(ages)/2], ages[len(ages)*99/100], ages[len(ages)-1]
	}
	r.interval = -1
	if len(intervals) > 0 {
		slices.Sort(intervals)
		r.interval = intervals[len(intervals)/2]
	}
	if !o.legacy {
		if r.heapMiB, r.goroutines, err = heap(ports[3], o.heapDir, n, mode); err != nil {
			return r, err
		}
	}
	return r, nil
}

// endpointStatus is what scalebench reads of /api/status.
type endpointStatus struct {
	Address string `json:"address"`
	Waiting *int   `json:"waiting"`
	Scrape  *struct {
		AgeMS      *float64 `json:"age_ms"`
		Stale      bool     `json:"stale"`
		IntervalMS float64  `json:"interval_ms"`
		PageBytes  int      `json:"page_bytes"`
	} `json:"scrape"`
}

func status(admin string) ([]endpointStatus, error) {
	var st struct {
		Pools []struct {
			Endpoints []endpointStatus `json:"endpoints"`
		} `json:"pools"`
	}
	if err := getJSON("http://"+admin+"/api/status", &st); err != nil {
		return nil, err
	}
	var out []endpointStatus
	for _, p := range st.Pools {
		out = append(out, p.Endpoints...)
	}
	return out, nil
}

func fleetCounts(addr string) (map[string]int64, error) {
	var list []struct {
		Address string `json:"address"`
		Scrapes int64  `json:"metrics_requests"`
	}
	if err := getJSON("http://"+addr+"/fleet", &list); err != nil {
		return nil, err
	}
	out := make(map[string]int64, len(list))
	for _, e := range list {
		out[e.Address] = e.Scrapes
	}
	return out, nil
}

// heap reads switchyard's in-use heap and goroutine count through its
// -debug-addr (and saves the heap profile when dir is set).
func heap(debug, dir string, n int, mode string) (float64, int, error) {
	resp, err := http.Get("http://" + debug + "/debug/pprof/heap?debug=1")
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	var inuse float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		// "# HeapInuse = 12345" among the runtime.MemStats lines.
		if v, ok := strings.CutPrefix(sc.Text(), "# HeapInuse = "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			inuse = f / (1 << 20)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	var goroutines int
	if g, err := http.Get("http://" + debug + "/debug/pprof/goroutine?debug=1"); err == nil {
		line, _ := bufio.NewReader(g.Body).ReadString('\n') // "goroutine profile: total N"
		g.Body.Close()
		goroutines, _ = strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "goroutine profile: total ")))
	}
	if dir != "" {
		p, err := http.Get("http://" + debug + "/debug/pprof/heap")
		if err != nil {
			return 0, 0, err
		}
		defer p.Body.Close()
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("heap-%d-%s.pb.gz", n, mode)))
		if err != nil {
			return 0, 0, err
		}
		defer f.Close()
		if _, err := io.Copy(f, p.Body); err != nil {
			return 0, 0, err
		}
	}
	return inuse, goroutines, nil
}

func getJSON(url string, v any) error {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func poll(ctx context.Context, within time.Duration, what string, cond func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %v: %w", what, within, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// proc is a child process whose output goes to a log file in the run
// directory.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
	log  string
}

func start(ctx context.Context, dir, name, bin string, args ...string) (*proc, error) {
	logPath := filepath.Join(dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); f.Close(); close(p.done) }()
	go func() {
		select {
		case <-p.done:
		case <-ctx.Done():
			p.stop()
		}
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited returns an error quoting the end of the process's log if it has
// ended, nil while it runs.
func (p *proc) exited() error {
	select {
	case <-p.done:
	default:
		return nil
	}
	b, _ := os.ReadFile(p.log)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return fmt.Errorf("%s exited: %s", filepath.Base(p.log), b)
}

// stop ends the process: SIGTERM, then SIGKILL after 10 s.
func (p *proc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}
