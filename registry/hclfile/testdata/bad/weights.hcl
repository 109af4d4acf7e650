pool "llama" {}

model "a" {
  pool = "llama"
  target "x" { weight = -5 }
  target "y" { weight = 5 }
}

model "b" {
  pool = "llama"
  target "x" { weight = 0 }
  target "y" { weight = 0 }
}

model "c" {
  pool = "llama"
  target "c" { weight = 1 }
  target "x" { weight = 1 }
  target "x" { weight = 2 }
}
