package main

// End-to-end scrape sharing (issue 25 item 2): replicas started with
// -share-scrapes read each model server once between them.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// simFleet is one vllm-sim process serving several servers.
type simFleet struct {
	addrs []string
	stats string // GET /fleet
}

func startSimFleet(t *testing.T, n int) *simFleet {
	t.Helper()
	dir := t.TempDir()
	f := &simFleet{stats: testutil.FreeAddr(t)}
	addrsFile := filepath.Join(dir, "fleet.addrs")
	p := testutil.Start(t, "vllm-sim fleet", testutil.Binary(t, "vllm-sim"), "-fleet", strconv.Itoa(n), "-port", "0",
		"-host", "127.0.0.1", "-model", e2eModels[0], "-served-model-name", strings.Join(e2eModels, ","),
		"-time-scale", "50", "-log-level", "warn", "-fleet-addrs-file", addrsFile, "-fleet-stats-addr", f.stats)
	testutil.Eventually(t, 30*time.Second, "the fleet listening", func() error {
		if p.Exited() {
			return errors.New("vllm-sim exited:\n" + tail(p.Output(), 4000))
		}
		b, err := os.ReadFile(addrsFile)
		if err != nil {
			return err
		}
		if f.addrs = strings.Fields(string(b)); len(f.addrs) != n {
			return fmt.Errorf("%d addresses", len(f.addrs))
		}
		return nil
	})
	testutil.WaitHTTP(t, "http://"+f.stats+"/fleet", 10*time.Second)
	return f
}

// scrapes returns how many /metrics requests each server answered.
func (f *simFleet) scrapes() (map[string]int64, error) {
	resp, err := http.Get("http://" + f.stats + "/fleet")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var es []struct {
		Address string `json:"address"`
		Scrapes int64  `json:"metrics_requests"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&es); err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, e := range es {
		out[e.Address] = e.Scrapes
	}
	return out, nil
}

// scrapeRates reads every server's scrapes over window, per second.
func (f *simFleet) scrapeRates(t *testing.T, window time.Duration) map[string]float64 {
	t.Helper()
	before, err := f.scrapes()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	time.Sleep(window) // a measurement window, not a wait for an event
	after, err := f.scrapes()
	if err != nil {
		t.Fatal(err)
	}
	secs := time.Since(start).Seconds()
	out := map[string]float64{}
	for a, n := range after {
		out[a] = float64(n-before[a]) / secs
	}
	return out
}

func sumRates(rs map[string]float64) float64 {
	var sum float64
	for _, r := range rs {
		sum += r
	}
	return sum
}

func fmtRates(rs map[string]float64) string {
	keys := make([]string, 0, len(rs))
	for k := range rs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%.1f", k[strings.LastIndex(k, ":")+1:], rs[k])
	}
	return b.String()
}

// readers returns, per endpoint of pool main, the replica each replica
// of rs shows the reading of ("" is its own) and whether it is stale.
type shownReading struct {
	from  string
	stale bool
}

func shownReadings(rs []*replicaProc) (map[string]map[string]shownReading, error) {
	out := map[string]map[string]shownReading{}
	for _, r := range rs {
		st, err := r.status()
		if err != nil {
			return nil, err
		}
		for _, p := range st.Pools {
			if p.Name != "main" {
				continue
			}
			for _, e := range p.Endpoints {
				if e.Scrape == nil {
					return nil, fmt.Errorf("%s: %s not scraped yet", r.id, e.Address)
				}
				if out[e.Address] == nil {
					out[e.Address] = map[string]shownReading{}
				}
				out[e.Address][r.id] = shownReading{from: e.Scrape.From, stale: e.Scrape.Stale}
			}
		}
	}
	return out, nil
}

// oneReaderEach checks that every endpoint is read by one replica of rs
// and every other one of rs shows that replica's fresh reading; it
// returns the reader of each endpoint.
func oneReaderEach(rs []*replicaProc, endpoints []string) (map[string]string, error) {
	shown, err := shownReadings(rs)
	if err != nil {
		return nil, err
	}
	readers := map[string]string{}
	for _, a := range endpoints {
		var own []string
		for id, s := range shown[a] {
			if s.from == "" {
				own = append(own, id)
			}
		}
		if len(own) != 1 {
			return nil, fmt.Errorf("%s read by %v (%+v)", a, own, shown[a])
		}
		for id, s := range shown[a] {
			if s.stale || id != own[0] && s.from != own[0] {
				return nil, fmt.Errorf("%s: %s shows %+v, reader %s", a, id, s, own[0])
			}
		}
		readers[a] = own[0]
	}
	return readers, nil
}

// TestE2EReplicasShareScrapes runs one replica, then three sharing
// scrapes (the default; the flag is given all the same), on the same simulated fleet: with three each server
// is read about as often as with one, each by one replica whose readings
// the others show. When that replica hangs (SIGSTOP: its connections
// stay open, so only the heartbeats tell), the others show its last
// readings stale, read its servers themselves, and after failure
// detection own them; no server goes unread for more than two intervals
// plus the detection time.
func TestE2EReplicasShareScrapes(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, four switchyards and a simulated fleet")
	}
	t.Parallel()
	const (
		servers  = 12
		interval = 200 * time.Millisecond
		// detection: peers' DeadAfter (1 s) plus the heartbeat tick that
		// notices it (250 ms).
		detection = 1250 * time.Millisecond
		window    = 3 * time.Second
	)
	sims := startSimFleet(t, servers)
	quoted := make([]string, len(sims.addrs))
	for i, a := range sims.addrs {
		quoted[i] = strconv.Quote(a)
	}
	body := fmt.Sprintf(`pool "main" {
  endpoints = [%s]
  scheduling {
    scrape_interval      = %q
    idle_scrape_interval = %q
  }
}
model "m-a" {
  pool = "main"
}
`, strings.Join(quoted, ", "), interval, interval)
	share := replicaOptions{peers: true, args: []string{"-share-scrapes"}}

	// One replica.
	one := newReplicaFleet(t, 1, body, share)
	testutil.Eventually(t, 10*time.Second, "every server read", func() error {
		_, err := oneReaderEach(one.replicas, sims.addrs)
		return err
	})
	rates1 := sims.scrapeRates(t, window)
	one.replicas[0].process().Stop()
	t.Logf("scrapes per server per second, 1 replica (interval %v): total %.1f;%s", interval, sumRates(rates1), fmtRates(rates1))

	// Three sharing replicas.
	three := newReplicaFleet(t, 3, body, share)
	var readers map[string]string
	testutil.Eventually(t, 20*time.Second, "one reader per server", func() error {
		var err error
		readers, err = oneReaderEach(three.replicas, sims.addrs)
		return err
	})
	rates3 := sims.scrapeRates(t, window)
	t.Logf("scrapes per server per second, 3 sharing replicas: total %.1f;%s", sumRates(rates3), fmtRates(rates3))
	// One reader per server: at most the interval's rate (three that
	// each read would make it three times that). The bound leaves room
	// for a tick that catches up after a late one.
	perServer := 1.5 * float64(time.Second) / float64(interval)
	for a, r := range rates3 {
		if r > perServer || r == 0 {
			t.Errorf("%s read %.1f times a second by 3 sharing replicas (interval %v, 1 replica: %.1f)", a, r, interval, rates1[a])
		}
	}
	for _, r := range three.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		for _, p := range st.Pools {
			for _, e := range p.Endpoints {
				if e.Scrape != nil && e.Scrape.From == "" {
					fmt.Fprintf(&b, " %s: interval %.0f ms, cost %.2f ms;", e.Address, e.Scrape.IntervalMS, e.Scrape.CostMS)
				}
			}
		}
		t.Logf("%s reads%s", r.id, b.String())
	}
	owned := map[string]int{}
	for _, r := range readers {
		owned[r]++
	}
	t.Logf("servers read by each replica: %v", owned)
	for _, r := range three.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		if owned[r.id] < servers && st.Picker.PeerReadings == 0 {
			t.Errorf("%s published no reading of the others", r.id)
		}
	}

	// The replica reading the most servers hangs.
	victim := three.replicas[0]
	for _, r := range three.replicas {
		if owned[r.id] > owned[victim.id] {
			victim = r
		}
	}
	var survivors []*replicaProc
	for _, r := range three.replicas {
		if r != victim {
			survivors = append(survivors, r)
		}
	}
	var itsServers []string
	for a, r := range readers {
		if r == victim.id {
			itsServers = append(itsServers, a)
		}
	}
	slices.Sort(itsServers)
	if len(itsServers) == 0 {
		t.Fatalf("%s reads nothing: %v", victim.id, readers)
	}
	vp := victim.process()
	t.Cleanup(func() { _ = vp.Signal(syscall.SIGCONT) })

	// Watch the fleet's counts and the survivors' status meanwhile.
	type change struct {
		at    time.Time
		count int64
	}
	var (
		mu        sync.Mutex
		changes   = map[string][]change{}
		seenStale = map[string]bool{} // "replica endpoint"
		watchErr  error
	)
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		last := map[string]int64{}
		for {
			select {
			case <-stop:
				return
			default:
			}
			counts, err := sims.scrapes()
			now := time.Now()
			shown, serr := shownReadings(survivors)
			mu.Lock()
			if err != nil {
				watchErr = err
			}
			for a, n := range counts {
				if n != last[a] {
					last[a] = n
					changes[a] = append(changes[a], change{at: now, count: n})
				}
			}
			if serr == nil {
				for _, a := range itsServers {
					for id, s := range shown[a] {
						if s.stale && s.from == victim.id {
							seenStale[id+" "+a] = true
						}
					}
				}
			}
			mu.Unlock()
			time.Sleep(10 * time.Millisecond) // the watch's sampling period
		}
	}()
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-watched
	}()

	stopped := time.Now()
	if err := vp.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	var after map[string]string
	testutil.Eventually(t, 20*time.Second, "the survivors own "+victim.id+"'s servers", func() error {
		if time.Since(stopped) < detection+interval {
			return errors.New("failure detection not over yet")
		}
		var err error
		after, err = oneReaderEach(survivors, sims.addrs)
		return err
	})
	// Let the counts run a while with the new owners.
	time.Sleep(2 * interval) // more samples for the watch, not a wait for an event
	close(stop)
	<-watched
	if watchErr != nil {
		t.Fatal(watchErr)
	}
	bound := 2*interval + detection
	mu.Lock()
	defer mu.Unlock()
	for _, a := range sims.addrs {
		// From its last read before the hang on.
		var gap time.Duration
		prev := stopped
		for _, c := range changes[a] {
			if !c.at.After(stopped) {
				prev = c.at
			}
		}
		for _, c := range changes[a] {
			if !c.at.After(prev) {
				continue
			}
			gap = max(gap, c.at.Sub(prev))
			prev = c.at
		}
		gap = max(gap, time.Since(prev))
		if slices.Contains(itsServers, a) {
			t.Logf("%s (read by %s, then %s): longest unread %v", a, victim.id, after[a], gap.Round(time.Millisecond))
		}
		if gap > bound+100*time.Millisecond { // the watch samples every ~10 ms plus two HTTP reads
			t.Errorf("%s unread for %v after %s hung (bound: 2 intervals + detection = %v)", a, gap.Round(time.Millisecond), victim.id, bound)
		}
		if after[a] == victim.id {
			t.Errorf("%s still read by %s", a, victim.id)
		}
	}
	if len(seenStale) == 0 {
		t.Errorf("no survivor showed %s's last reading stale (servers %v)", victim.id, itsServers)
	} else {
		t.Logf("stale readings from %s seen: %v", victim.id, seenStale)
	}
	rates2 := sims.scrapeRates(t, window)
	t.Logf("scrapes per server per second, 2 sharing replicas after %s hung: total %.1f;%s", victim.id, sumRates(rates2), fmtRates(rates2))
	for a, r := range rates2 {
		if r > perServer || r == 0 {
			t.Errorf("%s read %.1f times a second by the 2 left (interval %v)", a, r, interval)
		}
	}
}
