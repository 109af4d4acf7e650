pool "llama" {
  scheduling {
    kv_threshold    = 1.5
    queue_threshold = -1
    scorers         = { queue = -1, prefix = 2, fastest = 1 }
    metrics         = { queue_len = "x" }
  }
  scheduling {}
}
