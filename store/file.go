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
// store file, and what to do about it. The result wraps the cause, so
// errors.Is(result, fs.ErrNotExist) and the like still work.
func describeOpenError(path string, err error) error {
	dir := filepath.Dir(path)
	cause := err
	var pe *fs.PathError
	if errors.As(err, &pe) {
		cause = pe.Err // the message names the path already
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if _, derr := os.Stat(dir); errors.Is(derr, fs.ErrNotExist) {
			return fmt.Errorf("store %s: directory %s does not exist; create it (the store creates only its file) or choose another path: %w", path, dir, cause)
		}
	case errors.Is(err, fs.ErrPermission):
		who := "the user switchyard runs as"
		if uid := os.Getuid(); uid >= 0 {
			who = fmt.Sprintf("%s (uid %d)", who, uid)
		}
		if _, serr := os.Stat(path); serr == nil {
			return fmt.Errorf("store %s: %w: %s needs read and write access to the file; fix its owner or mode", path, cause, who)
		}
		return fmt.Errorf("store %s: %w: %s cannot create the file in %s; fix the directory's owner or mode, or choose another path", path, cause, who, dir)
	case errors.Is(err, syscall.EISDIR):
		return fmt.Errorf("store %s: %w; the store needs a file path, such as %s", path, cause, filepath.Join(path, "switchyard.db"))
	case errors.Is(err, syscall.EROFS):
		return fmt.Errorf("store %s: %w; choose a path on a writable file system", path, cause)
	case errors.Is(err, syscall.ENOSPC):
		return fmt.Errorf("store %s: %w; free some space on the device holding %s", path, cause, dir)
	}
	return fmt.Errorf("store %s: %w", path, cause)
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
