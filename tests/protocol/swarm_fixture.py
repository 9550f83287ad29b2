"""Real peers on loopback inside one test process: a bootstrap DHT and N round engines."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional

import hivemind

from phalanx.peer.dht_keys import install, run_keys
from phalanx.protocol.bans import BanBook
from phalanx.protocol.btard.behavior import Behavior
from phalanx.protocol.config import RoundConfig
from phalanx.protocol.engine import RoundEngine
from phalanx.protocol.membership import Membership
from phalanx.protocol.sync_policy import SyncPolicy
from phalanx.protocol.transport import Transport
from phalanx.security.identity import Identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN_HASH = hashlib.sha256(b"test-run").digest()
RUN_ID = "test"
KEY = "phalanx.test"


@dataclass
class TestPeer:
    dht: hivemind.DHT
    transport: Transport
    membership: Membership
    engine: RoundEngine
    scratch: tempfile.TemporaryDirectory

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id


async def open_peer(
    initial_peers: list[str],
    config: RoundConfig,
    *,
    direct: bool = True,
    behavior: Optional[Behavior] = None,
    sync_policy: Optional[SyncPolicy] = None,
    reachable: bool = True,
) -> TestPeer:
    """`reachable=False`: a peer nobody can dial (behind a home router), as the others learn from its record
    and joins; on loopback it still could be, so tests check that nobody does."""
    loop = asyncio.get_running_loop()
    scratch = tempfile.TemporaryDirectory(prefix="phalanx-test-peer-")
    identity = Identity.generate_ed25519(Path(scratch.name) / "identity.key")
    dht = await loop.run_in_executor(
        None,
        lambda: hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=LOOPBACK,
            identity_path=str(Path(scratch.name) / "identity.key"),
            check_if_identity_free=False,
            start=True,
        ),
    )
    keys = run_keys(RUN_ID, KEY)
    await install(dht, keys)
    p2p = await dht.replicate_p2p()
    banned: set[str] = set()  # one set, as the node hands it
    direct_host = "127.0.0.1" if direct and reachable else None
    transport = await Transport.open(p2p, namespace=KEY, direct_host=direct_host, banned=banned)
    membership = Membership(
        dht, keys["peers"].name, transport.peer_id, identity=identity, refresh_s=1.0, ttl_s=6.0, reachable=reachable,
        banned=banned,
    )  # fmt: skip
    bans = BanBook(dht, keys["bans"].name, banned)
    engine = RoundEngine(
        transport, membership, config, RUN_HASH, identity=identity, bans=bans, behavior=behavior, sync_policy=sync_policy
    )
    await membership.start()
    return TestPeer(dht, transport, membership, engine, scratch)


async def close_peer(peer: TestPeer) -> None:
    await peer.engine.aclose()
    await peer.membership.aclose(announce_leaving=False)
    await peer.transport.aclose()
    await asyncio.get_running_loop().run_in_executor(None, peer.dht.shutdown)
    peer.scratch.cleanup()


@contextlib.asynccontextmanager
async def open_swarm(
    n: int,
    config: RoundConfig,
    *,
    behaviors: Optional[list[Optional[Behavior]]] = None,
    reachable: Optional[list[bool]] = None,
    **kwargs,
) -> AsyncIterator[list[TestPeer]]:
    loop = asyncio.get_running_loop()
    bootstrap = await loop.run_in_executor(None, lambda: hivemind.DHT(host_maddrs=LOOPBACK, start=True))
    initial = [str(m) for m in bootstrap.get_visible_maddrs()]
    peers: list[TestPeer] = []
    try:
        for i in range(n):
            behavior = behaviors[i] if behaviors is not None else None
            extra = dict(kwargs)
            if "sync_policy" in extra:  # one policy object per peer: policies keep state
                extra["sync_policy"] = extra["sync_policy"]()
            peers.append(await open_peer(initial, config, behavior=behavior, reachable=reachable[i] if reachable else True, **extra))
        for peer in peers:  # everyone sees everyone before the first round
            while len(peer.membership.peers()) < n:
                await peer.membership.refresh()
        yield peers
    finally:
        for peer in peers:
            await close_peer(peer)
        await loop.run_in_executor(None, bootstrap.shutdown)
