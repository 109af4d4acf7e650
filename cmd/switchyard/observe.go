package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/switchyard/switchyard/picker/decisions"
	"github.com/switchyard/switchyard/picker/tracing"
	"github.com/switchyard/switchyard/registry/hclfile"
	"github.com/switchyard/switchyard/xds/ir"
)

// obsFlags are serve's observability settings: tracing (which the HCL
// tracing block can also set; flags win) and decision records.
type obsFlags struct {
	tracingEndpoint      string
	tracingEnvoyEndpoint string
	tracingService       string
	tracingRatio         optFloat
	tracingNoEnvoy       bool

	decisionsSample float64
	decisionsBuffer int
	decisionsFile   string
}

// optFloat is a float flag that knows whether it was given.
type optFloat struct {
	v   float64
	set bool
}

func (o *optFloat) String() string {
	if !o.set {
		return ""
	}
	return strconv.FormatFloat(o.v, 'g', -1, 64)
}

func (o *optFloat) Set(s string) error {
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return errors.New("not a number")
	}
	o.v, o.set = v, true
	return nil
}

func (f *obsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.tracingEndpoint, "tracing-endpoint", "", "OTLP/gRPC collector `address` for switchyard's OpenTelemetry spans (host:port, http://host:port, or https://host:port for TLS); turns tracing on, Envoy's too")
	fs.StringVar(&f.tracingEnvoyEndpoint, "tracing-envoy-endpoint", "", "the collector `address` (host:port) as the Envoy hosts reach it; default -tracing-endpoint's host:port")
	fs.StringVar(&f.tracingService, "tracing-service-name", "", "service.name of switchyard's spans (default \"switchyard\")")
	fs.Var(&f.tracingRatio, "tracing-sample-ratio", "share of requests traced, 0 to 1 (default 1); a request whose traceparent carries a sampling decision follows it")
	fs.BoolVar(&f.tracingNoEnvoy, "tracing-no-envoy", false, "trace in switchyard only: push Envoy no tracing configuration")
	fs.Float64Var(&f.decisionsSample, "decisions-sample", 1, "share of requests that get a decision record (/api/decisions), 0 to 1; 0 turns records off")
	fs.IntVar(&f.decisionsBuffer, "decisions-buffer", decisions.DefaultSize, "decision records kept in memory (`count`)")
	fs.StringVar(&f.decisionsFile, "decisions-file", "", "also append every decision record to this `file` as JSON lines")
}

// observability is what serve builds from obsFlags and the tracing block.
type observability struct {
	tracer    *tracing.Tracer
	envoy     *ir.TracingOptions // nil: Envoy does not trace
	decisions *decisions.Recorder
	file      string
}

// observabilityFrom resolves the flags over the configuration's tracing
// block and builds the tracer and the decision recorder.
func observabilityFrom(f obsFlags, block *hclfile.Tracing, version, instance string) (*observability, error) {
	if f.decisionsSample < 0 || f.decisionsSample > 1 {
		return nil, fmt.Errorf("-decisions-sample %v: want a number from 0 to 1", f.decisionsSample)
	}
	if f.decisionsBuffer < 0 {
		return nil, fmt.Errorf("-decisions-buffer %d: want a positive count", f.decisionsBuffer)
	}
	o := &observability{
		decisions: decisions.New(decisions.Options{Size: f.decisionsBuffer, Sample: f.decisionsSample, Disabled: f.decisionsSample == 0}),
		file:      f.decisionsFile,
	}
	cfg := tracing.Config{Endpoint: f.tracingEndpoint, ServiceName: f.tracingService, SampleRatio: 1, Version: version, Instance: instance}
	envoyEP, envoyName, envoyOn := f.tracingEnvoyEndpoint, "", !f.tracingNoEnvoy
	if b := block; b != nil {
		if cfg.Endpoint == "" {
			cfg.Endpoint = b.Endpoint
		}
		if cfg.ServiceName == "" {
			cfg.ServiceName = b.ServiceName
		}
		if b.HasSampleRatio {
			cfg.SampleRatio = b.SampleRatio
		}
		if envoyEP == "" {
			envoyEP = b.EnvoyEndpoint
		}
		envoyName = b.EnvoyServiceName
		envoyOn = envoyOn && b.Envoy
	}
	if f.tracingRatio.set {
		cfg.SampleRatio = f.tracingRatio.v
	}
	if cfg.Endpoint == "" {
		if f.tracingRatio.set || f.tracingEnvoyEndpoint != "" || f.tracingService != "" {
			return nil, errors.New("-tracing-sample-ratio, -tracing-envoy-endpoint and -tracing-service-name need -tracing-endpoint (or a tracing block)")
		}
		return o, nil
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tr, err := tracing.New(cfg)
	if err != nil {
		return nil, err
	}
	o.tracer = tr
	if envoyOn {
		if envoyEP == "" {
			envoyEP, _ = tracing.CollectorHostPort(cfg.Endpoint)
		}
		o.envoy = &ir.TracingOptions{Collector: envoyEP, ServiceName: envoyName, SamplePercent: 100 * cfg.SampleRatio}
	}
	return o, nil
}

// runTracing flushes the tracer's spans when serve stops.
func (a *app) runTracing(ctx context.Context) error {
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return a.obs.tracer.Shutdown(sctx)
}

// runDecisionsFile appends decision records to -decisions-file.
func (a *app) runDecisionsFile(ctx context.Context) error {
	return a.obs.decisions.RunFile(ctx, a.obs.file, a.log.With("component", "decisions"))
}
