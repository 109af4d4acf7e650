pool "llama" {
  admission {
    max_queued       = -3
    ttl              = "forever"
    no_endpoint_wait = "10m"
    fairness         = "lottery"
    priority_min     = 5
    priority_max     = 1
    flow_header      = "x tenant"
  }
  admission {}
}
