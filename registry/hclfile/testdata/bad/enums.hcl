pool "llama" {
  engine       = "tgi"
  failure_mode = "open"
  metrics_path = "metrics"

  scheduling {
    profile = "fastest"
    picker  = "best"
  }
}
