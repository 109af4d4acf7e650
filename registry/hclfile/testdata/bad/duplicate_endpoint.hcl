pool "llama" {
  endpoints = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:08001"]

  endpoint "127.0.0.1:8002" {
    draining = true
  }
}
