pool "llama" {}

model "chat" {
  pool = "lama"
}
