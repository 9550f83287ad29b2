"""`phalanx bootstrap`: a DHT-only peer that others use as their entry point."""

from __future__ import annotations

import logging
import signal
import threading

from peer.config import NetworkSettings
from peer.node import start_dht, visible_maddrs

logger = logging.getLogger(__name__)


def initial_peers_line(maddrs: list[str]) -> str:
    """The exact flag other peers paste; loopback-only addresses last (they work on this machine only)."""
    ordered = sorted(maddrs, key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))
    return "--initial-peers " + ",".join(ordered)


def run_bootstrap(settings: NetworkSettings, *, print_fn=print) -> None:
    """Serve the DHT until SIGINT/SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(settings)
    try:
        maddrs = visible_maddrs(dht)
        logger.info(f"bootstrap peer {dht.peer_id} is up")
        print_fn("Other peers join this swarm with:")
        print_fn(initial_peers_line(maddrs), flush=True)
        stop.wait()
    finally:
        dht.shutdown()
