consul {
  address    = "consul.internal"
  token      = "secret"
  token_file = "/etc/consul.token"
  tls {
    cert_file = "/etc/client.pem"
  }
}
consul {}
pool "p" {}
