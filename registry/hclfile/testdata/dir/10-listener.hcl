listener "public" {
  address = "127.0.0.1:8080"
}

routing {
  default_pool = "llama"
}
