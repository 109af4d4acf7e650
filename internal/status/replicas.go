package status

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/switchyard/switchyard/registry"
)

// Peers reads the other replicas' /api/status now and then, so that one
// replica's report says which Envoys hold their ADS stream on each
// replica, not only on itself. It reaches a replica at its admin address
// (known for replicas that registered in Consul; static peers list only
// picker addresses, so theirs show as unknown).
type Peers struct {
	view     registry.View
	self     string // this replica's picker address
	interval time.Duration
	scheme   string
	dial     func(host string) *http.Client

	mu      sync.Mutex
	seen    map[string]PeerView     // by replica address
	clients map[string]*http.Client // by admin address
}

// PeerView is what a replica's own report said, when it was last read.
type PeerView struct {
	// Envoys are the node IDs of the Envoys whose ADS stream it holds.
	Envoys []string
	At     time.Time
	Err    string
}

// NewPeers returns a poller of the replicas in view's states; self is this
// replica's picker address (never polled). With client nil, replicas'
// admin addresses are read over plain HTTP; otherwise over HTTPS with the
// client client returns for the admin host (the replicas' mutual TLS).
func NewPeers(view registry.View, self string, interval time.Duration, client func(host string) *http.Client) *Peers {
	p := &Peers{view: view, self: self, interval: interval, seen: map[string]PeerView{}, clients: map[string]*http.Client{},
		scheme: "https", dial: client}
	if client == nil {
		p.scheme = "http"
		plain := &http.Client{Timeout: 2 * time.Second}
		p.dial = func(string) *http.Client { return plain }
	}
	return p
}

// client returns the HTTP client for admin address admin, made once.
func (p *Peers) client(admin string) *http.Client {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.clients[admin]
	if c == nil {
		host, _, _ := strings.Cut(admin, ":")
		c = p.dial(strings.Trim(host, "[]"))
		p.clients[admin] = c
	}
	return c
}

// Run polls until ctx ends.
func (p *Peers) Run(ctx context.Context) {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		p.poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// poll reads every other replica with an admin address once.
func (p *Peers) poll(ctx context.Context) {
	st, _ := p.view.Current()
	live, admins := map[string]bool{}, map[string]bool{}
	for _, r := range st.Replicas {
		if r.Address == p.self || r.Admin == "" {
			continue
		}
		live[r.Address], admins[r.Admin] = true, true
		v := PeerView{At: time.Now()}
		envoys, err := p.read(ctx, r.Admin)
		if err != nil {
			v.Err = err.Error()
		}
		v.Envoys = envoys
		p.mu.Lock()
		p.seen[r.Address] = v
		p.mu.Unlock()
	}
	p.mu.Lock()
	for a := range p.seen {
		if !live[a] {
			delete(p.seen, a)
		}
	}
	for a, c := range p.clients {
		if !admins[a] {
			c.CloseIdleConnections()
			delete(p.clients, a)
		}
	}
	p.mu.Unlock()
}

// read fetches one replica's report and returns its Envoys.
func (p *Peers) read(ctx context.Context, admin string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.scheme+"://"+admin+"/api/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := p.client(admin).Do(req)
	if err != nil {
		return nil, fmt.Errorf("read replica status: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read replica status: HTTP %d", resp.StatusCode)
	}
	var r struct {
		Envoys []struct {
			ID string `json:"id"`
		} `json:"envoys"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&r); err != nil {
		return nil, fmt.Errorf("read replica status: %w", err)
	}
	out := []string{}
	for _, e := range r.Envoys {
		out = append(out, e.ID)
	}
	return out, nil
}

// Views returns the latest view of each polled replica, by address.
func (p *Peers) Views() map[string]PeerView {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]PeerView, len(p.seen))
	for k, v := range p.seen {
		out[k] = v
	}
	return out
}
