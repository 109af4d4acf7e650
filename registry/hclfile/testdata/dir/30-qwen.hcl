pool "qwen" {
  endpoints = ["127.0.0.1:9001"]
}

# A model in this file may name a pool from another file.
model "qwen-chat" {
  pool = "qwen"
}
model "llama-batch" {
  pool     = "llama"
  priority = -1
}
