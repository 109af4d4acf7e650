package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"syscall"
)

// isSystemError reports whether err comes from the operating system (a
// missing directory, permissions, a full disk, no memory to map the file)
// rather than from the file's content: such a file is left where it is.
func isSystemError(err error) bool {
	var (
		pe *fs.PathError
		se *os.SyscallError
		en syscall.Errno
	)
	return errors.As(err, &pe) || errors.As(err, &se) || errors.As(err, &en)
}

// describeOpenError explains why the operating system refused to open the
// store file.
func describeOpenError(path string, err error) error {
	return fmt.Errorf("store %s: open: %w", path, err)
}

// guard runs fn, turning panics and memory faults (a bbolt page that points
// past the end of a damaged file) into errors.
func guard(fn func() error) (err error) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("damaged file: %v", r)
		}
	}()
	return fn()
}

// syncDir fsyncs the directory holding path so a rename survives a crash.
func syncDir(path string) {
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return
	}
	_ = d.Sync()
	_ = d.Close()
}
