listener "public" {
  address = "127.0.0.1:8080"
}

pool "llama" {
  endpoints = ["127.0.0.1:8001"]
}

model "chat" {
  pool = "llama"
}

routing {
  default_pool = "llama"
}
