"""Peer health, as the training process serves it: signed records in the DHT, local legality checks
and the HTTP server (/healthz, /readyz, /metrics, /api/v1/status). `phalanx health` and `phalanx
monitor`, which read it from beside the peers, are tools (phalanx.tools).

The names below load on first use, so that importing one module of the package (the record, say)
does not load the service's hivemind, aiohttp and prometheus-client.
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
