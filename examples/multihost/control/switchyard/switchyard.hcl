# switchyard configuration of the multi-host example: every control host
# that runs a replica mounts this directory at /etc/switchyard (every *.hcl
# file in it is merged). Keep it the same on every replica.
#
#   switchyard validate -config examples/multihost/control/switchyard

# Envoy's public listener on every gateway host.
listener "public" {
  address = "0.0.0.0:8080"
}

# Each replica registers itself with its Consul agent as service
# "switchyard" (its -replica-id, its picker, xDS and admin addresses and a
# check on its /readyz); the passing ones make up the picker cluster every
# replica pushes to the Envoys.
replicas {
  consul_service = "switchyard"
}

# The model hosts register their vLLM as Consul service "vllm" with tag
# "llama-8b" (examples/multihost/model/consul/vllm.json), at their node's
# address. An instance whose own check fails leaves the pool within about
# a second; one whose Consul agent is unreachable (the node's serfHealth
# check is critical) while its own check last passed stays, as long as
# switchyard's own scrapes of it succeed (docs/deployment.md).
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
