"""A lab of separate network hosts on one machine (root): hosts, home routers and faults (`hosts`), added
latency (`delay_proxy`), and a swarm of `phalanx` processes on them (`swarm`). The fault tests and
`phalanx bench wan` run on it."""
