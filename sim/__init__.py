"""`phalanx sim`: a discrete-event simulator of N workers training a real task on a virtual clock.

It runs the same rules as the live swarm (aggregation/ for aggregators, staleness
corrections and attacks; protocol/sync_policy.py for K schedules; tasks for models,
minibatches and gradients). Map: config (SimConfig) · clock (delay models) · gradients
(batched real gradients) · workers (jobs in flight) · methods (METHODS) · rules (server
update rules) · server (parameter-server event loop) · decentral (LASGD, gossip) ·
byzantine · record (curves, SimResult) · runner (run_sim) · grid / presets / plots /
report · cli.

Nothing is imported here, so `phalanx --help` does not load torch: use
`from phalanx.sim.runner import run_sim` and `from phalanx.sim.config import SimConfig`.
"""
