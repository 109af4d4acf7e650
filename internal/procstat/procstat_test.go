package procstat

import (
	"os"
	"testing"
	"time"
)

// The test process's own figures: CPU grows as it spins, RSS is
// positive, a process that does not exist is an error.
func TestOwnProcess(t *testing.T) {
	pid := os.Getpid()
	c0, err := CPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	// Spin until the kernel has charged at least a tick more, or 10 s.
	c1 := c0
	for deadline := time.Now().Add(10 * time.Second); c1 <= c0 && time.Now().Before(deadline); {
		if c1, err = CPU(pid); err != nil {
			t.Fatal(err)
		}
	}
	if c1 <= c0 {
		t.Errorf("CPU did not grow over 10 s of spinning: %v then %v", c0, c1)
	}
	if rss, err := RSS(pid); err != nil || rss < 1<<20 {
		t.Errorf("RSS %d, %v; want over 1 MiB", rss, err)
	}
	if _, err := CPU(1 << 30); err == nil {
		t.Error("CPU of a process that does not exist: no error")
	}
	if _, err := RSS(1 << 30); err == nil {
		t.Error("RSS of a process that does not exist: no error")
	}
}
