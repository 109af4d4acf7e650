package hclfile

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/hashicorp/hcl/v2"
	"github.com/switchyard/switchyard/registry"
)

// Default timings of the file source.
const (
	// DefaultSettle is how long the source waits after a file event before
	// re-reading, so that an editor's burst of writes is read once.
	DefaultSettle = 50 * time.Millisecond
	// DefaultRefresh is how often the files are re-read even without an
	// event (file systems that do not deliver events, e.g. some bind mounts).
	DefaultRefresh = time.Minute
)

// Source is a registry.Source that reads HCL configuration from a file or
// a directory, re-reading it when the file system reports a change (the
// containing directory is watched, so editors that replace files by rename
// are seen; so are the directories of the key files the configuration
// names), when Reload is called (SIGHUP), and every refresh interval. A
// load that fails sends an Update with Err set, so the registry keeps the
// last good configuration in force.
type Source struct {
	path    string
	log     *slog.Logger
	settle  time.Duration
	refresh time.Duration
	watch   bool
	reload  chan struct{}
	rules   registry.SchedulingRules
	onLoad  func(*Config)

	mu       sync.Mutex
	lastErr  error
	lastWarn string
	loads    int
	// agent is the consul block of the first good load: serve connects
	// with it once, so a later change is reported as needing a restart.
	agent     *ConsulAgent
	agentSeen bool

	// Owned by Run's goroutine: the watcher, and the key files the last
	// good load read (API key hashes, upstream keys), watched too so that
	// a revoked key is seen as soon as its file changes.
	watcher  *fsnotify.Watcher
	keyFiles map[string]bool
}

var (
	_ registry.Source   = (*Source)(nil)
	_ registry.Reloader = (*Source)(nil)
)

// SourceOption configures a Source.
type SourceOption func(*Source)

// WithLogger sets the logger (slog.Default() otherwise).
func WithLogger(l *slog.Logger) SourceOption { return func(s *Source) { s.log = l } }

// WithSettle sets the delay between a file event and the re-read.
func WithSettle(d time.Duration) SourceOption { return func(s *Source) { s.settle = d } }

// WithRefresh sets the periodic re-read interval; 0 disables it.
func WithRefresh(d time.Duration) SourceOption { return func(s *Source) { s.refresh = d } }

// WithoutWatch disables file system notifications; the source then only
// re-reads on Reload and on the refresh interval.
func WithoutWatch() SourceOption { return func(s *Source) { s.watch = false } }

// WithOnLoad calls fn with every configuration that loads without errors,
// before it is sent to the registry: what other components derive from the
// configuration itself (the Consul selectors to watch) is applied to them
// here, never read back from the registry's published state.
func WithOnLoad(fn func(*Config)) SourceOption { return func(s *Source) { s.onLoad = fn } }

// WithSchedulingRules sets the rules pools' scheduling blocks are judged by
// (the picker's sched.Rules).
func WithSchedulingRules(r registry.SchedulingRules) SourceOption {
	return func(s *Source) { s.rules = r }
}

// NewSource returns a Source for the file or directory at path.
func NewSource(path string, opts ...SourceOption) *Source {
	s := &Source{
		path:    path,
		log:     slog.Default(),
		settle:  DefaultSettle,
		refresh: DefaultRefresh,
		watch:   true,
		reload:  make(chan struct{}, 1),
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Reload asks the running source to re-read its files. It never blocks;
// several calls before the re-read coalesce into one.
func (s *Source) Reload() {
	select {
	case s.reload <- struct{}{}:
	default:
	}
}

// LastError returns the *DiagnosticsError of the latest load, or nil when
// it succeeded.
func (s *Source) LastError() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// Run implements registry.Source.
func (s *Source) Run(ctx context.Context, up chan<- registry.Update) {
	var events <-chan fsnotify.Event
	var werrs <-chan error
	if s.watch {
		w, err := s.newWatcher()
		if err != nil {
			s.log.Warn("config file watch unavailable; relying on reload and periodic refresh", "path", s.path, "err", err)
		} else {
			defer w.Close()
			events, werrs = w.Events, w.Errors
			s.watcher = w
		}
	}
	var tick <-chan time.Time
	if s.refresh > 0 {
		t := time.NewTicker(s.refresh)
		defer t.Stop()
		tick = t.C
	}
	settle := time.NewTimer(time.Hour)
	settle.Stop()
	defer settle.Stop()

	if !s.loadAndSend(ctx, up) {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.reload:
			s.log.Info("reloading configuration", "path", s.path)
			if !s.loadAndSend(ctx, up) {
				return
			}
		case <-tick:
			if !s.loadAndSend(ctx, up) {
				return
			}
		case <-settle.C:
			if !s.loadAndSend(ctx, up) {
				return
			}
		case ev := <-events:
			if s.relevant(ev) {
				s.log.Debug("configuration file changed", "file", ev.Name, "op", ev.Op.String())
				settle.Reset(s.settle)
			}
		case err := <-werrs:
			s.log.Warn("config file watch error", "path", s.path, "err", err)
		}
	}
}

// newWatcher watches the directory holding the configuration: the
// directory itself when path is one, else the file's parent.
func (s *Source) newWatcher() (*fsnotify.Watcher, error) {
	dir := s.path
	if fi, err := os.Stat(s.path); err != nil || !fi.IsDir() {
		dir = filepath.Dir(s.path)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return nil, err
	}
	return w, nil
}

func (s *Source) relevant(ev fsnotify.Event) bool {
	if ev.Op == fsnotify.Chmod {
		return false
	}
	if s.keyFiles[filepath.Clean(ev.Name)] {
		return true
	}
	if fi, err := os.Stat(s.path); err == nil && fi.IsDir() {
		return isConfigName(filepath.Base(ev.Name))
	}
	return filepath.Clean(ev.Name) == filepath.Clean(s.path)
}

// loadAndSend loads the files and sends the result; it reports false when
// ctx ended first.
func (s *Source) loadAndSend(ctx context.Context, up chan<- registry.Update) bool {
	cfg, diags := Load(s.path, s.rules)
	var u registry.Update
	var err error
	if diags.HasErrors() {
		err = &DiagnosticsError{Diags: diags, Files: cfg.Files}
		u = registry.Update{Source: SourceName, Err: err}
	} else {
		u = cfg.Update
	}
	s.mu.Lock()
	if err == nil {
		switch {
		case !s.agentSeen:
			s.agent, s.agentSeen = cfg.Consul, true
		case !reflect.DeepEqual(cfg.Consul, s.agent):
			s.log.Warn("the consul block changed; the Consul connection keeps its settings from start until switchyard restarts", "path", s.path)
			s.agent = cfg.Consul // warn once per change
		}
	}
	if w := FormatDiagnostics(warningsOf(diags)); w != s.lastWarn {
		s.lastWarn = w
		if w != "" {
			s.log.Warn("configuration warnings", "path", s.path, "warnings", w)
		}
	}
	s.lastErr = err
	s.loads++
	s.mu.Unlock()
	if err == nil {
		s.watchKeyFiles(cfg.KeyFiles)
	}
	if err == nil && s.onLoad != nil {
		s.onLoad(cfg)
	}
	select {
	case up <- u:
		return true
	case <-ctx.Done():
		return false
	}
}

func warningsOf(diags hcl.Diagnostics) hcl.Diagnostics {
	var out hcl.Diagnostics
	for _, d := range diags {
		if d.Severity == hcl.DiagWarning {
			out = append(out, d)
		}
	}
	return out
}

// watchKeyFiles watches the directories of the key files a good load read
// (the directory, as for the configuration, so a file replaced by rename
// is seen).
func (s *Source) watchKeyFiles(files []string) {
	s.keyFiles = make(map[string]bool, len(files))
	for _, f := range files {
		f = filepath.Clean(f)
		s.keyFiles[f] = true
		if s.watcher == nil {
			continue
		}
		if err := s.watcher.Add(filepath.Dir(f)); err != nil {
			s.log.Warn("cannot watch a key file's directory; it is re-read on reload and periodically", "file", f, "err", err)
		}
	}
}
