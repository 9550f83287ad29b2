"""`phalanx monitor`: a swarm dashboard. It reads every peer's signed health record from the DHT,
keeps a bounded history, and serves a page (peer table + plots), a JSON API and an aggregated
Prometheus `/metrics`."""
