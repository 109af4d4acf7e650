pool "llama" {}

routing {
  default_pool = "lama"
}
