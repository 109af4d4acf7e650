# A disaggregated pool for examples/pd/docker-compose.yaml: two prefill
# servers and two decode servers, each decode server behind its pd-sidecar.

listener "public" {
  address = "0.0.0.0:8080"
}

pool "llama-70b" {
  # Prefill servers: vLLM with a KV connector, reached directly.
  endpoint "10.232.0.21:8000" { role = "prefill" }
  endpoint "10.232.0.22:8000" { role = "prefill" }
  # Decode servers: the address is the pd-sidecar's (in the decode
  # container's network namespace); the vLLM behind it listens on that
  # namespace's 127.0.0.1:8200 only.
  endpoint "10.232.0.31:8000" { role = "decode" }
  endpoint "10.232.0.32:8000" { role = "decode" }

  disaggregation {
    uncached_tokens   = 512 # split when >= 512 prompt tokens are not cached on the decode server
    min_prompt_tokens = 1024
  }
}

model "meta-llama/Llama-3.1-70B-Instruct" {
  pool = "llama-70b"
}
