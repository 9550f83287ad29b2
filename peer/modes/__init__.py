"""The training modes. This registry (name → the few facts the rest of the peer asks about a mode) loads
no torch: config checks and `--help` read it. Each mode's behaviour inside `phalanx.Optimizer` is a class
of its own beside it (peer/modes/sync.py, local.py, diloco.py; what they share in base.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from phalanx.errors import ConfigError


@dataclass(frozen=True)
class ModeInfo:
    summary: str  # one clause for --mode's help
    lockstep: bool  # every step waits for its round's aggregate (verified rounds need it); else steps never wait
    group_size: Optional[int] = None  # the one group size it works with (gossip: pairs), else --target-group-size


MODES: dict[str, ModeInfo] = {
    "sync": ModeInfo("gradients all-reduced every step", lockstep=True),
    "lasgd": ModeInfo(
        "local steps never wait, models averaged every --sync-every steps with whoever is ready",
        lockstep=False,
    ),
    "gossip": ModeInfo(
        "the same with one random peer at a time", lockstep=False, group_size=2
    ),
    "diloco": ModeInfo(
        "--inner-steps local steps, then an outer Nesterov step on the averaged pseudo-gradient",
        lockstep=True,
    ),
}


def modes_help() -> str:
    """`sync: ...; lasgd: ...`: the registry as --mode's description."""
    return "; ".join(f"{name}: {info.summary}" for name, info in MODES.items()) + "."


def mode_info(name: str) -> ModeInfo:
    """The registry's entry for `--mode name`; a config error listing the valid names otherwise."""
    if name not in MODES:
        raise ConfigError(f"--mode: unknown mode {name!r}; valid: {', '.join(MODES)}")
    return MODES[name]
