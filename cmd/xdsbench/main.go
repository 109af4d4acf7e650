// Command xdsbench measures switchyard's xDS server at fleet scale, from
// outside: it starts a fleet of loopback model servers (one child process,
// N ports serving a vLLM-shaped /metrics page), a real `switchyard serve`
// on an HCL file listing them in pools, one real Envoy and many Go ADS
// clients (internal/adsclient, state of the world or incremental), then
// reports
//   - initial sync: how long each client and Envoy take to hold every
//     resource;
//   - changes: endpoints removed from and put back into the HCL file one at
//     a time; how long until every client and Envoy see it, what the file
//     write to published state took (serve's own log), and what each
//     client received for it (EDS responses, resources, bytes);
//   - a hiccup: every /metrics answer stalls (or the CPU is saturated) for
//     a while; how many EDS pushes, registry publishes and snapshots
//     followed, though no endpoint changed;
//   - serve's CPU and memory with no client and with every client
//     connected, per client.
//
// `make bench-xds` runs it for both protocols. Only loopback addresses
// are ever configured.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/switchyard/switchyard/envoy"
	"github.com/switchyard/switchyard/internal/adsclient"
	"github.com/switchyard/switchyard/xds/ir"
)

type config struct {
	switchyard  string
	envoy       string
	endpoints   int
	pools       int
	clients     int
	delta       bool
	envoyDelta  bool
	changes     int
	scrape      string
	hiccup      string
	hiccupFor   time.Duration
	hiccupShare float64
	settle      time.Duration
	page        string
	jsonOut     string
	keep        bool
	verbose     bool
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "fleet" {
		fs := flag.NewFlagSet("fleet", flag.ExitOnError)
		n := fs.Int("n", 1000, "endpoints")
		page := fs.String("page", "", "metrics page file")
		_ = fs.Parse(os.Args[2:])
		if err := fleetMain(*n, *page); err != nil {
			fmt.Fprintln(os.Stderr, "fleet:", err)
			os.Exit(1)
		}
		return
	}
	var c config
	fs := flag.NewFlagSet("xdsbench", flag.ExitOnError)
	fs.StringVar(&c.switchyard, "switchyard", "bin/switchyard", "switchyard binary")
	fs.StringVar(&c.envoy, "envoy", os.Getenv("SWITCHYARD_ENVOY"), "Envoy binary (empty: no real Envoy)")
	fs.IntVar(&c.endpoints, "endpoints", 1000, "loopback model servers")
	fs.IntVar(&c.pools, "pools", 20, "pools they are split into")
	fs.IntVar(&c.clients, "clients", 100, "Go ADS clients")
	proto := fs.String("protocol", "sotw", "protocol of the Go clients and Envoy: sotw or delta")
	fs.IntVar(&c.changes, "changes", 20, "endpoint changes (alternately removing one endpoint and putting it back)")
	fs.StringVar(&c.scrape, "scrape-interval", "", "pools' scrape_interval (empty: switchyard's default)")
	fs.StringVar(&c.hiccup, "hiccup", "stall", "hiccup: stall (every /metrics answer waits -hiccup-for), cpu (one spinning goroutine per CPU for -hiccup-for) or none")
	fs.DurationVar(&c.hiccupFor, "hiccup-for", 5*time.Second, "hiccup length")
	fs.Float64Var(&c.hiccupShare, "hiccup-share", 0.5, "share of /metrics answers a stall hiccup delays (each past the scrape timeout)")
	fs.DurationVar(&c.settle, "settle", 10*time.Second, "scraping time before clients connect, and quiet time after the hiccup")
	fs.StringVar(&c.page, "page", "cmd/vllm-sim/testdata/vllm-0.32.0/metrics.txt", "vLLM /metrics page the fleet serves (HTTP-instrumentator families and _created series are dropped)")
	fs.StringVar(&c.jsonOut, "json", "", "also write the report as JSON to this file")
	fs.BoolVar(&c.keep, "keep", false, "keep the work directory (config, serve and Envoy logs)")
	fs.BoolVar(&c.verbose, "v", false, "progress on stderr")
	_ = fs.Parse(os.Args[1:])
	switch *proto {
	case "sotw":
	case "delta":
		c.delta, c.envoyDelta = true, true
	default:
		fmt.Fprintln(os.Stderr, "xdsbench: -protocol must be sotw or delta")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := run(ctx, c)
	if rep != nil {
		rep.print(os.Stdout)
		if c.jsonOut != "" {
			b, _ := json.MarshalIndent(rep, "", "  ")
			_ = os.WriteFile(c.jsonOut, b, 0o644)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdsbench:", err)
		os.Exit(1)
	}
}

// bench is one run's processes and state.
type bench struct {
	c        config
	dir      string
	fleet    *fleet
	serve    *child
	log      *logFollower
	admin    string
	xdsAddr  string
	listen   int
	envoy    *child
	envoyURL string
	clients  []*adsclient.Client
	conns    []*grpc.ClientConn
	// removed is the endpoint taken out by the last odd change ("" if none).
	cfgEndpoints map[string][]string // pool -> endpoints in the file
}

func (b *bench) logf(f string, a ...any) {
	if b.c.verbose {
		fmt.Fprintf(os.Stderr, "%s "+f+"\n", append([]any{time.Now().Format("15:04:05.000")}, a...)...)
	}
}

func run(ctx context.Context, c config) (*report, error) {
	dir, err := os.MkdirTemp("", "xdsbench-")
	if err != nil {
		return nil, err
	}
	b := &bench{c: c, dir: dir, log: newLogFollower()}
	defer b.close()
	rep := &report{Protocol: map[bool]string{false: "sotw", true: "delta"}[c.delta], Endpoints: c.endpoints, Pools: c.pools, Clients: c.clients, Envoys: boolInt(c.envoy != ""),
		ScrapeInterval: c.scrape, Hiccup: c.hiccup, HiccupFor: c.hiccupFor.String()}
	if la, err := os.ReadFile("/proc/loadavg"); err == nil {
		rep.LoadAvgStart = strings.TrimSpace(string(la))
	}
	if err := b.startFleet(); err != nil {
		return nil, err
	}
	if err := b.startServe(ctx); err != nil {
		return nil, err
	}
	b.logf("serve up; scraping for %s", c.settle)
	if err := sleepCtx(ctx, c.settle); err != nil {
		return rep, err
	}
	idle, err := b.usageOver(ctx, 10*time.Second)
	if err != nil {
		return rep, err
	}
	rep.ServeNoClients = idle

	// Initial sync: every client and Envoy at once.
	if err := b.connect(ctx, rep); err != nil {
		return rep, err
	}
	if err := sleepCtx(ctx, 2*time.Second); err != nil {
		return rep, err
	}
	conn, err := b.usageOver(ctx, 10*time.Second)
	if err != nil {
		return rep, err
	}
	rep.ServeClients = conn
	if n := float64(c.clients + boolInt(c.envoy != "")); n > 0 {
		rep.PerClient.RSSKiB = float64(conn.RSS-idle.RSS) / 1024 / n
		rep.PerClient.HeapKiB = float64(conn.Heap-idle.Heap) / 1024 / n
		rep.PerClient.IdleCPUPercent = (conn.CPUPercent - idle.CPUPercent) / n
	}

	if err := b.changes(ctx, rep); err != nil {
		return rep, err
	}
	if c.hiccup != "none" {
		if err := b.hiccup(ctx, rep); err != nil {
			return rep, err
		}
	}
	for _, cl := range b.clients {
		if err := cl.Err(); err != nil {
			return rep, fmt.Errorf("client stopped: %w", err)
		}
	}
	if la, err := os.ReadFile("/proc/loadavg"); err == nil {
		rep.LoadAvgEnd = strings.TrimSpace(string(la))
	}
	return rep, nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (b *bench) close() {
	for _, cc := range b.conns {
		_ = cc.Close()
	}
	if b.envoy != nil {
		b.envoy.stop()
	}
	if b.serve != nil {
		b.serve.stop()
	}
	if b.fleet != nil {
		_ = b.fleet.ctl.Close()
		b.fleet.proc.stop()
	}
	if b.c.keep {
		fmt.Fprintln(os.Stderr, "xdsbench: work directory kept:", b.dir)
	} else {
		_ = os.RemoveAll(b.dir)
	}
}

func (b *bench) startFleet() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, "fleet", "-n", strconv.Itoa(b.c.endpoints), "-page", b.c.page)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start fleet: %w", err)
	}
	ch := &child{name: "fleet", cmd: cmd, done: make(chan struct{})}
	var addrs []string
	rd := bufio.NewReader(stdout)
	line, derr := rd.ReadBytes('\n')
	if derr == nil {
		derr = json.Unmarshal(line, &addrs)
	}
	b.fleet = &fleet{ctl: stdin, proc: ch, addrs: addrs, counts: make(chan int64, 1)}
	go func() {
		for {
			l, err := rd.ReadString('\n')
			if err != nil {
				break
			}
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "scrapes "); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				b.fleet.counts <- n
			}
		}
		_ = cmd.Wait()
		close(ch.done)
	}()
	if derr != nil {
		return fmt.Errorf("fleet addresses: %w", derr)
	}
	b.logf("fleet: %d endpoints", len(addrs))
	return nil
}

func (b *bench) poolName(i int) string { return fmt.Sprintf("p%02d", i) }

// writeConfig writes the HCL file (atomically: temp file and rename) and
// returns when it was written.
func (b *bench) writeConfig() (time.Time, error) {
	var s strings.Builder
	fmt.Fprintf(&s, "listener \"public\" {\n  address = \"127.0.0.1:%d\"\n}\n\n", b.listen)
	for i := range b.c.pools {
		p := b.poolName(i)
		fmt.Fprintf(&s, "pool %q {\n  engine = \"vllm\"\n  endpoints = [", p)
		for j, a := range b.cfgEndpoints[p] {
			if j > 0 {
				s.WriteString(", ")
			}
			fmt.Fprintf(&s, "%q", a)
		}
		s.WriteString("]\n")
		if b.c.scrape != "" {
			fmt.Fprintf(&s, "  scheduling {\n    scrape_interval = %q\n  }\n", b.c.scrape)
		}
		s.WriteString("}\n\n")
		fmt.Fprintf(&s, "model \"m-%s\" {\n  pool = %q\n}\n\n", p, p)
	}
	path := filepath.Join(b.dir, "config", "switchyard.hcl")
	tmp := filepath.Join(b.dir, "switchyard.hcl.tmp")
	if err := os.WriteFile(tmp, []byte(s.String()), 0o644); err != nil {
		return time.Time{}, err
	}
	at := time.Now()
	return at, os.Rename(tmp, path)
}

func (b *bench) startServe(ctx context.Context) error {
	b.cfgEndpoints = map[string][]string{}
	for i, a := range b.fleet.addrs {
		p := b.poolName(i % b.c.pools)
		b.cfgEndpoints[p] = append(b.cfgEndpoints[p], a)
	}
	var err error
	if b.listen, err = freePort(); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(b.dir, "config"), 0o755); err != nil {
		return err
	}
	if _, err := b.writeConfig(); err != nil {
		return err
	}
	ports := make([]int, 3)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return err
		}
	}
	b.xdsAddr = fmt.Sprintf("127.0.0.1:%d", ports[0])
	b.admin = fmt.Sprintf("http://127.0.0.1:%d", ports[2])
	logFile, err := os.Create(filepath.Join(b.dir, "serve.log"))
	if err != nil {
		return err
	}
	pr, pw := io.Pipe()
	go b.log.follow(pr, logFile)
	b.serve, err = startChild("serve", io.Discard, pw, b.c.switchyard, "serve",
		"-config", filepath.Join(b.dir, "config"),
		"-xds-addr", b.xdsAddr,
		"-extproc-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"-admin-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]),
		"-log-format", "json", "-drain-delay", "0s")
	if err != nil {
		return err
	}
	go func() { <-b.serve.done; _ = pw.Close() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, snaps := b.log.counts(); snaps > 0 {
			return nil
		}
		select {
		case <-b.serve.done:
			return errors.New("serve exited; see its log (-keep)")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return errors.New("serve set no xDS snapshot within 30s")
		}
	}
}

// usage is serve's resource use over a window.
type usage struct {
	CPUPercent float64 `json:"cpu_percent"` // of one core
	RSS        int64   `json:"rss_bytes"`
	Heap       int64   `json:"heap_inuse_bytes"`
	// ScrapesPerEndpointPerSecond is the /metrics requests the fleet
	// answered, per endpoint and second.
	ScrapesPerEndpointPerSecond float64 `json:"scrapes_per_endpoint_per_second"`
}

func (b *bench) usageOver(ctx context.Context, d time.Duration) (usage, error) {
	u0, err := readUsage(b.serve.pid())
	if err != nil {
		return usage{}, err
	}
	s0, err := b.fleet.scrapes()
	if err != nil {
		return usage{}, err
	}
	t0 := time.Now()
	// The heap is sampled through the window and its least value kept:
	// close to the live heap after a collection, not the garbage of the
	// moment.
	minHeap := int64(-1)
	for time.Since(t0) < d {
		if h, err := heapInuse(b.admin); err == nil && (minHeap < 0 || h < minHeap) {
			minHeap = h
		}
		if err := sleepCtx(ctx, 250*time.Millisecond); err != nil {
			return usage{}, err
		}
	}
	u1, err := readUsage(b.serve.pid())
	if err != nil {
		return usage{}, err
	}
	s1, err := b.fleet.scrapes()
	if err != nil {
		return usage{}, err
	}
	el := time.Since(t0)
	return usage{CPUPercent: 100 * float64(u1.CPU-u0.CPU) / float64(el), RSS: u1.RSS, Heap: minHeap,
		ScrapesPerEndpointPerSecond: float64(s1-s0) / el.Seconds() / float64(len(b.fleet.addrs))}, nil
}

func (b *bench) startEnvoy() error {
	admin, err := freePort()
	if err != nil {
		return err
	}
	_, port, _ := strings.Cut(b.xdsAddr, ":")
	xdsPort, _ := strconv.Atoi(port)
	p := envoy.Params{NodeID: "real-envoy", NodeCluster: "bench", XDSHost: "127.0.0.1", XDSPort: xdsPort, AdminPort: admin}
	if b.c.envoyDelta {
		p.ADSAPIType = envoy.APITypeDelta
	} else {
		p.ADSAPIType = envoy.APITypeSotW
	}
	cfg, err := envoy.Bootstrap(p)
	if err != nil {
		return err
	}
	path := filepath.Join(b.dir, "envoy.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return err
	}
	logFile, err := os.Create(filepath.Join(b.dir, "envoy.log"))
	if err != nil {
		return err
	}
	b.envoyURL = fmt.Sprintf("http://127.0.0.1:%d", admin)
	b.envoy, err = startChild("envoy", logFile, logFile, b.c.envoy, "-c", path, "--use-dynamic-base-id", "-l", "warning",
		"--concurrency", "1", "--drain-time-s", "0")
	return err
}

// envoyGet fetches an admin path.
func (b *bench) envoyGet(path string) (string, error) {
	resp, err := http.Get(b.envoyURL + path)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return string(body), fmt.Errorf("%s: %s", path, resp.Status)
	}
	return string(body), err
}

// envoyHas reports whether Envoy's ClusterLoadAssignment of cluster
// lists addr (its EDS config dump, that one resource only).
func (b *bench) envoyHas(cluster, addr string) (bool, error) {
	s, err := b.envoyGet("/config_dump?include_eds&resource=dynamic_endpoint_configs&name_regex=" + regexpQuote(cluster) + "$")
	if err != nil {
		return false, err
	}
	_, port, _ := strings.Cut(addr, ":")
	if !strings.Contains(s, `"cluster_name": "`+cluster+`"`) {
		return false, fmt.Errorf("no endpoints of %s in Envoy", cluster)
	}
	// Every fleet endpoint is on 127.0.0.1 with a port of its own.
	return regexp.MustCompile(`"port_value": ` + port + `\b`).MatchString(s), nil
}

func regexpQuote(s string) string {
	var out strings.Builder
	out.WriteByte('^')
	for _, r := range s {
		if strings.ContainsRune(`\.+*?()|[]{}^$`, r) {
			out.WriteByte('\\')
		}
		out.WriteRune(r)
	}
	return strings.ReplaceAll(out.String(), "/", "%2F")
}

// waitEnvoy polls cond every 5 ms until it holds.
func waitEnvoy(ctx context.Context, within time.Duration, cond func() bool) (time.Time, error) {
	deadline := time.Now().Add(within)
	for {
		if cond() {
			return time.Now(), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, errors.New("envoy did not converge")
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			return time.Time{}, err
		}
	}
}

func (b *bench) connect(ctx context.Context, rep *report) error {
	start := time.Now()
	if b.c.envoy != "" {
		if err := b.startEnvoy(); err != nil {
			return err
		}
	}
	b.clients = make([]*adsclient.Client, b.c.clients)
	for i := range b.clients {
		cc, err := grpc.NewClient(b.xdsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			return err
		}
		b.conns = append(b.conns, cc)
		b.clients[i] = adsclient.Start(ctx, cc, adsclient.Options{NodeID: fmt.Sprintf("sim-%03d", i), Delta: b.c.delta})
	}
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	var firstErr error
	for _, cl := range b.clients {
		wg.Go(func() {
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			at, err := cl.Wait(wctx, adsclient.View.Synced)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				firstErr = cmpErr(firstErr, fmt.Errorf("initial sync: %w", err))
				return
			}
			lat = append(lat, at.Sub(start))
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	rep.InitialSync = summarize(lat)
	if b.envoy != nil {
		at, err := waitEnvoy(ctx, 60*time.Second, func() bool {
			s, err := b.envoyGet("/ready")
			return err == nil && strings.TrimSpace(s) == "LIVE"
		})
		if err != nil {
			return err
		}
		rep.EnvoyInitialSyncMS = ms(at.Sub(start))
	}
	var bytes int64
	for _, cl := range b.clients {
		for _, st := range cl.Stats() {
			bytes += st.Bytes
		}
	}
	rep.InitialBytesPerClient = bytes / int64(max(len(b.clients), 1))
	b.logf("initial sync: p50 %.0f ms max %.0f ms", rep.InitialSync.P50, rep.InitialSync.Max)
	return nil
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// changes removes an endpoint from the file and puts it back, alternately,
// and measures how each change reaches every client and Envoy.
func (b *bench) changes(ctx context.Context, rep *report) error {
	rnd := rand.New(rand.NewPCG(1, 2))
	var all []time.Duration
	var removed struct{ pool, addr string }
	u0, _ := readUsage(b.serve.pid())
	t0 := time.Now()
	for i := range b.c.changes {
		var pool, addr string
		present := false
		if removed.addr == "" {
			pool = b.poolName(rnd.IntN(b.c.pools))
			eps := b.cfgEndpoints[pool]
			k := rnd.IntN(len(eps))
			addr = eps[k]
			b.cfgEndpoints[pool] = slices.Delete(slices.Clone(eps), k, k+1)
			removed.pool, removed.addr = pool, addr
		} else {
			pool, addr, present = removed.pool, removed.addr, true
			b.cfgEndpoints[pool] = append(b.cfgEndpoints[pool], addr)
			slices.Sort(b.cfgEndpoints[pool])
			removed.pool, removed.addr = "", ""
		}
		cluster := ir.ClusterName(pool)
		before := make([]map[string]adsclient.TypeStats, len(b.clients))
		for j, cl := range b.clients {
			before[j] = cl.Stats()
		}
		wrote, err := b.writeConfig()
		if err != nil {
			return err
		}
		ch := changeReport{Change: i + 1, Pool: pool, Endpoint: addr, Added: present}
		var mu sync.Mutex
		var lat []time.Duration
		var wg sync.WaitGroup
		var firstErr error
		for _, cl := range b.clients {
			wg.Go(func() {
				wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				at, err := cl.Wait(wctx, func(v adsclient.View) bool {
					eps, ok := v.Endpoints(cluster)
					return ok && slices.Contains(eps, addr) == present
				})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					firstErr = cmpErr(firstErr, fmt.Errorf("change %d: %w", i+1, err))
					return
				}
				lat = append(lat, at.Sub(wrote))
			})
		}
		if b.envoy != nil {
			at, err := waitEnvoy(ctx, 30*time.Second, func() bool {
				has, err := b.envoyHas(cluster, addr)
				return err == nil && has == present
			})
			if err != nil {
				return fmt.Errorf("change %d: %w", i+1, err)
			}
			ch.EnvoyMS = ms(at.Sub(wrote))
		}
		wg.Wait()
		if firstErr != nil {
			return firstErr
		}
		all = append(all, lat...)
		s := summarize(lat)
		ch.ClientsP50MS, ch.ClientsMaxMS = s.P50, s.Max
		if pub, snap, ok := b.log.after(wrote, 5*time.Second); ok {
			ch.PublishedMS = ms(pub.Time.Sub(wrote))
			ch.SnapshotMS = ms(snap.Time.Sub(wrote))
		}
		var resp, res, bytes int64
		for j, cl := range b.clients {
			after := cl.Stats()
			for typ, st := range after {
				bytes += st.Bytes - before[j][typ].Bytes
				if typ == resource.EndpointType {
					resp += int64(st.Responses - before[j][typ].Responses)
					res += int64(st.Resources - before[j][typ].Resources)
				}
			}
		}
		n := int64(max(len(b.clients), 1))
		ch.EDSResponsesPerClient = float64(resp) / float64(n)
		ch.EDSResourcesPerClient = float64(res) / float64(n)
		ch.BytesPerClient = bytes / n
		rep.Changes = append(rep.Changes, ch)
		b.logf("change %d (%s %s): clients p50 %.0f max %.0f ms, envoy %.0f ms, published %.0f ms, %d B/client",
			i+1, pool, addr, ch.ClientsP50MS, ch.ClientsMaxMS, ch.EnvoyMS, ch.PublishedMS, ch.BytesPerClient)
		// Let the change's pushes drain before the next one.
		if err := sleepCtx(ctx, 300*time.Millisecond); err != nil {
			return err
		}
	}
	u1, _ := readUsage(b.serve.pid())
	rep.ChangeLatency = summarize(all)
	var worst []float64
	for _, ch := range rep.Changes {
		worst = append(worst, max(ch.ClientsMaxMS, ch.EnvoyMS))
		rep.PublishedMS = append(rep.PublishedMS, ch.PublishedMS)
	}
	rep.WorstPerChange = summarizeMS(worst)
	el := time.Since(t0)
	rep.ChangesCPUPercent = 100 * float64(u1.CPU-u0.CPU) / float64(el)
	// What the changes cost beyond serve's idle rate with every client
	// connected, per change and client.
	extra := (u1.CPU - u0.CPU).Seconds() - rep.ServeClients.CPUPercent/100*el.Seconds()
	if n := b.c.changes * (b.c.clients + boolInt(b.envoy != nil)); n > 0 {
		rep.PerClient.CPUPerChangeMicros = max(0, extra) / float64(n) * 1e6
		rep.PerClient.CPUPerChangeGrossMicros = (u1.CPU - u0.CPU).Seconds() / float64(n) * 1e6
	}
	return nil
}

// hiccup stalls every /metrics answer (or burns the CPU) and counts what
// reached the clients although no endpoint changed.
func (b *bench) hiccup(ctx context.Context, rep *report) error {
	before := make([]map[string]adsclient.TypeStats, len(b.clients))
	for j, cl := range b.clients {
		before[j] = cl.Stats()
	}
	pub0, snap0 := b.log.counts()
	switch b.c.hiccup {
	case "stall":
		b.fleet.send(fmt.Sprintf("stall %s %g", b.c.hiccupFor, b.c.hiccupShare))
	case "cpu":
		b.fleet.send("burn " + b.c.hiccupFor.String())
	default:
		return fmt.Errorf("unknown -hiccup %q", b.c.hiccup)
	}
	b.logf("hiccup %s for %s", b.c.hiccup, b.c.hiccupFor)
	if err := sleepCtx(ctx, b.c.hiccupFor+b.c.settle); err != nil {
		return err
	}
	pub1, snap1 := b.log.counts()
	h := hiccupReport{Published: pub1 - pub0, Snapshots: snap1 - snap0}
	var resp, bytes int64
	for j, cl := range b.clients {
		st := cl.Stats()
		resp += int64(st[resource.EndpointType].Responses - before[j][resource.EndpointType].Responses)
		for typ, s := range st {
			bytes += s.Bytes - before[j][typ].Bytes
		}
	}
	n := int64(max(len(b.clients), 1))
	h.EDSResponsesPerClient = float64(resp) / float64(n)
	h.BytesPerClient = bytes / n
	rep.HiccupResult = h
	return nil
}
