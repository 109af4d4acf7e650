package kvevents

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine outlives them, except
// the writer goroutine zmq4 starts for every PUB socket and never stops
// (its Close leaves the writer waiting): only Publisher, the engine side
// that tests and the simulator run, has PUB sockets.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
