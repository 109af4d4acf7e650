pool "llama" {
  endpoint = ["127.0.0.1:8001"]
  weight   = 3
  healthcheck {}
}

server "x" {}
