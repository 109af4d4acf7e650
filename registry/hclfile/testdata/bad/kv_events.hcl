pool "llama" {
  endpoints = ["127.0.0.1:8001"]
  kv_events {
    port        = 70000
    replay_port = 70000
  }
  kv_events { port = 5557 }
  endpoint "127.0.0.1:8002" {
    kv_events { replay_port = 5558 }
  }
  endpoint "127.0.0.1:8003" {
    kv_events {
      port        = 5557
      replay_port = 5557
    }
  }
}
pool "trt" {
  engine = "trtllm-serve"
  kv_events { port = 5557 }
}
