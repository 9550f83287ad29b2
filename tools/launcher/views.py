"""What `phalanx swarm` knows of its trainers and of the run: the launcher fills these in from the
trainers' events, and the report (report.py) reads them, so neither imports the other."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from phalanx.tasks.metric import ACCURACY, Metric


@dataclass
class PeerView:
    """What the launcher knows of one trainer, from its JSON events."""

    name: str
    process: Optional[asyncio.subprocess.Process] = None
    peer_id: str = ""
    step: int = 0
    loss: Optional[float] = None  # its last minibatch loss
    metric_value: Optional[float] = None  # its last evaluation's value of the task's metric
    group: int = 0
    bytes_sent: int = 0
    report: Optional[dict[str, Any]] = None
    exit_code: Optional[int] = None
    attack: Optional[str] = None
    extra_args: list[str] = field(default_factory=list)  # this peer's own flags (e.g. a straggler's --slowdown)
    events: list[dict[str, Any]] = field(default_factory=list)
    log_path: Optional[Path] = None
    last_error: Optional[str] = None  # its log's last error line, read when it exited
    stop_sent: bool = False  # the launcher asked it to stop (SIGTERM)
    # start-up, in seconds since the launcher started: on the DHT ("started" event), sees the peers
    # it waits for ("training" event), first step done
    connected_s: Optional[float] = None
    ready_s: Optional[float] = None
    first_step_s: Optional[float] = None


@dataclass
class SwarmResult:
    reached_target: bool
    wall_s: float
    time_to_target_s: Optional[float]
    peers: list[PeerView]
    best: Optional[float]  # the best honest trainer's last value of the metric
    metric: Metric = ACCURACY  # what the task is judged by
    target: Optional[float] = None  # in the metric; None: the run was its --steps
    succeeded: bool = False  # the target was reached; without one, no honest trainer failed
    reasons: dict[str, str] = field(default_factory=dict)  # peer name -> why it exited
    startup: dict[str, Optional[float]] = field(default_factory=dict)  # stage -> seconds since start (every trainer)
    kept_workdir: Optional[Path] = None  # a failed run's own work folder, not removed

    @property
    def first_step_s(self) -> Optional[float]:
        return self.startup.get("first step")
