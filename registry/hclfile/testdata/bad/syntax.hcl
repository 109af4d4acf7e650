pool "llama" {
  endpoints = ["127.0.0.1:8001"
}
