# Two pools: a large model on vLLM and a small one on SGLang.
#
#   switchyard validate -config examples/multi-pool.hcl

listener "public" {
  address = "0.0.0.0:8080"
}

# Requests for models not listed below (and header-only requests such as
# GET /health) go to the "llama" pool instead of getting a 404.
routing {
  default_pool = "llama"
}

pool "llama" {
  engine       = "vllm"
  failure_mode = "fail_closed"
  endpoints    = ["10.0.0.11:8000", "10.0.0.12:8000"]

  # Taken out of rotation for maintenance: keeps its place in the file but
  # gets no new requests.
  endpoint "10.0.0.13:8000" {
    draining = true
  }

  scheduling {
    profile         = "default" # or "predicted-ttft" where requests share long system prompts
    picker          = "max-score"
    scrape_interval = "50ms"
    queue_threshold = 2
    kv_threshold    = 0.8
    session_header  = "x-session-id"
    scorers         = { queue = 1, kv_cache = 1, prefix = 2 }
  }

  # When every server would queue a request, it waits in switchyard
  # instead: interactive traffic (x-priority: 1, set by the frontend
  # proxy) first, then fairly between the teams named by x-team.
  admission {
    ttl             = "20s"
    fairness        = "tokens"
    flow_header     = "x-team"
    priority_header = "x-priority"
    priority_min    = 0
    priority_max    = 1
  }
}

pool "qwen" {
  engine       = "sglang"
  failure_mode = "fail_open"
  endpoints    = ["10.0.1.21:30000", "[fd00::22]:30000"]
  metrics_path = "/metrics"
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

model "llama-v2" {
  pool = "llama"
}

# Clients ask for "chat"; 90% of requests are rewritten to the current
# model, 10% to the candidate.
model "chat" {
  pool = "llama"

  target "meta-llama/Llama-3.1-8B-Instruct" {
    weight = 90
  }
  target "llama-v2" {
    weight = 10
  }
}

# Batch traffic: priority below 0 makes it sheddable (429) under load.
model "Qwen/Qwen2.5-1.5B-Instruct" {
  pool     = "qwen"
  priority = -1
}
