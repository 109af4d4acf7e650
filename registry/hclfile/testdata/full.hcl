listener "public" {
  address = "0.0.0.0:8080"
}

listener "internal" {
  address = "[::1]:8081"
}

routing {
  default_pool = "llama"
}

pool "llama" {
  endpoints    = ["127.0.0.1:8002", "[0:0::1]:8001", "[::ffff:10.0.0.1]:8000"]
  engine       = "vllm"
  failure_mode = "fail_open"
  metrics_path = "/metrics"

  scheduling {
    profile         = "default"
    picker          = "weighted-random"
    scrape_interval = "1.5s"
    queue_threshold = 5
    kv_threshold    = 0.8
    session_header  = "X-Session-ID"
    scorers         = { queue = 1, kv_cache = 0.5, prefix = 2 }
    metrics         = { waiting = "vllm:num_requests_waiting", kv_usage = "vllm:kv_cache_usage_perc" }
  }

  endpoint "127.0.0.1:8003" {
    draining     = true
    metrics_path = "/m"
    models       = ["sql-lora"]
  }
}

pool "tiny" {
  engine = "sglang"
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool     = "llama"
  priority = 2
}

model "batch" {
  pool     = "tiny"
  priority = -1
}

model "chat" {
  pool = "llama"
  target "meta-llama/Llama-3.1-8B-Instruct" { weight = 90 }
  target "llama-v2" { weight = 10 }
  target "llama-v3" {}
}

consul {
  address = "https://consul.internal:8501"
  token   = "3f1c-example"
  tls {
    server_name = "consul.internal"
    ca_file     = "/etc/consul/ca.pem"
    cert_file   = "/etc/consul/client.pem"
    key_file    = "/etc/consul/client-key.pem"
  }
}
