"""Settings of `phalanx monitor` (light: the CLI imports it to build the flags)."""

from __future__ import annotations

from pydantic import Field

from phalanx.peer.config import NetworkSettings


class MonitorSettings(NetworkSettings):
    """Everything `phalanx monitor` needs."""

    http_port: int = Field(8000, ge=1, le=65535, description="Serve the dashboard on this TCP port.")
    poll_s: float = Field(2.0, ge=0.2, le=60, description="Read every peer's health record this often (seconds).")
    history_points: int = Field(
        1800, ge=10, le=100_000, description="Polls kept for the plots (1800 × 2 s = one hour)."
    )
