package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// twoFreePorts returns p such that p and p+1 were free a moment ago.
func twoFreePorts(t *testing.T) int {
	t.Helper()
	for range 50 {
		p := testutil.FreePort(t)
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+1)); err == nil {
			_ = l.Close()
			return p
		}
	}
	t.Fatal("no two consecutive free ports")
	return 0
}

// Each server of a fleet is a whole simulated vLLM: with -kv-connector an
// engine of its own that advertises its own address to decoders, and
// with -kv-events-port its own event stream on the port after the
// previous server's.
func TestFleetServersAreEnginesOfTheirOwn(t *testing.T) {
	bin := testutil.Binary(t, "vllm-sim")
	addrsFile := filepath.Join(t.TempDir(), "addrs")
	kvPort := twoFreePorts(t)
	testutil.Start(t, "vllm-sim", bin, "-port", "0", "-time-scale", "20", "-fleet", "2", "-fleet-addrs-file", addrsFile,
		"-kv-connector", "NixlConnector", "-kv-events-port", strconv.Itoa(kvPort))
	var addrs []string
	testutil.Eventually(t, 10*time.Second, "the fleet's addresses", func() error {
		b, err := os.ReadFile(addrsFile)
		if err != nil {
			return err
		}
		addrs = strings.Fields(string(b))
		return nil
	})
	if len(addrs) != 2 {
		t.Fatalf("addresses %q, want 2", addrs)
	}
	engines := map[any]bool{}
	for _, addr := range addrs {
		kv := prefill(t, &simProc{addr: addr}, words("w", 40)).KV
		_, port, _ := strings.Cut(addr, ":")
		if fmt.Sprint(kv["remote_port"]) != port {
			t.Errorf("%s advertises remote_port %v", addr, kv["remote_port"])
		}
		engines[kv["remote_engine_id"]] = true
	}
	if len(engines) != 2 {
		t.Errorf("engine ids %v, want one per server", engines)
	}
	for i := range 2 {
		testutil.WaitTCP(t, fmt.Sprintf("127.0.0.1:%d", kvPort+i), 5*time.Second)
	}
}
