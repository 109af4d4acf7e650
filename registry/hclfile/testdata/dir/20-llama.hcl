pool "llama" {
  endpoints = ["127.0.0.1:8001", "127.0.0.1:8002"]
}

model "chat" {
  pool = "llama"
}
