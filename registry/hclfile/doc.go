// Package hclfile owns switchyard's HCL configuration format: it parses a
// file, or every *.hcl file in a directory merged as one, into a
// registry.Update, reporting every problem as an hcl.Diagnostic with
// file:line:column; and it provides Source, the registry.Source that
// re-reads the files on change, on Reload (SIGHUP) and periodically.
//
// # Schema
//
// Top level: any number of listener, pool, model and tenant blocks, and at
// most one routing block, one consul block, one tls block, one tenants
// block and one tracing block, spread over any number of files. Names must
// be unique across all files.
//
//	consul {                      # optional, at most one: how to reach the
//	                              # Consul agent; each set attribute wins
//	                              # over its CONSUL_HTTP_* variable. Read
//	                              # once at start (Config.Consul), not part
//	                              # of the registry state.
//	  address    = "https://consul.internal:8501" # host:port,
//	                              # http(s)://host:port or unix:///path
//	  token      = "..."          # ACL token, or
//	  token_file = "/etc/switchyard/consul.token" # not both
//	  tls {                       # optional
//	    server_name = "consul.internal"
//	    ca_file     = "/etc/consul/ca.pem"   # and/or ca_path
//	    cert_file   = "/etc/consul/client.pem" # client certificate: both
//	    key_file    = "/etc/consul/key.pem"    # or neither
//	    insecure_skip_verify = false
//	  }
//	}
//
//	tls {                         # optional, at most one: mutual TLS for
//	                              # ADS and ext_proc; read once at start;
//	                              # serve's -tls-* flags win over it
//	  cert_file      = "/etc/switchyard/tls/cert.pem"  # the three files
//	  key_file       = "/etc/switchyard/tls/key.pem"   # together, re-read
//	  client_ca_file = "/etc/switchyard/tls/ca.pem"    # every second
//	  consul_service = "switchyard" # or: Consul Connect leaf + CA roots
//	  allowed_sans   = ["envoy.internal"] # optional client SAN allowlist
//	  envoy_dir      = "/etc/envoy/switchyard-tls" # certificate directory
//	                              # on every Envoy host (the default)
//	  allow_plaintext  = false    # without TLS: serve on non-loopback
//	                              # addresses anyway (warns)
//	  admin_token_file = "/etc/switchyard/admin.token" # bearer token for
//	                              # state-changing admin requests
//	  admin_tls        = false    # admin over HTTPS; a client certificate
//	                              # of the CA also authorises changes
//	}
//
//	tracing {                     # optional, at most one: OpenTelemetry
//	                              # traces; read once at start; serve's
//	                              # -tracing-* flags win over it
//	  endpoint       = "127.0.0.1:4317" # required: OTLP/gRPC collector for
//	                              # switchyard's spans (http:// plaintext,
//	                              # the default, or https:// for TLS)
//	  sample_ratio   = 1          # share of requests traced, 0 to 1
//	                              # (default 1); a sampled traceparent wins
//	  service_name   = "switchyard" # default
//	  envoy          = true       # Envoy traces too (default true): it
//	                              # starts the trace and passes it on
//	  envoy_endpoint = "10.0.0.9:4317" # the collector as Envoy hosts reach
//	                              # it (default: endpoint's host:port)
//	  envoy_service_name = "envoy" # default
//	}
//
//	listener "NAME" {
//	  address = "0.0.0.0:8080"   # required; ip:port Envoy listens on
//	}
//
//	routing {                     # optional, at most one
//	  default_pool = "llama"      # optional; requests for unknown models and
//	                              # header-only requests (GET /health; the
//	                              # picker answers GET /v1/models itself) go
//	                              # to this pool instead of getting a 404.
//	                              # Default: none.
//	}
//
//	replicas {                    # optional, at most one: several switchyard
//	                              # processes serve this configuration at
//	                              # once (active-active); every one lists
//	                              # them all in Envoy's picker cluster and
//	                              # shares its picks with the others
//	  consul_service = "switchyard" # each replica registers itself in Consul
//	                              # under this name (its picker address, a
//	                              # check on its /readyz); the passing
//	                              # instances are the replicas
//	  peers = ["10.0.0.5:9002", "10.0.0.6:9002"]  # and/or a static list of
//	                              # every replica's picker (ext_proc) address
//	                              # as Envoys reach it (-extproc-advertise)
//	}
//
//	pool "NAME" {
//	  endpoints    = ["127.0.0.1:8001", "[::1]:8002"]  # optional; model
//	                              # servers as ip:port or [ipv6]:port literals
//	                              # (no hostnames, port 1-65535, not 0.0.0.0);
//	                              # stored canonicalised. Default: none (e.g.
//	                              # Consul supplies them).
//	  engine       = "vllm"       # vllm (default) | sglang | trtllm-serve |
//	                              # triton-tensorrt-llm: metrics dialect
//	  failure_mode = "fail_closed" # fail_closed (default): 5xx when the
//	                              # picker is down; fail_open: Envoy's own
//	                              # load balancing keeps serving
//	  metrics_path = "/metrics"   # default "/metrics"; absolute HTTP path
//	  upstream_api_key_file = "/etc/switchyard/vllm.key" # optional: the key
//	                              # the picker sends the pool's servers as
//	                              # Authorization: Bearer (vLLM --api-key)
//	                              # and uses to read their /v1/models;
//	                              # re-read with the configuration, never
//	                              # shown or stored. Or:
//	  upstream_api_key_env  = "VLLM_API_KEY" # the same from an environment
//	                              # variable (not both)
//
//	  scheduling {                # optional, at most one; every attribute
//	                              # optional, unset means the picker default
//	    profile         = "default"   # default (= weighted) | weighted |
//	                                  # predicted-ttft | round-robin |
//	                                  # random | least-queue | least-request
//	    picker          = "max-score" # max-score | weighted-random
//	    scrape_interval = "50ms"      # Go duration, at least 1ms
//	    queue_threshold = 2           # whole number >= 0: queue length at
//	                                  # which an endpoint counts as saturated
//	                                  # (counting sends since the scrape)
//	    kv_threshold    = 0.8         # 0..1: KV-cache use at which an
//	                                  # endpoint counts as saturated
//	    session_header  = "x-session-id" # header for session affinity
//	                                  # (lower-cased)
//	    adapters_on_demand = false    # true: the servers load LoRA adapters
//	                                  # when asked (vLLM's runtime LoRA
//	                                  # loading), so any endpoint may take
//	                                  # any of the pool's adapters; false: an
//	                                  # adapter goes only to servers that list
//	                                  # it (models, Consul meta, /v1/models)
//	    scorers = { queue = 1, kv_cache = 1, prefix = 2 } # scorer weight
//	                                  # overrides (>= 0) of: queue, running,
//	                                  # kv_cache, in_flight, in_flight_tokens,
//	                                  # prefix, lora, session, ttft ("_" or
//	                                  # "-")
//	    metrics = { waiting = "vllm:num_requests_waiting" } # metric name
//	                                  # overrides; keys: waiting, running,
//	                                  # kv_usage, lora_info, cache_config
//	  }
//
//	  consul {                    # optional, at most one: members also come
//	                              # from Consul (see registry/consul for the
//	                              # service-meta convention)
//	    service      = "vllm"     # required; Consul service name
//	    tag          = "llama-8b" # optional; only instances with this tag
//	    datacenter   = "dc1"      # optional; default: the agent's datacenter
//	    passing_only = true       # default false: passing and warning
//	                              # instances join, maintenance ones drain;
//	                              # true: only instances whose checks all pass
//	    panic_threshold = 0.5     # discovery guard: when one answer takes
//	                              # more than this share (0..1) of the pool's
//	                              # ready endpoints out for failing checks,
//	                              # or all of them, they stay routable for
//	    panic_grace = "30s"       # this long while their metrics scrapes
//	                              # succeed ("0s": off). Deregistration and
//	                              # maintenance are never delayed
//	  }
//
//	  admission {                 # optional, at most one: the pool's
//	                              # admission queue (picker/admission);
//	                              # every attribute optional
//	    enabled          = true   # false: saturated requests go at once
//	    max_queued       = 1024   # whole number >= 0 (0: the default):
//	                              # waiting requests of the pool
//	    max_queued_bytes = 67108864 # their bodies, bytes (0: 64 MiB)
//	    band_max_queued  = 0      # per priority band (0: no own bound)
//	    ttl              = "30s"  # longest wait, then 429; at most 5m
//	    no_endpoint_wait = "5s"   # longest wait while no endpoint is
//	                              # ready, then 503; at most 5m
//	    fairness         = "tokens" # tokens | round-robin
//	    shed_sheddable   = true   # default true: priority < 0 gets 429 at
//	                              # once when the pool is saturated (the
//	                              # protocol); false: it waits, lowest band
//	    flow_header      = "x-tenant"   # header naming the flow (lower-cased)
//	    priority_header  = "x-priority" # header overriding the priority,
//	    priority_min     = 0      # clamped to [priority_min, priority_max];
//	    priority_max     = 1      # setting either needs priority_header
//	  }
//
//	  endpoint "127.0.0.1:8003" { # optional, any number: an endpoint with
//	                              # settings; same rules as endpoints entries,
//	                              # and an address may appear only once in
//	                              # the list and blocks together
//	    draining     = true       # default false: no new requests, removed
//	                              # from EDS
//	    metrics_path = "/m"       # default: the pool's metrics_path
//	    models       = ["sql-lora"] # default none: models and LoRA adapters
//	                              # this endpoint advertises; without it the
//	                              # picker goes by what the server lists in
//	                              # GET /v1/models
//	    role         = "decode"   # default "both": prefill | decode | both,
//	                              # the endpoint's part in a disaggregated
//	                              # request; needs the pool's disaggregation
//	                              # block. A decode endpoint's address is its
//	                              # sidecar's (cmd/pd-sidecar)
//	  }
//
//	  disaggregation {            # optional, at most one: serve the pool's
//	                              # requests split between prefill and decode
//	                              # servers (endpoint roles)
//	    enabled         = true    # default true
//	    uncached_tokens = 512     # default 512: split a request when at least
//	                              # this many of its prompt tokens are not
//	                              # cached on the decode server chosen
//	    min_prompt_tokens = 0     # default 0: never split shorter prompts
//	    prefill_queue_threshold = 0 # default: the pool's queue_threshold; a
//	                              # prefill server with this many waiting is
//	                              # not chosen, and when every one is, the
//	                              # decode server runs the whole request
//	  }
//	}
//
//	model "NAME" {                # NAME is the client-visible model name
//	  pool     = "llama"          # required; a pool declared in the files
//	  priority = 0                # default 0; whole number; < 0 marks the
//	                              # model's requests sheddable (429 under load)
//
//	  target "OTHER" {            # optional, any number: rewrite requests to
//	                              # OTHER, chosen by weight. OTHER may not be
//	                              # NAME itself, must be unique within the
//	                              # model, and when OTHER is itself a model it
//	                              # must use the same pool.
//	    weight = 90               # default 1; whole number >= 0; the weights
//	                              # of a model must sum to more than 0
//	  }
//
//	  disaggregation {            # optional: this model's own policy in a
//	                              # disaggregated pool, in place of the
//	                              # pool's; same attributes ("enabled =
//	                              # false" keeps the model's requests whole)
//	  }
//	}
//
//	tenants {                     # optional, at most one
//	  hide_forbidden_models = false # default false: a model the tenant
//	                              # may not use answers 403; true: 404, as
//	                              # if it did not exist
//	}
//
//	tenant "NAME" {               # optional, any number. With at least one
//	                              # tenant every request needs one of the
//	                              # tenants' API keys (Authorization: Bearer
//	                              # KEY, or x-api-key: KEY), else 401
//	  api_keys = ["sha256:9f86d0..."] # hashes of the tenant's keys
//	                              # (switchyard key new prints a key and its
//	                              # hash), never the keys; a hash may belong
//	                              # to one tenant only
//	  api_key_file = "/etc/switchyard/team-a.keys" # and/or a file of
//	                              # hashes, one per line (# comments),
//	                              # re-read when it changes: delete a line
//	                              # to revoke a key
//	  models   = ["m"]            # default: every model; the client names
//	                              # the tenant may request (declared, or
//	                              # served by routing.default_pool)
//	  priority = 10               # optional whole number: the tenant's
//	                              # default priority in the admission queue
//	  limits {                    # optional, at most one; 0 or absent:
//	                              # unlimited. Sliding windows, split evenly
//	                              # among the replicas
//	    requests_per_minute = 600
//	    tokens_per_minute   = 100000   # prompt + completion tokens as the
//	    tokens_per_day      = 5000000  # responses' usage reports them
//	    count_cached        = true     # default true: cached prompt tokens
//	                                   # count toward the token limits
//	    assumed_max_tokens  = 1024     # default 1024 (0 or absent): output
//	                                   # reserved at admission for a request
//	                                   # that sets no max_tokens
//	  }
//	}
//
// Values are literals: variables and functions are not available. Every
// unknown attribute or block is an error. A configuration without a
// listener block is valid but draws a warning.
//
// # Adding an attribute
//
// Each block type has one table of attribute specs (decode.go, tls.go):
// a new attribute is one entry, such as
//
//	intAttr("max_retries", func(p *registry.Pool, v int) { p.MaxRetries = v }),
//
// which also puts it in the block's HCL schema, reports a bad value at its
// file:line:column and records where it was written, so registry.Validate's
// errors about it point there. Document it in the schema above.
package hclfile
