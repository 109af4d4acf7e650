replicas {
  peers = ["10.0.0.5:9002", "localhost:9002", "10.0.0.5:9002"]
}

replicas {
  consul_service = "switchyard"
}
