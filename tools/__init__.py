"""Tools that run beside peers, never inside a training process: the local swarm launcher
(`phalanx swarm`), `phalanx doctor`, `phalanx health`, `phalanx monitor` and `phalanx bench`.
They may import the peer; the peer never imports them."""
