listener "a" { address = "localhost:8080" }
listener "b" { address = "127.0.0.1" }
pool "llama" {
  endpoints = [
    "vllm-1:8000",
    "127.0.0.1:70000",
    "127.0.0.1:0",
    "0.0.0.0:8000",
    "::1:8000",
  ]
}
