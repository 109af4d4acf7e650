package mtls

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"
)

// ConnectAgent is the part of Consul's agent API the Consul functions use;
// *api.Agent implements it.
type ConnectAgent interface {
	ConnectCALeaf(service string, q *api.QueryOptions) (*api.LeafCert, *api.QueryMeta, error)
	ConnectCARoots(q *api.QueryOptions) (*api.CARootList, *api.QueryMeta, error)
}

var _ ConnectAgent = (*api.Agent)(nil)

// consulWait is the longest a blocking leaf query waits; the agent answers
// earlier when it renews the leaf (before expiry, or on a CA rotation).
const consulWait = 5 * time.Minute

// LoadConsul fetches a Consul Connect leaf certificate for service from the
// local agent and Connect's CA roots (the client CA) once, and sets them.
// The agent issues the leaf; its SAN is the service's SPIFFE ID,
// spiffe://<trust domain>/ns/<namespace>/dc/<datacenter>/svc/<service>.
func (s *Server) LoadConsul(ctx context.Context, agent ConnectAgent, service string) error {
	_, err := s.consulOnce(ctx, agent, service, 0, 0)
	return err
}

// WatchConsul keeps the Consul Connect material current until ctx ends: a
// blocking query on the leaf returns when the agent renews it (or after
// five minutes), and the roots are re-read every time, so renewals and CA
// rotations are swapped in like a file rotation. Errors are logged and
// retried with backoff; the material in use stays.
func (s *Server) WatchConsul(ctx context.Context, agent ConnectAgent, service string) error {
	var (
		idx     uint64
		backoff = 100 * time.Millisecond
		lastErr string
	)
	for ctx.Err() == nil {
		next, err := s.consulOnce(ctx, agent, service, idx, consulWait)
		if err == nil {
			idx, backoff, lastErr = next, 100*time.Millisecond, ""
			continue
		}
		if ctx.Err() != nil {
			break
		}
		if err.Error() != lastErr {
			s.log.Warn("consul connect certificate: keeping the certificate in use", "service", service, "err", err)
			lastErr = err.Error()
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 10*time.Second)
	}
	return nil
}

// consulOnce runs one leaf query (blocking on idx for up to wait) and one
// roots read, sets the material if leaf or roots changed, and returns the
// index to block on next.
func (s *Server) consulOnce(ctx context.Context, agent ConnectAgent, service string, idx uint64, wait time.Duration) (uint64, error) {
	leaf, meta, err := agent.ConnectCALeaf(service, (&api.QueryOptions{WaitIndex: idx, WaitTime: wait}).WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("consul connect leaf certificate for %q: %w", service, err)
	}
	roots, _, err := agent.ConnectCARoots((&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("consul connect CA roots: %w", err)
	}
	if roots == nil || len(roots.Roots) == 0 {
		return 0, errors.New("consul connect CA roots: none (is Connect enabled on the agent?)")
	}
	var bundle strings.Builder
	key := leaf.SerialNumber
	for _, r := range roots.Roots {
		key += "|" + r.ID
		bundle.WriteString(r.RootCertPEM + "\n")
	}
	s.mu.Lock()
	same := key == s.consulKey
	s.mu.Unlock()
	if same {
		return meta.LastIndex, nil
	}
	m, err := Parse([]byte(leaf.CertPEM), []byte(leaf.PrivateKeyPEM), []byte(bundle.String()), "consul")
	if err != nil {
		return 0, fmt.Errorf("consul connect certificate for %q: %w", service, err)
	}
	s.mu.Lock()
	s.consulKey = key
	s.mu.Unlock()
	s.Set(m)
	return meta.LastIndex, nil
}
