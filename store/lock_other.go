//go:build !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package store

import (
	"os"
	"time"
)

// lockFile is a no-op here; bbolt's own lock (with Options.LockTimeout)
// still keeps a second process out.
func lockFile(*os.File, time.Duration) error { return nil }

func unlockFile(*os.File) error { return nil }
