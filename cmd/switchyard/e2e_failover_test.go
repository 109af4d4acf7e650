package main

// End-to-end failover of the picker (issue 23): a replica that dies must
// fail no request that was not using it.

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// pickerStats reads Envoy's counters of the picker cluster whose names
// match re (an /stats filter), for the logs.
func pickerStats(envoyAdm, re string) string {
	out, _ := httpGetString(envoyAdm + "/stats?filter=" + re)
	return strings.Join(strings.Fields(out), " ")
}

// TestE2EReplicaDeathFailsNoNewRequest kills (SIGKILL) a replica that does
// not hold Envoy's ADS stream under steady load on a fail-closed pool, 20
// times, restarting it each time: every request that started after a
// kill, and ended before the next one, succeeds. Those requests cannot be
// using the dead picker, so none may fail because of it: Envoy retries
// the ext_proc stream elsewhere when it cannot reach the dead picker (its
// first streams find the connection refused or reset before anything
// ejected it). Requests whose stream was open at a kill may fail; they
// are counted and logged.
func TestE2EReplicaDeathFailsNoNewRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Envoy, three switchyards and simulators")
	}
	t.Parallel()
	s1, s2 := startSim(t, simOptions{}), startSim(t, simOptions{})
	f := newReplicaFleet(t, 3, fmt.Sprintf(`pool "main" {
  failure_mode = "fail_closed"
  endpoints = [%q, %q]
}
model "m-a" {
  pool = "main"
}
`, s1.Addr, s2.Addr), replicaOptions{peers: true})
	var ads string
	testutil.Eventually(t, 10*time.Second, "an ADS stream", func() error {
		if ads = f.adsReplica(); ads == "" {
			return errors.New("no replica holds the stream")
		}
		return nil
	})
	var victims []*replicaProc
	for _, r := range f.replicas {
		if r.id != ads {
			victims = append(victims, r)
		}
	}
	fl := &fleet{listen: f.listen}
	// Short streamed answers (20 tokens, a few ms at the simulators'
	// 50x) from 8 workers: every picker has streams opening all the time.
	l := startLoader(t, fl, 8, 2*time.Millisecond, func(w, i int) infReq {
		return infReq{model: "m-a", prompt: fmt.Sprintf("worker %d request %d", w, i), maxTokens: 20, stream: true}
	})
	l.waitFor(t, 100, time.Time{}, 20*time.Second, "load before the first kill")

	const cycles = 20
	var kills []time.Time
	for c := range cycles {
		v := victims[c%len(victims)]
		// The kill time is taken before the signal: Kill returns once
		// the process is reaped, after Envoy may have seen it die.
		killed := time.Now()
		v.process().Kill()
		kills = append(kills, killed)
		// Requests keep starting while the picker is dead: at least 50
		// of them before it comes back.
		l.waitFor(t, 50, killed, 20*time.Second, "load after a kill")
		f.start(v)
		testutil.Eventually(t, 20*time.Second, v.id+" healthy in Envoy again", func() error {
			healthy, err := f.healthyPickers()
			if err != nil {
				return err
			}
			if !slices.Contains(healthy, v.extproc) {
				return fmt.Errorf("healthy pickers %v", healthy)
			}
			return nil
		})
	}
	l.waitFor(t, 50, time.Now(), 20*time.Second, "load after the last restart")
	l.stopLoad()

	all := l.outcomes()
	var after, open []outcome
	for _, o := range all {
		// kills[i] is the first kill at or after the request's start.
		i, _ := slices.BinarySearchFunc(kills, o.start, func(k, s time.Time) int { return k.Compare(s) })
		if i < len(kills) && kills[i].Before(o.end) {
			open = append(open, o) // a kill caught it in flight
			continue
		}
		if i > 0 {
			after = append(after, o)
		}
	}
	n, ex := failures(after)
	nOpen, exOpen := failures(open)
	t.Logf("%d kills of a non-ADS replica; %d requests in all; %d started after a kill and ended before the next, %d failed %q; "+
		"%d were in flight at a kill, %d failed %q; Envoy: %s", cycles, len(all), len(after), n, ex, len(open), nOpen, exOpen,
		pickerStats(f.envoyAdm, `cluster\.switchyard/picker\.(upstream_rq_retry|upstream_rq_retry_success|upstream_cx_connect_fail|outlier_detection\.ejections_enforced_total|upstream_rq_retry_limit_exceeded)$`))
	if len(after) < cycles*50 {
		t.Errorf("only %d requests started after the kills", len(after))
	}
	if n > 0 {
		t.Errorf("%d of %d requests that started after a kill failed: %q", n, len(after), ex)
	}
}
