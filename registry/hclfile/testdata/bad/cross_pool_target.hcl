pool "a" {}
pool "b" {}

model "big" {
  pool = "a"
}

model "chat" {
  pool = "b"
  target "big" { weight = 1 }
}
