package xds

import (
	"strconv"
	"sync"
	"time"
)

// VersionSource hands out snapshot version strings. Versions must never
// repeat for different content, including across restarts: Envoy ignores a
// response whose version equals the one it already has.
type VersionSource interface {
	// Next returns a version string never returned before.
	Next() string
}

// BootVersions is the default VersionSource: "<boot prefix>-<counter>",
// where the prefix is the boot time in base-36 nanoseconds, so a restarted
// server never reuses an earlier process's versions (given a clock that
// does not jump backwards across the restart).
type BootVersions struct {
	mu     sync.Mutex
	prefix string
	n      uint64
}

var _ VersionSource = (*BootVersions)(nil)

// NewBootVersions returns a BootVersions whose prefix is derived from now.
func NewBootVersions(now time.Time) *BootVersions {
	return &BootVersions{prefix: strconv.FormatInt(now.UnixNano(), 36)}
}

// Next implements VersionSource.
func (b *BootVersions) Next() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.n++
	return b.prefix + "-" + strconv.FormatUint(b.n, 10)
}
