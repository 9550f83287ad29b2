"""Peer health: signed records in the DHT, local legality checks, the HTTP server
(/healthz, /readyz, /metrics, /api/v1/status) and `phalanx health`."""

from peer.health.metrics import PeerMetrics
from peer.health.service import HealthService, open_health, open_node_health

__all__ = ["HealthService", "PeerMetrics", "open_health", "open_node_health"]
