// Command vllm-sim is a simulated vLLM server: the OpenAI completions and
// chat API, LoRA adapter loading, /health and vLLM's Prometheus metrics, in
// front of a step-loop engine (package sim) that batches, prefix-caches,
// preempts and queues like vLLM V1 with timing calibrated to Llama-3-8B on
// one H100. Failure-injection flags make it misbehave on purpose.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/cmd/vllm-sim/sim"
	"github.com/switchyard/switchyard/internal/cli"
	healthprobe "github.com/switchyard/switchyard/internal/probe"
	"github.com/switchyard/switchyard/picker/kvevents"
)

func main() { cli.Main("vllm-sim", run) }

// listFlag collects comma-separated values from one or more uses of a flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	for _, part := range strings.Split(v, ",") {
		if part = strings.TrimSpace(part); part != "" {
			*l = append(*l, part)
		}
	}
	return nil
}

type options struct {
	host, model         string
	apiKey              string
	port                int
	served, loraModules listFlag
	enableLoRA          bool
	cfg                 sim.Config
	defaultMaxTokens    int
	eosMean             int
	errorRate           float64
	errorCodes          string
	seed                uint64
	startupDelay        time.Duration
	hangAfter           int
	hangRate            float64
	crashAfter          int
	logLevel            string
	probe               string
	kvConnector         string
	kvFailurePolicy     string
	kvSideChannelHost   string
	// KV-cache events (vLLM --kv-events-config): PUB and replay ports on
	// -host (0: off / no replay), topic and payload format.
	kvPort, kvReplayPort int
	kvTopic              string
	kvFormat             string
	metricsDelay         time.Duration
	fleet                int
	fleetAddrs           string
	fleetStats           string
}

func parseFlags(args []string) (*options, error) {
	def := sim.DefaultConfig()
	o := &options{cfg: def}
	fs := flag.NewFlagSet("vllm-sim", flag.ContinueOnError)
	fs.StringVar(&o.host, "host", "127.0.0.1", "address to listen on")
	fs.IntVar(&o.port, "port", 8001, "port to listen on (0 picks a free one)")
	fs.StringVar(&o.model, "model", def.Model, "model name")
	fs.Var(&o.served, "served-model-name", "names the model is served under (comma-separated or repeated); default -model")
	fs.Var(&o.loraModules, "lora-modules", "LoRA adapters loaded at start: name or name=path, comma-separated or repeated")
	fs.BoolVar(&o.enableLoRA, "enable-lora", false, "enable LoRA adapters (implied by -lora-modules)")
	fs.IntVar(&o.cfg.MaxLoRAs, "max-loras", def.MaxLoRAs, "max distinct adapters in a running batch")
	fs.IntVar(&o.cfg.MaxNumSeqs, "max-num-seqs", def.MaxNumSeqs, "max running requests")
	fs.IntVar(&o.cfg.MaxNumBatchedTokens, "max-num-batched-tokens", def.MaxNumBatchedTokens, "token budget per engine step")
	fs.IntVar(&o.cfg.NumGPUBlocks, "num-gpu-blocks", def.NumGPUBlocks, "KV cache blocks")
	fs.IntVar(&o.cfg.NumGPUBlocks, "num-gpu-blocks-override", def.NumGPUBlocks, "alias of -num-gpu-blocks (vLLM's name)")
	fs.IntVar(&o.cfg.BlockSize, "block-size", def.BlockSize, "tokens per KV block")
	fs.BoolVar(&o.cfg.EnablePrefixCaching, "enable-prefix-caching", def.EnablePrefixCaching, "reuse KV blocks of shared prompt prefixes")
	fs.IntVar(&o.cfg.MaxModelLen, "max-model-len", def.MaxModelLen, "max prompt+output tokens per request")
	fs.Float64Var(&o.cfg.TimeScale, "time-scale", 1, "speed-up factor for all simulated durations (10 = 10x faster)")
	fs.DurationVar(&o.cfg.FrontendLatency, "frontend-latency", def.FrontendLatency, "API-server overhead per request before it reaches the engine queue (scaled by -time-scale)")
	fs.DurationVar(&o.cfg.StepBase, "step-time", def.StepBase, "fixed part of an engine step (scaled by -time-scale)")
	fs.DurationVar(&o.cfg.PerDecodeSeq, "decode-time-per-seq", def.PerDecodeSeq, "engine step time per decoding request")
	fs.DurationVar(&o.cfg.PerPrefillToken, "prefill-time-per-token", def.PerPrefillToken, "engine step time per prompt token computed")
	fs.Float64Var(&o.cfg.BatchSlowdown, "batch-slowdown", 1, "every step lasts this many times longer with a full batch (-max-num-seqs requests) than with one request, linearly in between; 1 = none")
	fs.BoolVar(&o.cfg.LegacyKVMetric, "legacy-kv-metric", false, "report KV usage as vllm:gpu_cache_usage_perc (vLLM before 0.11)")
	fs.IntVar(&o.defaultMaxTokens, "default-max-tokens", 16, "output length when a request sets no max_tokens")
	fs.IntVar(&o.eosMean, "eos-mean-tokens", 0, "if > 0, requests without ignore_eos stop (finish_reason stop) at a prompt-derived length uniform in [1, 2N-1], but not before min_tokens; 0 = always max_tokens")
	fs.Float64Var(&o.errorRate, "error-rate", 0, "fraction of inference requests answered with an injected error")
	fs.StringVar(&o.errorCodes, "error-codes", "500,503", "HTTP codes for injected errors, picked at random")
	fs.Uint64Var(&o.seed, "seed", 1, "seed for failure injection")
	fs.DurationVar(&o.startupDelay, "startup-delay", 0, "answer 503 (health included) for this long after start")
	fs.IntVar(&o.hangAfter, "hang-after", 0, "if > 0, inference requests after the first N are accepted and never answered")
	fs.Float64Var(&o.hangRate, "hang-rate", 0, "fraction of inference requests accepted and never answered")
	fs.IntVar(&o.crashAfter, "crash-after", 0, "if > 0, the process exits (code 3) when inference request N+1 arrives")
	fs.StringVar(&o.apiKey, "api-key", "", "if set, /v1 requests need Authorization: Bearer KEY (vLLM's --api-key; else 401)")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&o.probe, "probe", "", "instead of serving, GET this `URL` (e.g. http://127.0.0.1:8000/health) and exit 0 on a 2xx answer, 1 otherwise: the container image's health check")
	fs.StringVar(&o.kvConnector, "kv-connector", "", "\"NixlConnector\" emulates vLLM's disaggregated prefill (kv_transfer_params); empty: off")
	fs.DurationVar(&o.cfg.KVTransferLatency, "kv-cache-transfer-latency", def.KVTransferLatency, "fixed time to pull a remote prefill's KV blocks (scaled by -time-scale)")
	fs.DurationVar(&o.cfg.KVTransferPerToken, "kv-cache-transfer-time-per-token", def.KVTransferPerToken, "time per transferred prompt token (scaled by -time-scale)")
	fs.DurationVar(&o.cfg.KVLease, "kv-lease-duration", def.KVLease, "how long a prefill keeps KV blocks for a decoder to pull (vLLM's kv_lease_duration)")
	fs.StringVar(&o.kvFailurePolicy, "kv-load-failure-policy", "fail", "when remote KV cannot be pulled: \"fail\" the request (500) or \"recompute\" the prompt locally")
	fs.StringVar(&o.kvSideChannelHost, "kv-side-channel-host", "", "host sent as remote_host to decoders (VLLM_NIXL_SIDE_CHANNEL_HOST); default -host")
	fs.IntVar(&o.kvPort, "kv-events-port", 0, "publish KV-cache events on this ZMQ PUB port on -host, as vLLM's --kv-events-config endpoint (0: off)")
	fs.IntVar(&o.kvReplayPort, "kv-events-replay-port", 0, "serve replay of the last 10000 event batches on this ZMQ ROUTER port (0: none)")
	fs.StringVar(&o.kvTopic, "kv-events-topic", "", "topic of the published KV events")
	fs.StringVar(&o.kvFormat, "kv-events-format", "tagged", "KV event encoding: tagged (vLLM 0.32: positional batches of maps tagged \"type\"), array (older vLLM) or map")
	fs.DurationVar(&o.metricsDelay, "metrics-delay", 0, "wait this long before answering each /metrics (a stand-in for the CPU real vLLM spends on its page)")
	fs.IntVar(&o.fleet, "fleet", 0, "if > 0, serve this many simulated servers from this process, on -port and the ports after it (or random ports with -port 0), each with its own engine")
	fs.StringVar(&o.fleetAddrs, "fleet-addrs-file", "", "with -fleet: write the servers' addresses to this file, one a line, once all listen")
	fs.StringVar(&o.fleetStats, "fleet-stats-addr", "", "with -fleet: serve GET /fleet (JSON: each server's address and the /metrics requests it answered) on this address")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if len(o.served) == 0 {
		o.served = listFlag{o.model}
	}
	o.cfg.Model = o.served[0]
	if len(o.loraModules) > 0 {
		o.enableLoRA = true
	}
	o.cfg.EnableLoRA = o.enableLoRA
	o.cfg.KVConnector = o.kvConnector != ""
	for name, v := range map[string]int{"max-num-seqs": o.cfg.MaxNumSeqs, "max-num-batched-tokens": o.cfg.MaxNumBatchedTokens,
		"num-gpu-blocks": o.cfg.NumGPUBlocks, "block-size": o.cfg.BlockSize, "max-model-len": o.cfg.MaxModelLen, "max-loras": o.cfg.MaxLoRAs} {
		if v < 1 {
			return nil, fmt.Errorf("-%s must be >= 1, got %d", name, v)
		}
	}
	switch {
	case o.cfg.TimeScale <= 0:
		return nil, fmt.Errorf("-time-scale must be > 0, got %g", o.cfg.TimeScale)
	case o.cfg.BatchSlowdown < 1:
		return nil, fmt.Errorf("-batch-slowdown must be >= 1, got %g", o.cfg.BatchSlowdown)
	case o.cfg.StepBase < 0 || o.cfg.PerDecodeSeq < 0 || o.cfg.PerPrefillToken < 0:
		return nil, fmt.Errorf("-step-time, -decode-time-per-seq and -prefill-time-per-token must not be negative")
	case o.errorRate < 0 || o.errorRate > 1:
		return nil, fmt.Errorf("-error-rate must be in [0,1], got %g", o.errorRate)
	case o.hangRate < 0 || o.hangRate > 1:
		return nil, fmt.Errorf("-hang-rate must be in [0,1], got %g", o.hangRate)
	case o.defaultMaxTokens < 1:
		return nil, fmt.Errorf("-default-max-tokens must be >= 1, got %d", o.defaultMaxTokens)
	case o.eosMean < 0:
		return nil, fmt.Errorf("-eos-mean-tokens must be >= 0, got %d", o.eosMean)
	case o.kvConnector != "" && o.kvConnector != kvConnectorNixl:
		return nil, fmt.Errorf("-kv-connector: %q is not supported; use %q", o.kvConnector, kvConnectorNixl)
	case o.kvFailurePolicy != "fail" && o.kvFailurePolicy != "recompute":
		return nil, fmt.Errorf("-kv-load-failure-policy must be fail or recompute, got %q", o.kvFailurePolicy)
	case o.cfg.KVTransferLatency < 0 || o.cfg.KVTransferPerToken < 0:
		return nil, errors.New("-kv-cache-transfer-latency and -kv-cache-transfer-time-per-token must be >= 0")
	case o.cfg.KVLease <= 0:
		return nil, fmt.Errorf("-kv-lease-duration must be > 0, got %v", o.cfg.KVLease)
	case o.kvConnector != "" && o.kvSideChannelHost == "" && unspecifiedHost(o.host):
		return nil, fmt.Errorf("-kv-connector with -host %s: set -kv-side-channel-host to the address decode servers reach this one at", o.host)
	case o.kvPort < 0 || o.kvPort > 65535 || o.kvReplayPort < 0 || o.kvReplayPort > 65535:
		return nil, fmt.Errorf("-kv-events-port and -kv-events-replay-port must be in 0-65535")
	case o.kvReplayPort != 0 && o.kvPort == 0:
		return nil, fmt.Errorf("-kv-events-replay-port needs -kv-events-port")
	case o.fleet < 0:
		return nil, fmt.Errorf("-fleet must be >= 0, got %d", o.fleet)
	case o.fleet == 0 && (o.fleetAddrs != "" || o.fleetStats != ""):
		return nil, errors.New("-fleet-addrs-file and -fleet-stats-addr need -fleet")
	case o.metricsDelay < 0:
		return nil, fmt.Errorf("-metrics-delay must be >= 0, got %v", o.metricsDelay)
	case o.fleet > 1 && o.kvPort != 0 && (o.kvPort+o.fleet-1 > 65535 || o.kvReplayPort != 0 && o.kvReplayPort+o.fleet-1 > 65535):
		return nil, fmt.Errorf("-fleet %d: -kv-events-port and -kv-events-replay-port plus %d must stay within 65535", o.fleet, o.fleet-1)
	}
	if _, err := kvevents.ParseFormat(o.kvFormat); err != nil {
		return nil, fmt.Errorf("-kv-events-format: %w", err)
	}
	return o, nil
}

// unspecifiedHost reports whether h listens on every address (0.0.0.0,
// ::, or empty), which is no address to give a decode server.
func unspecifiedHost(h string) bool {
	ip := net.ParseIP(h)
	return h == "" || ip != nil && ip.IsUnspecified()
}

func parseCodes(s string) ([]int, error) {
	var codes []int
	for _, part := range strings.Split(s, ",") {
		c, err := strconv.Atoi(strings.TrimSpace(part))
		if err != nil || c < 400 || c > 599 {
			return nil, fmt.Errorf("-error-codes: %q is not an HTTP error status", part)
		}
		codes = append(codes, c)
	}
	return codes, nil
}

func parseLoRAs(mods []string) ([]lora, error) {
	var out []lora
	seen := map[string]bool{}
	for _, m := range mods {
		name, path, _ := strings.Cut(m, "=")
		if name == "" {
			return nil, fmt.Errorf("-lora-modules: empty adapter name in %q", m)
		}
		if seen[name] {
			return nil, fmt.Errorf("-lora-modules: adapter %q given twice", name)
		}
		seen[name] = true
		if path == "" {
			path = name
		}
		out = append(out, lora{name: name, path: path})
	}
	return out, nil
}

func run(args []string) error {
	o, err := parseFlags(args)
	if err != nil {
		return err // -h: flag.ErrHelp, an exit status of 0
	}
	if o.probe != "" {
		return healthprobe.Flag(context.Background(), o.probe)
	}
	log, err := cli.Logger(os.Stderr, o.logLevel)
	if err != nil {
		return err
	}
	codes, err := parseCodes(o.errorCodes)
	if err != nil {
		return err
	}
	loras, err := parseLoRAs(o.loraModules)
	if err != nil {
		return err
	}
	n := max(o.fleet, 1)
	var servers []*server
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	// The stats listener first: a caller that chose its port as a free
	// one must not find it taken by one of the fleet's own ports.
	var statsLn net.Listener
	if o.fleetStats != "" {
		statsLn, err = net.Listen("tcp", o.fleetStats)
		if err != nil {
			return fmt.Errorf("-fleet-stats-addr: %w", err)
		}
		defer statsLn.Close()
	}
	var pdClient *http.Client
	if o.kvConnector != "" {
		pdClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	}
	for i := range n {
		cfg := o.cfg
		if o.kvPort != 0 {
			// A fleet's server i publishes on -kv-events-port + i (and
			// replays on -kv-events-replay-port + i), as it listens on
			// -port + i.
			pub, onEvents, err := startKVEvents(o, i)
			if err != nil {
				return err
			}
			defer pub.Close()
			cfg.OnKVEvents = onEvents
			log.Info("publishing KV events", "endpoint", pub.Endpoint(), "replay", pub.Replay(), "format", o.kvFormat)
		}
		eng, err := sim.New(cfg, sim.RealClock{})
		if err != nil {
			return fmt.Errorf("engine: %w", err)
		}
		port := o.port
		if port != 0 {
			port += i
		}
		ln, err := net.Listen("tcp", net.JoinHostPort(o.host, strconv.Itoa(port)))
		if err != nil {
			return fmt.Errorf("listen: %w", err)
		}
		lns = append(lns, ln)
		seed := o.seed + uint64(i)
		s := &server{
			eng:          eng,
			log:          log,
			servedBy:     ln.Addr().String(),
			apiKey:       o.apiKey,
			served:       o.served,
			loraEnabled:  o.enableLoRA,
			defaultMax:   o.defaultMaxTokens,
			eosMean:      o.eosMean,
			metricsDelay: o.metricsDelay,
			faults: faults{errorRate: o.errorRate, errorCodes: codes, hangAfter: o.hangAfter,
				hangRate: o.hangRate, crashAfter: o.crashAfter},
			readyAt: time.Now().Add(o.startupDelay),
			quit:    make(chan struct{}),
			exit:    os.Exit,
			rng:     rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
			loras:   slices.Clone(loras),
		}
		if o.kvConnector != "" {
			host := o.kvSideChannelHost
			if host == "" {
				host = ln.Addr().(*net.TCPAddr).IP.String()
			}
			// Each server of a fleet is an engine of its own.
			s.pd = pdConfig{enabled: true, engineID: newEngineID(), advertiseHost: host,
				advertisePort: ln.Addr().(*net.TCPAddr).Port, recompute: o.kvFailurePolicy == "recompute",
				client: pdClient}
		}
		servers = append(servers, s)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	engCtx, stopEngine := context.WithCancel(context.Background())
	var engines sync.WaitGroup
	for _, s := range servers {
		engines.Add(1)
		go func() { defer engines.Done(); s.eng.Run(engCtx) }()
	}
	defer func() { stopEngine(); engines.Wait() }()

	errc := make(chan error, len(servers)+1)
	var srvs []*http.Server
	for i, s := range servers {
		srv := &http.Server{Handler: s.routes(), ReadHeaderTimeout: 10 * time.Second}
		srvs = append(srvs, srv)
		go func() { errc <- srv.Serve(lns[i]) }()
	}
	if statsLn != nil {
		srv := &http.Server{Handler: fleetStats(servers), ReadHeaderTimeout: 10 * time.Second}
		srvs = append(srvs, srv)
		go func() { errc <- srv.Serve(statsLn) }()
	}
	if o.fleetAddrs != "" {
		var b strings.Builder
		for _, s := range servers {
			b.WriteString(s.servedBy + "\n")
		}
		tmp := o.fleetAddrs + ".tmp"
		if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("-fleet-addrs-file: %w", err)
		}
		if err := os.Rename(tmp, o.fleetAddrs); err != nil {
			return fmt.Errorf("-fleet-addrs-file: %w", err)
		}
	}
	cfg := servers[0].eng.Config()
	if o.fleet > 0 {
		log.Info("vllm-sim fleet listening", "servers", len(servers), "first", servers[0].servedBy, "last", servers[len(servers)-1].servedBy,
			"models", o.served, "max_num_seqs", cfg.MaxNumSeqs, "num_gpu_blocks", cfg.NumGPUBlocks, "time_scale", cfg.TimeScale, "kv_connector", o.kvConnector)
	} else {
		log.Info("vllm-sim listening", "addr", servers[0].servedBy, "models", o.served, "loras", len(loras),
			"max_num_seqs", cfg.MaxNumSeqs, "num_gpu_blocks", cfg.NumGPUBlocks, "prefix_caching", cfg.EnablePrefixCaching,
			"time_scale", cfg.TimeScale, "batch_slowdown", cfg.BatchSlowdown, "kv_connector", o.kvConnector, "engine_id", servers[0].pd.engineID)
	}

	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	for _, s := range servers {
		close(s.quit) // hanging requests drop their connections
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var errs []error
	for _, srv := range srvs {
		if err := srv.Shutdown(sctx); err != nil {
			_ = srv.Close()
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}

// startKVEvents binds the KV-event sockets of server i (of a fleet; 0
// otherwise) on -kv-events-port + i and returns the OnKVEvents hook that
// publishes each step's events as vLLM does: one batch per step, blocks of
// -block-size tokens in the GPU medium, an adapter named on every block
// (lora_name, extra_keys) with a numeric id in order of first use.
func startKVEvents(o *options, i int) (*kvevents.Publisher, func([]sim.KVEvent), error) {
	f, _ := kvevents.ParseFormat(o.kvFormat)
	po := kvevents.PublisherOptions{Endpoint: "tcp://" + net.JoinHostPort(o.host, strconv.Itoa(o.kvPort+i)), Topic: o.kvTopic, Format: f}
	if o.kvReplayPort != 0 {
		po.Replay = "tcp://" + net.JoinHostPort(o.host, strconv.Itoa(o.kvReplayPort+i))
	}
	pub, err := kvevents.NewPublisher(po)
	if err != nil {
		return nil, nil, err
	}
	bs := o.cfg.BlockSize
	loraIDs := map[string]int64{} // used under the engine's lock only
	var batch []kvevents.EncodeEvent
	onEvents := func(evs []sim.KVEvent) {
		batch = batch[:0]
		for _, ev := range evs {
			var e kvevents.EncodeEvent
			switch ev.Kind {
			case sim.KVStored:
				e.Kind, e.Hashes, e.Parent, e.HasParent, e.Tokens, e.BlockSize, e.Medium = kvevents.BlockStored, ev.Hashes, ev.Parent, ev.HasParent, ev.Tokens, bs, kvevents.MediumGPU
				e.ExtraKeys = make([][]string, len(ev.Hashes))
				if ev.LoRA != "" {
					id, ok := loraIDs[ev.LoRA]
					if !ok {
						id = int64(len(loraIDs) + 1)
						loraIDs[ev.LoRA] = id
					}
					e.LoRAName, e.LoRAID, e.HasLoRAID = ev.LoRA, id, true
					for i := range e.ExtraKeys {
						e.ExtraKeys[i] = []string{ev.LoRA}
					}
				}
			case sim.KVRemoved:
				e.Kind, e.Hashes, e.Medium = kvevents.BlockRemoved, ev.Hashes, kvevents.MediumGPU
			case sim.KVCleared:
				e.Kind = kvevents.AllBlocksCleared
			}
			batch = append(batch, e)
		}
		pub.Publish(batch)
	}
	return pub, onEvents, nil
}

// fleetStats serves GET /fleet: every server's address and how many
// /metrics requests it answered, for measuring a router from outside.
func fleetStats(servers []*server) http.Handler {
	type entry struct {
		Address string `json:"address"`
		Scrapes int64  `json:"metrics_requests"`
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/fleet" {
			http.NotFound(w, r)
			return
		}
		out := make([]entry, len(servers))
		for i, s := range servers {
			out[i] = entry{Address: s.servedBy, Scrapes: s.scrapes.Load()}
		}
		writeJSON(w, http.StatusOK, out)
	})
}
