# Demo: Envoy listens on 127.0.0.1:8080; unknown models go to "llama".

listener "demo" {
  address = "127.0.0.1:8080"
}

routing {
  default_pool = "llama"
}
