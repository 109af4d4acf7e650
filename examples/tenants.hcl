# Tenants: API keys, model access, limits and usage accounting.
# Create each key with `switchyard key new` and paste only its hash here;
# the hashes below are of example keys and grant nothing in a real setup.

listener "public" {
  address = "127.0.0.1:8080"
}

pool "llama" {
  endpoints = ["127.0.0.1:8001", "127.0.0.1:8002"]
  # Every request needs a tenant's key, even while the picker is down.
  failure_mode = "fail_closed"
  # When the servers run vLLM with --api-key, the picker sends them that
  # key instead of the client's (which never leaves the gateway):
  # upstream_api_key_env = "VLLM_API_KEY"   # or upstream_api_key_file
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

model "batch" {
  pool     = "llama"
  priority = -1
  target "meta-llama/Llama-3.1-8B-Instruct" { weight = 1 }
}

tenants {
  hide_forbidden_models = false   # 403 for a model a tenant may not use
}

tenant "search-team" {
  api_keys = ["sha256:3c4b6e2cf3a4b2a8f7c9e1d0a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4"]
  models   = ["meta-llama/Llama-3.1-8B-Instruct"]
  priority = 10
  limits {
    requests_per_minute = 600
    tokens_per_minute   = 200000
    tokens_per_day      = 20000000
  }
}

tenant "nightly-batch" {
  api_keys = ["sha256:5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c"]
  models   = ["batch"]
  limits {
    tokens_per_day = 50000000
    count_cached   = false        # cached prompt tokens are free
  }
}
