package quality

import (
	"os"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
)

// The harness can put a real Envoy in front of the simulators instead of
// its in-process data plane (SWITCHYARD_QUALITY_ENVOY=1), to check that
// the figures it measures are Envoy's. Envoy gets a static bootstrap
// wired as the xDS translator wires a pool (testutil.StartEnvoyPool).

// useEnvoy reports whether SWITCHYARD_QUALITY_ENVOY asks for Envoy.
func useEnvoy() bool { return os.Getenv("SWITCHYARD_QUALITY_ENVOY") == "1" }

// startEnvoyDataPlane starts Envoy in front of the model servers at
// addrs with the picker at pickerAddr, and returns its base URL. Its
// timeouts leave the harness's longest requests alone.
func startEnvoyDataPlane(t testing.TB, pickerAddr string, addrs []string) string {
	t.Helper()
	return testutil.StartEnvoyPool(t, testutil.EnvoyPool{Name: poolName, Endpoints: addrs, Picker: pickerAddr,
		RouteTimeout: 300 * time.Second, ExtProcTimeout: 300 * time.Second, Concurrency: 2})
}
