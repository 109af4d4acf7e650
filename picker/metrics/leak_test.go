package metrics

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine outlives them. Run
// with pageServerEnv set, the test binary is instead the page server the
// scrape benchmarks read from (see startPageServer).
func TestMain(m *testing.M) {
	if page := os.Getenv(pageServerEnv); page != "" {
		servePages(page)
		return
	}
	goleak.VerifyTestMain(m)
}
