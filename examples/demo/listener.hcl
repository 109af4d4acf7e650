# Demo: Envoy listens on 127.0.0.1:8080. Models not declared here get a 404
# from the picker (set routing { default_pool = "llama" } to send them to a
# pool instead).

listener "demo" {
  address = "127.0.0.1:8080"
}
