// Command loadgen drives an OpenAI-compatible endpoint (vLLM, cmd/vllm-sim,
// or Envoy in front of them) with seeded synthetic workloads and prints TTFT,
// TPOT, ITL and end-to-end latency, throughput, prefix-cache hit rate,
// errors and per-server counts. The logic lives in package load; this file
// only maps flags onto load.Config.
//
// Example: shared-prefix traffic at 50 then 200 requests/s (Poisson), 20%
// to a LoRA adapter, text report on stdout and JSON in out.json:
//
//	loadgen -url http://127.0.0.1:8080 -model meta-llama/Meta-Llama-3-8B-Instruct \
//	  -workload shared-prefix -groups 4 -users-per-group 8 -system-len 192 -question-len 32 \
//	  -output-len 64 -arrival poisson -stages 50:30s,200:30s -lora sql-lora:0.2 -json out.json
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/switchyard/switchyard/cmd/loadgen/load"
)

type headerFlag struct{ h http.Header }

func (f *headerFlag) String() string { return "" }

func (f *headerFlag) Set(s string) error {
	name, value, err := load.ParseHeader(s)
	if err != nil {
		return err
	}
	f.h.Add(name, value)
	return nil
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	headers := &headerFlag{h: http.Header{}}
	var (
		url         = fs.String("url", "http://127.0.0.1:8080", "OpenAI-compatible base URL (a trailing /v1 is accepted); several, comma-separated, are used in turn (client-side round-robin, the routing baseline)")
		api         = fs.String("api", "completions", "API: completions or chat")
		model       = fs.String("model", "", "model name to send (required)")
		stream      = fs.Bool("stream", true, "stream responses (SSE with usage) so TTFT and ITL are measured")
		timeout     = fs.Duration("timeout", load.DefaultTimeout, "per-request timeout")
		workload    = fs.String("workload", "random", "workload: shared-prefix, multi-turn, random or short-long")
		seed        = fs.Uint64("seed", 1, "seed for prompts, choices and Poisson arrivals")
		groups      = fs.Int("groups", 8, "shared-prefix: number of groups (each has its own system prompt); short-long: number of long documents")
		users       = fs.Int("users-per-group", 8, "shared-prefix: users (fixed questions) per group")
		systemLen   = fs.Int("system-len", 512, "shared-prefix: system prompt tokens; multi-turn: per-session system prompt tokens (0 = none); short-long: long document tokens")
		questionLen = fs.Int("question-len", 64, "shared-prefix: question tokens; multi-turn: tokens per user message; short-long: question tokens on a long document")
		longFrac    = fs.Float64("long-fraction", 0.1, "short-long: share of requests on a long document")
		sessions    = fs.Int("sessions", 16, "multi-turn: concurrent chat sessions")
		turns       = fs.Int("turns", 4, "multi-turn: turns per session (then it restarts as a new session)")
		sessHeader  = fs.String("session-header", load.DefaultSessionHeader, "multi-turn: header carrying the session id")
		inputLen    = fs.String("input-len", "128-512", "random: prompt tokens, N or MIN-MAX; short-long: short prompt tokens")
		outputLen   = fs.String("output-len", "64", "output tokens per request (max_tokens = min_tokens, ignore_eos), N or MIN-MAX")
		arrival     = fs.String("arrival", "constant", "arrivals: constant, poisson, bursty (open loop: Poisson at 2.5x the rate a quarter of the time, 0.5x otherwise) or concurrency (closed loop)")
		rate        = fs.Float64("rate", 10, "requests per second (open loop) when -stages is not given")
		concurrency = fs.Int("concurrency", 8, "requests in flight (-arrival concurrency) when -stages is not given")
		duration    = fs.Duration("duration", 30*time.Second, "run length when -stages is not given")
		stages      = fs.String("stages", "", "stages as value:duration,...; value is a rate, or a concurrency with -arrival concurrency (e.g. 10:30s,50:30s)")
		lora        = fs.String("lora", "", "LoRA split adapter:fraction,... (e.g. sql-lora:0.2,other:0.1); the rest goes to -model")
		maxInFlight = fs.Int("max-inflight", load.DefaultMaxInFlight, "open loop: arrivals beyond this many requests in flight are dropped and counted")
		drain       = fs.Duration("drain-timeout", load.DefaultDrainTimeout, "after the last stage, wait this long for in-flight requests, then cancel them")
		jsonPath    = fs.String("json", "", "also write the JSON report to this file")
		format      = fs.String("format", "text", "stdout format: text or json")
		verbose     = fs.Bool("v", false, "debug logging (every failed request)")
	)
	fs.Var(headers, "H", "extra request header 'Name: value' (repeatable)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "loadgen: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *format != "text" && *format != "json" {
		fmt.Fprintf(stderr, "loadgen: -format %q: want text or json\n", *format)
		return 2
	}

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))

	cfg := load.Config{
		URL:      *url,
		API:      load.API(*api),
		Model:    *model,
		NoStream: !*stream,
		Headers:  headers.h,
		Timeout:  *timeout,
		Workload: load.Workload{
			Kind:          load.WorkloadKind(*workload),
			Groups:        *groups,
			UsersPerGroup: *users,
			SystemLen:     *systemLen,
			QuestionLen:   *questionLen,
			Sessions:      *sessions,
			Turns:         *turns,
			SessionHeader: *sessHeader,
			LongFraction:  *longFrac,
		},
		Arrival:      load.ArrivalKind(*arrival),
		Seed:         *seed,
		MaxInFlight:  *maxInFlight,
		DrainTimeout: *drain,
		Logger:       logger,
	}
	var errs []error
	var err error
	if cfg.Workload.Output, err = load.ParseRange(*outputLen); err != nil {
		errs = append(errs, fmt.Errorf("-output-len: %w", err))
	}
	if cfg.Workload.Input, err = load.ParseRange(*inputLen); err != nil {
		errs = append(errs, fmt.Errorf("-input-len: %w", err))
	}
	if cfg.LoRA, err = load.ParseLoRA(*lora); err != nil {
		errs = append(errs, fmt.Errorf("-lora: %w", err))
	}
	if strings.TrimSpace(*stages) != "" {
		if cfg.Stages, err = load.ParseStages(*stages, cfg.Arrival); err != nil {
			errs = append(errs, fmt.Errorf("-stages: %w", err))
		}
	} else {
		st := load.Stage{Rate: *rate, Duration: *duration}
		if cfg.Arrival == load.ArrivalConcurrency {
			st = load.Stage{Concurrency: *concurrency, Duration: *duration}
		}
		cfg.Stages = []load.Stage{st}
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintf(stderr, "loadgen: %v\n", err)
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := load.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "loadgen: %v\n", err)
		return 2
	}
	if *jsonPath != "" {
		if err := writeJSONFile(*jsonPath, rep); err != nil {
			fmt.Fprintf(stderr, "loadgen: %v\n", err)
			return 1
		}
	}
	if *format == "json" {
		err = rep.WriteJSON(stdout)
	} else {
		err = rep.WriteText(stdout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "loadgen: write report: %v\n", err)
		return 1
	}
	return 0
}

func writeJSONFile(path string, rep *load.Report) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("json report: %w", err)
	}
	if err := rep.WriteJSON(f); err != nil {
		f.Close()
		return fmt.Errorf("json report %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("json report %s: %w", path, err)
	}
	return nil
}
