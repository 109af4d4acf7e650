pool "a" {
  consul {
    service         = "vllm"
    panic_threshold = 1.5
  }
}

pool "b" {
  consul {
    service     = "vllm"
    panic_grace = "soon"
  }
}
