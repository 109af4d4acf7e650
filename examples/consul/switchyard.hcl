# Pools whose members register themselves in Consul (see README.md here for
# the service-meta convention and vllm-llama.json for a host's definition).
#
#   CONSUL_HTTP_ADDR=127.0.0.1:8500 switchyard serve -config examples/consul/switchyard.hcl -store /var/lib/switchyard/switchyard.db

# The agent comes from CONSUL_HTTP_ADDR and friends, or from a block like
# this one (it wins over the environment):
#
#   consul {
#     address    = "https://consul.internal:8501"
#     token_file = "/etc/switchyard/consul.token"
#     tls { ca_file = "/etc/consul/ca.pem" }
#   }
#
# With several pools, give each its own service name (vllm-llama,
# vllm-qwen, ...) rather than tags on one service: Consul's blocking
# queries are per service, so a shared one wakes every pool's watcher.

listener "public" {
  address = "0.0.0.0:8080"
}

pool "llama" {
  engine = "vllm"

  consul {
    service      = "vllm"
    tag          = "llama-8b"
    passing_only = true
  }

  # Static endpoints may sit next to Consul members, e.g. a host outside
  # Consul's reach.
  endpoints = ["10.0.0.50:8000"]
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

model "sql-lora" {
  pool = "llama"
}
