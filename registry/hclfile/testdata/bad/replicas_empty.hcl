replicas {}
