"""Phalanx: train one model on many volunteers' GPUs.

Installed, every part lives under this name: `phalanx.peer` (the training process: a node, training
modes, `phalanx join`), `phalanx.protocol` (rounds, matchmaking, transport), `phalanx.aggregation`
(robust aggregators, staleness corrections), `phalanx.security` (identities, commitments),
`phalanx.tasks` (models and data), `phalanx.sim` (the simulator), `phalanx.tools` (what runs beside
peers: the launcher, doctor, health, monitor, bench), `phalanx.errors` (the exception tree) and
`phalanx.cli` (the command line); `phalanx.Optimizer` wraps your own optimizer and loop
(peer/optimizer.py). Nothing heavy is imported here.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("phalanx")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Interrupted", "Optimizer", "__version__"]


def __getattr__(name: str):
    """`phalanx.Optimizer` (and `phalanx.Interrupted`, what its interrupted `step()` raises) import torch
    and hivemind only when asked for."""
    if name in ("Optimizer", "Interrupted"):
        from phalanx.peer import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
