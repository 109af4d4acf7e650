# switchyard configuration for the docker-compose stack (docker-compose.yaml
# mounts this directory at /etc/switchyard; every *.hcl file in it is merged).
#
# The pool has no static endpoints: its members are the vLLM hosts that
# register in Consul (examples/compose/consul/*.json) as service "vllm" with
# tag "llama-8b" and pass their /health check. Each registration's meta says
# which models and LoRA adapters the host serves ("models"), its engine and
# its metrics path. switchyard reaches Consul through CONSUL_HTTP_ADDR.
#
#   switchyard validate -config examples/compose/switchyard

# Envoy's public listener; docker-compose.yaml publishes this port.
listener "public" {
  address = "0.0.0.0:8080"
}

# Both replicas (switchyard-1 and switchyard-2 in docker-compose.yaml) read
# this directory. Each registers itself in Consul as service "switchyard",
# with its -replica-id as the service ID, its -extproc-advertise address,
# and a check on its /readyz at -admin-advertise; the passing instances are
# the replicas every replica lists in Envoy's picker cluster. A replica
# added or stopped joins or leaves those lists without a restart.
replicas {
  consul_service = "switchyard"
}

pool "llama" {
  engine = "vllm"

  consul {
    service      = "vllm"
    tag          = "llama-8b"
    passing_only = true
  }
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

# A LoRA adapter; only vllm-sim-3 loads it, so only that host is picked.
model "sql-lora" {
  pool = "llama"
}
