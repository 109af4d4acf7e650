pool "llama" {}
pool "llama" {}
model "m" { pool = "llama" }
model "m" { pool = "llama" }
listener "l" { address = "127.0.0.1:1" }
listener "l" { address = "127.0.0.1:2" }
