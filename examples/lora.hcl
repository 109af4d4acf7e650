# LoRA adapters served next to their base model.
#
#   switchyard validate -config examples/lora.hcl
#
# Start vLLM with --enable-lora --max-loras 2 --lora-modules sql-lora=/adapters/sql
# (and tax-lora on the third host). Clients name the adapter in "model"; the
# picker prefers a server that already has the adapter loaded, then one with
# a free adapter slot (from vllm:lora_requests_info), so adapters are not
# thrashed in and out of GPU memory.

listener "public" {
  address = "0.0.0.0:8080"
}

pool "llama" {
  engine = "vllm"

  # Which adapters each server can load. An endpoint without a models list
  # serves every model of the pool.
  endpoint "10.0.0.11:8000" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
  }
  endpoint "10.0.0.12:8000" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
  }
  endpoint "10.0.0.13:8000" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora", "tax-lora"]
  }
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

model "sql-lora" {
  pool = "llama"
}

# Batch jobs on the tax adapter may be shed with 429 when the pool is
# saturated, so interactive traffic keeps its latency.
model "tax-lora" {
  pool     = "llama"
  priority = -1
}

# A stable client-facing name that canaries a new adapter version.
model "sql" {
  pool = "llama"
  target "sql-lora" {
    weight = 95
  }
  target "tax-lora" {
    weight = 5
  }
}
