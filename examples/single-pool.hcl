# One vLLM pool with two replicas serving one model.
#
#   switchyard validate -config examples/single-pool.hcl

listener "public" {
  address = "0.0.0.0:8080"
}

pool "llama" {
  endpoints = ["10.0.0.11:8000", "10.0.0.12:8000"]
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}
