pool "llama" {}

model "chat" {
  pool = "lama"
}

listener "public" {
  address = "localhost:8080"
}
