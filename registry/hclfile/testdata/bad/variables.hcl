pool "llama" {
  engine = var.engine
}
