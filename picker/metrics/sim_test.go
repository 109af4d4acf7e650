package metrics

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard/switchyard/internal/testutil"
	"github.com/switchyard/switchyard/registry"
)

// TestScrapeRealSimulator scrapes a real vllm-sim process while it goes
// from idle to saturated (queue, KV use) and back.
func TestScrapeRealSimulator(t *testing.T) {
	bin := testutil.Binary(t, "vllm-sim")
	port := testutil.FreePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	testutil.Start(t, "vllm-sim", bin, "-port", strconv.Itoa(port), "-model", "sim-model",
		"-time-scale", "4", "-max-num-seqs", "2", "-num-gpu-blocks", "200", "-block-size", "16",
		"-lora-modules", "ad-a,ad-b", "-max-loras", "2", "-log-level", "warn")
	testutil.WaitTCP(t, addr, 10*time.Second)

	m := NewManager(context.Background(), Options{Interval: 10 * time.Millisecond})
	defer m.Stop()
	k := Key{Pool: "sim", Address: addr}
	if err := m.Sync([]Target{{Pool: "sim", Address: addr, Engine: registry.EngineVLLM}}); err != nil {
		t.Fatal(err)
	}
	idle := waitValues(t, m, k, "idle simulator scraped", func(v Values) bool {
		return v.BlockSize == 16 && v.NumBlocks == 200
	})
	if idle.Waiting != 0 || idle.Running != 0 || idle.KVUsage != 0 || len(idle.Missing) != 0 {
		t.Fatalf("idle simulator: %+v", idle.Values)
	}
	// The first successful scrape also read /v1/models: the served name
	// and both adapters.
	if want := []string{"ad-a", "ad-b", "sim-model"}; !slices.Equal(idle.ServedModels, want) {
		t.Errorf("served models %q, want %q", idle.ServedModels, want)
	}

	// Five long requests against max-num-seqs 2: two run, three queue.
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for i := range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			model := "sim-model"
			if i == 0 {
				model = "ad-a"
			}
			body, _ := json.Marshal(map[string]any{"model": model, "prompt": strings.Repeat(fmt.Sprintf("req%d word ", i), 60), "max_tokens": 150, "ignore_eos": true})
			resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("status %d", resp.StatusCode)
			}
		}()
	}
	sawLoad, sawAdapter := false, false
	testutil.Eventually(t, 20*time.Second, "queue, running and KV use seen", func() error {
		s := m.Get(k)
		if s.Err == nil && s.Running == 2 && s.Waiting >= 1 && s.KVUsage > 0 {
			sawLoad = true
		}
		if slices.Contains(s.RunningAdapters, "ad-a") && s.MaxLoras == 2 {
			sawAdapter = true
		}
		if !sawLoad || !sawAdapter {
			return fmt.Errorf("load seen %v, adapter seen %v, latest %+v", sawLoad, sawAdapter, s.Values)
		}
		return nil
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	s := waitValues(t, m, k, "drained", func(v Values) bool { return v.Running == 0 && v.Waiting == 0 && v.KVUsage == 0 })
	if s.Failing || s.ConsecutiveFailures != 0 || s.Age(time.Now()) < 0 {
		t.Errorf("live simulator snapshot: %+v", *s)
	}
}
