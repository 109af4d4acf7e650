# Every block here collides with one in a.hcl.
listener "public" {
  address = "127.0.0.1:8081"
}

  pool "llama" {
    endpoints = ["127.0.0.1:8002"]
  }

model "chat" {
  pool = "llama"
}

routing {
  default_pool = "llama"
}
