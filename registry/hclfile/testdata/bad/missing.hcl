listener "l" {}

model "m" {
  priority = 1
}
