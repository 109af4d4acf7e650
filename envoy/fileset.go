package envoy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// File is one file of a set that WriteFileSet writes.
type File struct {
	Name string // base name in the directory
	Data []byte
	Mode os.FileMode
}

// Names inside a directory WriteFileSet manages.
const (
	// DataLink is the symbolic link naming the current set's directory.
	DataLink = "..data"
	// setPrefix starts the name of every set's directory.
	setPrefix = "..set-"
)

// WriteFileSet replaces files in dir as one set: a reader never sees a
// file of the new set next to one of the old (a new certificate next to
// the old key). Each name in dir is a symbolic link to DataLink/name;
// DataLink points at a directory holding the set, and a rotation writes a
// new such directory and renames a new DataLink over the old one: one
// atomic step, one move event for a watcher such as Envoy's
// watched_directory. Old set directories are removed afterwards.
//
// A directory written before (plain files) is converted without a
// mismatched moment: its current files first become a set of their own,
// linked one by one (each link shows the same content as the file it
// replaces), then the new set is swapped in.
//
// dir and the set directories get dirMode whatever the process umask
// (containers that mount dir run as other users); each file gets its Mode.
func WriteFileSet(dir string, dirMode os.FileMode, files []File) error {
	if len(files) == 0 {
		return errors.New("write file set: no files")
	}
	for _, f := range files {
		if f.Name == "" || f.Name != filepath.Base(f.Name) || strings.HasPrefix(f.Name, "..") {
			return fmt.Errorf("write file set: bad file name %q", f.Name)
		}
	}
	if err := mkdirMode(dir, dirMode); err != nil {
		return err
	}
	if err := adoptPlainFiles(dir, dirMode, files); err != nil {
		return err
	}
	set, err := writeSetDir(dir, dirMode, files)
	if err != nil {
		return err
	}
	if err := swapLink(dir, DataLink, set); err != nil {
		_ = os.RemoveAll(filepath.Join(dir, set))
		return err
	}
	for _, f := range files {
		if err := ensureLink(dir, f.Name); err != nil {
			return err
		}
	}
	return removeOldSets(dir, set)
}

// mkdirMode creates dir (and parents) and gives dir mode exactly.
func mkdirMode(dir string, mode os.FileMode) error {
	if err := os.MkdirAll(dir, mode); err != nil {
		return fmt.Errorf("write file set: %w", err)
	}
	if err := os.Chmod(dir, mode); err != nil {
		return fmt.Errorf("write file set: %w", err)
	}
	return nil
}

// writeSetDir writes files into a new set directory of dir and returns its
// base name.
func writeSetDir(dir string, dirMode os.FileMode, files []File) (string, error) {
	set, err := os.MkdirTemp(dir, setPrefix)
	if err != nil {
		return "", fmt.Errorf("write file set: %w", err)
	}
	fail := func(err error) (string, error) {
		_ = os.RemoveAll(set)
		return "", fmt.Errorf("write file set: %w", err)
	}
	if err := os.Chmod(set, dirMode); err != nil {
		return fail(err)
	}
	for _, f := range files {
		p := filepath.Join(set, f.Name)
		if err := os.WriteFile(p, f.Data, 0o600); err != nil {
			return fail(err)
		}
		if err := os.Chmod(p, f.Mode); err != nil {
			return fail(err)
		}
	}
	return filepath.Base(set), nil
}

// swapLink points dir/name at target by renaming a new link over it.
func swapLink(dir, name, target string) error {
	tmp := filepath.Join(dir, fmt.Sprintf("%s.tmp%d", name, os.Getpid()))
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return fmt.Errorf("write file set: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write file set: %w", err)
	}
	return nil
}

// ensureLink makes dir/name the link DataLink/name unless it is already.
func ensureLink(dir, name string) error {
	want := filepath.Join(DataLink, name)
	if got, err := os.Readlink(filepath.Join(dir, name)); err == nil && got == want {
		return nil
	}
	return swapLink(dir, name, want)
}

// adoptPlainFiles turns the plain files of an earlier write into a set of
// their own, so that the next swap changes them all at once.
func adoptPlainFiles(dir string, dirMode os.FileMode, files []File) error {
	if _, err := os.Lstat(filepath.Join(dir, DataLink)); err == nil {
		return nil
	}
	var current []File
	for _, f := range files {
		p := filepath.Join(dir, f.Name)
		info, err := os.Lstat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("write file set: %w", err)
		}
		if !info.Mode().IsRegular() {
			return fmt.Errorf("write file set: %s is neither a plain file nor a link into %s", p, DataLink)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("write file set: %w", err)
		}
		current = append(current, File{Name: f.Name, Data: data, Mode: info.Mode().Perm()})
	}
	if len(current) == 0 {
		return nil
	}
	set, err := writeSetDir(dir, dirMode, current)
	if err != nil {
		return err
	}
	if err := swapLink(dir, DataLink, set); err != nil {
		return err
	}
	for _, f := range current {
		if err := ensureLink(dir, f.Name); err != nil {
			return err
		}
	}
	return nil
}

// removeOldSets deletes the set directories of dir other than keep.
func removeOldSets(dir, keep string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("write file set: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), setPrefix) && e.Name() != keep {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("write file set: %w", err)
	}
	return nil
}
