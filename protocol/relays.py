"""Relayed peers: trainers nobody can dial, reached through a libp2p circuit relay.

A peer behind a home router holds a slot on relays (its initial peers, see `peer.node.relay_flags`)
and publishes in its membership record a circuit through each relay it is still connected to. Every
peer keeps p2pd connected to the relayed peers in its view through those circuits, so their calls
(joins, parts, aggregates, a verified round's phase messages) travel over the relay like any other;
libp2p's hole punching replaces a relayed connection with a direct one where both routers allow it.
libp2p advertises circuit addresses by itself only through relays with public addresses: the records
make them work through any relay the peers can reach.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Optional

from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from phalanx.protocol.membership import MAX_RELAYS, Membership
from phalanx.protocol.transport import Transport

logger = logging.getLogger(__name__)

TICK_S = 1.0
CONNECT_TIMEOUT_S = 5.0


def relay_peer(maddr: str) -> str:
    """The peer ID a relay's multiaddr ends with."""
    return maddr.rsplit("/p2p/", 1)[1]


@dataclass
class RelayStats:
    circuits: int = 0  # circuits this peer publishes now (relays it holds a slot on and is connected to)
    relayed_peers: int = 0  # peers in view reached through a relay
    punched: int = 0  # of those, peers connected directly now: libp2p punched a hole between us
    dials: int = 0  # connections opened to relayed peers
    failed_dials: int = 0


@dataclass
class RelayKeeper:
    """Publishes this peer's circuits (when it has relays) and keeps connections to relayed peers.
    Open with `start()` (after one `tick()`, so the first record already names the circuits), close
    with `aclose()`."""

    transport: Transport  # its p2pd connects; its calls retry through the circuits it is given
    membership: Membership
    relays: list[str] = field(default_factory=list)  # the relays this peer reserved a slot on
    stats: RelayStats = field(default_factory=RelayStats)
    _task: Optional[asyncio.Task] = None

    async def tick(self) -> None:
        connected = {info.peer_id.to_base58(): [str(a) for a in info.addrs] for info in await self.transport.p2p.list_peers()}
        me = self.membership.peer_id
        if self.relays:
            alive = [r for r in self.relays if relay_peer(r) in connected][:MAX_RELAYS]
            circuits = [f"{r}/p2p-circuit/p2p/{me}" for r in alive]
            if bool(circuits) != bool(self.membership.relays):
                if circuits:
                    logger.info(f"reachable through {len(circuits)} relay(s): {', '.join(relay_peer(r)[-8:] for r in alive)}")
                else:
                    logger.warning("no relay left: nobody can reach this peer until one is back")
            self.membership.relays = circuits
            self.stats.circuits = len(circuits)
        relayed = {
            peer: record.circuits(peer)
            for peer, record in self.membership.peers().items()
            if peer != me and not record.reachable and record.circuits(peer)
        }  # fmt: skip
        self.stats.relayed_peers = len(relayed)
        direct = [p for p in relayed if any("p2p-circuit" not in a for a in connected.get(p, ()))]
        self.stats.punched = len(direct) if self.relays else 0
        self.transport.circuits = relayed
        # every peer dials every relayed one ahead of its calls: p2pd knows a relayed peer's circuits only
        # from these dials, and a call to a peer it cannot route to hangs until the call's timeout
        dials = [self._dial(peer, circuits) for peer, circuits in relayed.items() if peer not in connected]
        await asyncio.gather(*dials)

    async def _dial(self, peer: str, circuits: list[str]) -> None:
        self.stats.dials += 1
        try:
            await asyncio.wait_for(
                self.transport.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(c) for c in circuits]), CONNECT_TIMEOUT_S
            )
        except Exception as e:  # its relay is gone, or it is: the next tick tries again
            self.stats.failed_dials += 1
            logger.debug(f"no relayed connection to {peer[-8:]}: {e!r}")

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="relays")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug(f"relay upkeep failed: {e!r}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
