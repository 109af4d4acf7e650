pool "a" {
  scheduling {
    scrape_interval = "fast"
  }
}

pool "b" {
  scheduling {
    scrape_interval = "100us"
  }
}

pool "c" {
  scheduling {
    idle_scrape_interval = "rarely"
  }
}
