package status

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// Peers reads each other replica's report at its admin address and keeps
// the Envoys it lists; a replica that does not answer is reported with
// its error, and this replica itself is never read.
func TestPeersReadTheOtherReplicas(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/status" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, `{"envoys":[{"id":"edge-1","streams":1},{"id":"edge-2","streams":1}]}`)
	}))
	defer up.Close()
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "draining", http.StatusServiceUnavailable)
	}))
	defer down.Close()
	var selfCalled atomic.Bool
	self := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { selfCalled.Store(true) }))
	defer self.Close()

	st := registry.Empty()
	st.Version = 1
	st.Replicas = []registry.Replica{
		{ID: "a", Address: "127.0.0.1:1", Admin: strings.TrimPrefix(self.URL, "http://")},
		{ID: "b", Address: "127.0.0.1:2", Admin: strings.TrimPrefix(up.URL, "http://")},
		{ID: "c", Address: "127.0.0.1:3", Admin: strings.TrimPrefix(down.URL, "http://")},
		{ID: "d", Address: "127.0.0.1:4"}, // a static peer: no admin address
	}
	pub := registry.NewPublisher(st)
	p := NewPeers(pub, "127.0.0.1:1", 10*time.Millisecond, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()

	testutil.Eventually(t, 5*time.Second, "both replicas read", func() error {
		v := p.Views()
		if len(v) != 2 {
			return fmt.Errorf("views %+v", v)
		}
		return nil
	})
	v := p.Views()
	if got := fmt.Sprint(v["127.0.0.1:2"].Envoys); got != "[edge-1 edge-2]" || v["127.0.0.1:2"].Err != "" {
		t.Errorf("replica b: %+v", v["127.0.0.1:2"])
	}
	if e := v["127.0.0.1:3"].Err; !strings.Contains(e, "503") {
		t.Errorf("replica c error %q, want its HTTP 503", e)
	}
	if selfCalled.Load() {
		t.Error("the replica read its own report")
	}

	// A replica that leaves the configuration leaves the views.
	st2 := *st
	st2.Version = 2
	st2.Replicas = st.Replicas[:2]
	pub.Publish(&st2)
	testutil.Eventually(t, 5*time.Second, "replica c forgotten", func() error {
		if _, ok := p.Views()["127.0.0.1:3"]; ok {
			return fmt.Errorf("still there")
		}
		return nil
	})
}
