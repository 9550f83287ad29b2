"""`phalanx doctor`: one row per check of what a peer needs (addresses, ports, daemon, initial
peers, reachability, clock, swarm compatibility, task, target, device, disk, identity), each failed row
with its fix. `preflight` runs the checks that need no network before `phalanx join` starts."""

from phalanx.tools.doctor.rows import Row
from phalanx.tools.doctor.run import preflight, run_doctor

__all__ = ["Row", "preflight", "run_doctor"]
