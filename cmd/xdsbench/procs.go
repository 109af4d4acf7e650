package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/internal/procstat"
)

// child is a process the bench started; stop ends it (and only it).
type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func startChild(name string, stdout, stderr io.Writer, bin string, args ...string) (*child, error) {
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.done) }()
	return c, nil
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) stop() {
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// procUsage is a process's CPU time and resident memory.
type procUsage struct {
	CPU time.Duration
	RSS int64 // bytes
}

// readUsage reads the process's CPU time and resident memory.
func readUsage(pid int) (procUsage, error) {
	cpu, err := procstat.CPU(pid)
	if err != nil {
		return procUsage{}, err
	}
	rss, err := procstat.RSS(pid)
	if err != nil {
		return procUsage{}, err
	}
	return procUsage{CPU: cpu, RSS: rss}, nil
}

// heapInuse reads go_memstats_heap_inuse_bytes from serve's /metrics.
func heapInuse(admin string) (int64, error) {
	resp, err := http.Get(admin + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_memstats_heap_inuse_bytes "); ok {
			f, err := strconv.ParseFloat(v, 64)
			return int64(f), err
		}
	}
	return 0, fmt.Errorf("no go_memstats_heap_inuse_bytes in %s/metrics", admin)
}

// freePort returns a loopback port that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// logEvent is one line of serve's JSON log that the bench follows.
type logEvent struct {
	Time time.Time `json:"time"`
	Msg  string    `json:"msg"`
	// RawVersion is a number on "registry state published" (a string on
	// "xDS snapshot set").
	RawVersion json.RawMessage `json:"version"`
	Version    uint64          `json:"-"`
	// RegistryVersion is set on "xDS snapshot set".
	RegistryVersion uint64 `json:"registry_version"`
}

// logFollower records the registry publishes and xDS snapshots serve logs.
type logFollower struct {
	mu        sync.Mutex
	published []logEvent // "registry state published"
	snapshots []logEvent // "xDS snapshot set"
	lines     int
	changed   chan struct{}
}

func newLogFollower() *logFollower { return &logFollower{changed: make(chan struct{})} }

// Write implements io.Writer for serve's stderr: complete lines are parsed.
func (l *logFollower) follow(r io.Reader, tee io.Writer) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if tee != nil {
			_, _ = tee.Write(append(line, '\n'))
		}
		var ev logEvent
		if json.Unmarshal(line, &ev) != nil {
			continue
		}
		l.mu.Lock()
		l.lines++
		switch ev.Msg {
		case "registry state published":
			_ = json.Unmarshal(ev.RawVersion, &ev.Version)
			l.published = append(l.published, ev)
		case "xDS snapshot set":
			l.snapshots = append(l.snapshots, ev)
		default:
			l.mu.Unlock()
			continue
		}
		close(l.changed)
		l.changed = make(chan struct{})
		l.mu.Unlock()
	}
}

// counts returns how many publishes and snapshots were logged.
func (l *logFollower) counts() (published, snapshots int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.published), len(l.snapshots)
}

// firstPublishedAfter waits until a publish at or after t is logged and
// returns it with the xDS snapshot set from it (zero if none within
// the wait).
func (l *logFollower) after(t time.Time, within time.Duration) (pub, snap logEvent, ok bool) {
	deadline := time.After(within)
	for {
		l.mu.Lock()
		for _, p := range l.published {
			if !p.Time.Before(t) {
				pub = p
				break
			}
		}
		if pub.Version != 0 {
			for _, s := range l.snapshots {
				if s.RegistryVersion >= pub.Version {
					snap = s
					break
				}
			}
		}
		ch := l.changed
		l.mu.Unlock()
		if pub.Version != 0 && snap.RegistryVersion != 0 {
			return pub, snap, true
		}
		select {
		case <-ch:
		case <-deadline:
			return pub, snap, false
		}
	}
}
