// Package hclfile owns switchyard's HCL configuration format: it parses a
// file, or every *.hcl file in a directory merged as one, into a
// registry.Update, reporting every problem as an hcl.Diagnostic with
// file:line:column; and it provides Source, the registry.Source that
// re-reads the files on change, on Reload (SIGHUP) and periodically.
//
// # Schema
//
// Top level: any number of listener, pool and model blocks, and at most one
// routing block, one consul block and one tls block, spread over any number
// of files. Names must be unique across all files.
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
//
//	  scheduling {                # optional, at most one; every attribute
//	                              # optional, unset means the picker default
//	    profile         = "default"   # default (= weighted) | weighted |
//	                                  # predicted-ttft | round-robin |
//	                                  # random | least-queue | least-request
//	    picker          = "max-score" # max-score | weighted-random
//	    scrape_interval = "50ms"      # Go duration, at least 1ms
//	    queue_threshold = 5           # whole number >= 0: queue length at
//	                                  # which an endpoint counts as saturated
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
