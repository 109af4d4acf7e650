package xds

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/switchyard/switchyard/internal/adsclient"
	"github.com/switchyard/switchyard/registry"
	"github.com/switchyard/switchyard/xds/ir"
)

// BenchmarkPushOneEndpoint measures what one endpoint change costs with
// 100 connected ADS clients in this process, at 1,000 endpoints in 20
// pools: translation, versions, the push and the clients decoding it.
// An op is one change reaching every client; B/client is what each
// received for it, cpu-µs/client the process's CPU (server and clients)
// per change and client.
func BenchmarkPushOneEndpoint(b *testing.B) {
	for _, delta := range []bool{false, true} {
		name := "sotw"
		if delta {
			name = "delta"
		}
		b.Run(name, func(b *testing.B) { benchPush(b, delta, 100) })
	}
}

func benchPush(b *testing.B, delta bool, clients int) {
	state := func(v uint64, drop int) *registry.State {
		var pools []*registry.Pool
		for p := range 20 {
			var addrs []string
			for e := range 50 {
				if p == 0 && e == drop {
					continue
				}
				addrs = append(addrs, fmt.Sprintf("10.0.%d.%d:8000", p, e+1))
			}
			pools = append(pools, pool(fmt.Sprintf("p%02d", p), registry.FailClosed, addrs...))
		}
		return newState(v, "127.0.0.1:8080", pools...)
	}
	pub := registry.NewPublisher(state(1, -1))
	_, addr := startXDS(b, pub, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var cs []*adsclient.Client
	for i := range clients {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		cs = append(cs, adsclient.Start(ctx, conn, adsclient.Options{NodeID: fmt.Sprintf("c%d", i), Delta: delta}))
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	defer wcancel()
	for _, c := range cs {
		if _, err := c.Wait(wctx, adsclient.View.Synced); err != nil {
			b.Fatal(err)
		}
	}
	bytes := func() int64 {
		var n int64
		for _, c := range cs {
			for _, s := range c.Stats() {
				n += s.Bytes
			}
		}
		return n
	}
	gone := "10.0.0.1:8000"
	b0 := bytes()
	cpu0 := cpuTime()
	b.ResetTimer()
	v := uint64(1)
	for i := 0; b.Loop(); i++ {
		v++
		drop := -1
		if i%2 == 0 {
			drop = 0
		}
		pub.Publish(state(v, drop))
		for _, c := range cs {
			if _, err := c.Wait(wctx, func(view adsclient.View) bool {
				eps, _ := view.Endpoints(ir.ClusterName("p00"))
				return slices.Contains(eps, gone) == (drop != 0)
			}); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	cpu := cpuTime() - cpu0
	b.ReportMetric(float64(bytes()-b0)/float64(b.N)/float64(clients), "B/client")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N)/float64(clients), "cpu-µs/client")
}

// cpuTime is the CPU this process has used (user and system): the
// benchmark's cost on a machine other work slows down.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
