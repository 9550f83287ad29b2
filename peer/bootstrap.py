"""`phalanx bootstrap`: a DHT-only peer that others use as their entry point. It publishes a
health record with role "bootstrap" and, with --http-port, serves /healthz and /readyz too."""

from __future__ import annotations

import asyncio
import logging
import signal

from phalanx.peer.config import NetworkSettings
from phalanx.peer.health import PeerMetrics, open_health
from phalanx.peer.node import (
    daemon_socket_file, remove_if_stale, replicate_p2p, serve_relay, serve_until, start_dht_as, visible_maddrs,
)  # fmt: skip
from phalanx.protocol.dial_back import DialBackService
from phalanx.protocol.redial import Redialer

logger = logging.getLogger(__name__)


def initial_peers_line(maddrs: list[str]) -> str:
    """The exact flag other peers paste; loopback-only addresses last (they work on this machine only)."""
    ordered = sorted(maddrs, key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))
    return "--initial-peers " + ",".join(ordered)


def run_bootstrap(settings: NetworkSettings, *, print_fn=print) -> None:
    """Serve the DHT until SIGINT/SIGTERM."""
    import uvloop

    uvloop.run(_serve(settings, print_fn))


async def _serve(settings: NetworkSettings, print_fn) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # the identity signs its health record
    dht, identity = await loop.run_in_executor(None, start_dht_as, settings, "phalanx-bootstrap-")
    daemon_socket = p2p = relay = None
    try:
        daemon_socket = await daemon_socket_file(dht)
        p2p = await replicate_p2p(dht)
        await DialBackService.open(p2p)  # newcomers' `phalanx doctor` asks it to dial their data port
        relay = await serve_relay(p2p, settings)  # for the peers nobody can dial
        maddrs = await visible_maddrs(dht)
        logger.info(f"bootstrap peer {dht.peer_id} is up")
        print_fn("Other peers join this swarm with:")
        print_fn(initial_peers_line(maddrs), flush=True)
        # re-learns the trainers it saw (their health records name their addresses) after a partition
        redialer = Redialer(dht, identity.peer_id, settings.initial_peers)
        await redialer.start()
        try:
            health = await open_health(
                dht=dht, identity=identity, metrics=PeerMetrics(role="bootstrap"), settings=settings,
                redialer=redialer, served_relay=relay,
            )  # fmt: skip
            try:
                await serve_until(stop, dht)
            finally:
                await health.aclose()
        finally:
            await redialer.aclose()
    finally:
        if relay is not None:
            await relay.aclose()
        if p2p is not None:
            await p2p.shutdown()  # our replica's connection to p2pd and its socket file
        await loop.run_in_executor(None, dht.shutdown)
        if daemon_socket is not None:
            remove_if_stale(daemon_socket)
