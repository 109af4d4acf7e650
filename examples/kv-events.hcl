# A vLLM pool whose servers publish their KV-cache events: the picker
# subscribes to each server and routes by what its prefix cache holds,
# exactly. Each server runs
#
#   vllm serve ... --enable-prefix-caching --kv-events-config \
#     '{"enable_kv_cache_events": true, "publisher": "zmq",
#       "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
#
#   switchyard validate -config examples/kv-events.hcl

listener "public" {
  address = "0.0.0.0:8080"
}

pool "llama" {
  endpoints = ["10.0.0.11:8000", "10.0.0.12:8000"]

  kv_events {
    port        = 5557 # "endpoint": "tcp://*:5557"
    replay_port = 5558 # "replay_endpoint": "tcp://*:5558"
  }

  # A server with other ports (a second vLLM on the same host).
  endpoint "10.0.0.12:8001" {
    kv_events {
      port        = 5567
      replay_port = 5568
    }
  }
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}
