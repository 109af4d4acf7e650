# Demo: three vllm-sim processes on 127.0.0.1:8001..8003 serve
# meta-llama/Llama-3.1-8B-Instruct (also answering as "llama-v2"); the third
# also has the LoRA adapter "sql-lora" loaded, so only it may serve that model.

pool "llama" {
  engine = "vllm"

  # Every endpoint lists what it serves. Without lists the picker would
  # learn it from each server's /v1/models, but only after the server's
  # first answer; lists make routing certain from the first request.
  endpoint "127.0.0.1:8001" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "llama-v2"]
  }
  endpoint "127.0.0.1:8002" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "llama-v2"]
  }
  endpoint "127.0.0.1:8003" {
    models = ["meta-llama/Llama-3.1-8B-Instruct", "llama-v2", "sql-lora"]
  }

  scheduling {
    profile         = "default"
    scrape_interval = "50ms"
  }
}

model "meta-llama/Llama-3.1-8B-Instruct" {
  pool = "llama"
}

# A LoRA adapter loaded on 127.0.0.1:8003 only.
model "sql-lora" {
  pool = "llama"
}

# "llama-v2" is a candidate model name the simulators also answer to.
model "llama-v2" {
  pool = "llama"
}

# Clients ask for "chat": 90% go to the base model, 10% to "llama-v2".
model "chat" {
  pool = "llama"

  target "meta-llama/Llama-3.1-8B-Instruct" {
    weight = 90
  }
  target "llama-v2" {
    weight = 10
  }
}
