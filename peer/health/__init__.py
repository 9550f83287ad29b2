"""Peer health: signed records in the DHT, local legality checks, the HTTP server
(/healthz, /readyz, /metrics, /api/v1/status) and `phalanx health`.

The names below load on first use: the CLI imports `phalanx.peer.health.options` to build its flags,
and must not pay for hivemind, aiohttp and prometheus-client before it prints anything.
"""

from importlib import import_module

_EXPORTS = {
    "PeerMetrics": "phalanx.peer.health.metrics",
    "HealthService": "phalanx.peer.health.service",
    "open_health": "phalanx.peer.health.service",
    "open_node_health": "phalanx.peer.health.service",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
