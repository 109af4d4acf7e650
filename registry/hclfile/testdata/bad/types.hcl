pool "llama" {
  endpoints = "127.0.0.1:8001"

  endpoint "127.0.0.1:8002" {
    draining = "maybe"
  }

  scheduling {
    queue_threshold = 2.5
    kv_threshold    = "high"
  }
}

model "m" {
  pool     = "llama"
  priority = "high"
}
