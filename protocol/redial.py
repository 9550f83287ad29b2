"""Re-dialing: a peer keeps dialing the peers it lost, so a healed partition becomes one swarm again.

hivemind drops a peer that fails a call from its routing table and dials `--initial-peers` only
at start: after a partition each side forgot the other for good, and a restarted bootstrap knew
nobody. A `Redialer` remembers the initial peers and every peer it saw in the swarm's records;
while one of them is out of view it pings that peer's DHT node (after telling p2pd its last known
addresses), with jittered exponential backoff capped at a few seconds. An answered ping puts the
two nodes in each other's routing tables, and the run's DHT records (so the two views) merge.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import hivemind
from hivemind.dht import DHTNode
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from phalanx.protocol.dht_calls import in_dht

logger = logging.getLogger(__name__)

TICK_S = 0.5  # how often the schedule is checked
OUT_OF_VIEW_S = 7.0  # a peer unseen this long is lost (records are re-read every 2-3 s)
BASE_DELAY_S = 0.5  # first retry after a failed dial; doubles on each further failure ...
RECENT_CAP_S = 4.0  # ... up to this while the peer was lost recently,
LONG_LOST_S = 600.0  # ... and after this long lost,
LONG_CAP_S = 60.0  # ... up to this (a peer gone for good costs one dial a minute)
FORGET_S = 3600.0  # peers seen in records (not initial peers) are forgotten after this long lost
JITTER = 0.25  # each delay is scaled by a uniform factor in [1 - JITTER, 1 + JITTER]
DIAL_TIMEOUT_S = 5.0
MAX_KNOWN = 4096  # peers remembered (a bound against records from a huge or hostile swarm)
MAX_ADDRESSES = 8


@dataclass
class KnownPeer:
    """A peer this one has seen; `lost_at` is None while it is in view."""

    addresses: tuple[str, ...] = ()  # from its latest record
    pinned: tuple[str, ...] = ()  # its --initial-peers addresses, always dialed
    initial: bool = False
    seen_at: float = 0.0
    lost_at: Optional[float] = None
    failures: int = 0
    next_dial_at: float = 0.0


@dataclass
class RedialStats:
    dials: int = 0  # pings sent to lost peers
    answered: int = 0  # ... that got an answer
    lost: int = 0  # peers now out of view (and still being dialed)


def retry_delay_s(failures: int, lost_for_s: float, rng: random.Random) -> float:
    """Seconds until the next dial of a peer lost for `lost_for_s` whose last `failures` dials failed."""
    cap = RECENT_CAP_S if lost_for_s < LONG_LOST_S else LONG_CAP_S
    return min(cap, BASE_DELAY_S * 2.0**failures) * rng.uniform(1 - JITTER, 1 + JITTER)


def parse_initial_peer(maddr: str) -> tuple[str, str]:
    """(peer ID, address) of an `--initial-peers` entry (the address keeps its /p2p/ part)."""
    return Multiaddr(maddr).value_for_protocol("p2p"), maddr


@dataclass
class Redialer:
    """Tracks which known peers are in view and dials the lost ones. `start()` / `aclose()`.

    Feed it with `observe(present, gone)`: `present` maps the peers in view now to their addresses
    (empty if unknown: p2pd keeps the ones it connected to); `gone` names peers that left cleanly,
    which are not dialed again. `watch`, if given, is polled for the same each tick."""

    dht: Optional[hivemind.DHT]
    self_id: str
    initial_peers: Sequence[str] = ()
    watch: Optional[Callable[[], tuple[Mapping[str, Sequence[str]], Iterable[str]]]] = None
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    stats: RedialStats = field(default_factory=RedialStats)
    known: dict[str, KnownPeer] = field(default_factory=dict)
    _task: Optional[asyncio.Task] = None
    _dials: set[asyncio.Task] = field(default_factory=set)  # one per peer being dialed

    def __post_init__(self) -> None:
        now = self.clock()
        for maddr in self.initial_peers:
            peer, address = parse_initial_peer(maddr)
            if peer != self.self_id:
                entry = self.known.setdefault(peer, KnownPeer(initial=True, seen_at=now))
                entry.pinned = (*entry.pinned, address)[:MAX_ADDRESSES]

    # ---- what this peer sees ---------------------------------------------------------------

    def observe(self, present: Mapping[str, Sequence[str]], gone: Iterable[str] = ()) -> None:
        now = self.clock()
        for peer, addresses in present.items():
            if peer == self.self_id:
                continue
            entry = self.known.get(peer)
            if entry is None:
                if len(self.known) >= MAX_KNOWN:
                    continue
                entry = self.known[peer] = KnownPeer()
            if addresses:
                entry.addresses = tuple(a for a in addresses if isinstance(a, str))[:MAX_ADDRESSES]
            if entry.lost_at is not None:
                logger.info(f"peer {peer[-8:]} is back in view after {now - entry.lost_at:.1f} s")
            entry.seen_at, entry.lost_at, entry.failures, entry.next_dial_at = now, None, 0, 0.0
        for peer in gone:
            entry = self.known.get(peer)
            if entry is not None and not entry.initial:
                del self.known[peer]

    def due(self) -> list[tuple[str, tuple[str, ...]]]:
        """Lost peers whose next dial is due, with their addresses; marks newly lost peers and forgets
        peers lost too long."""
        now = self.clock()
        due = []
        for peer, entry in list(self.known.items()):
            if entry.lost_at is None and now - entry.seen_at > OUT_OF_VIEW_S:
                entry.lost_at, entry.next_dial_at = now, now
                logger.info(f"peer {peer[-8:]} is out of view: dialing it until it is back")
            if entry.lost_at is None:
                continue
            if not entry.initial and now - entry.lost_at > FORGET_S:
                del self.known[peer]
                continue
            if now >= entry.next_dial_at:
                due.append((peer, tuple(dict.fromkeys(entry.pinned + entry.addresses))))
        self.stats.lost = sum(e.lost_at is not None for e in self.known.values())
        return due

    def dialed(self, peer: str, answered: bool) -> None:
        """Schedule the next dial; an answer does not bring a peer back in view, its records do."""
        entry = self.known.get(peer)
        if entry is None or entry.lost_at is None:
            return
        now = self.clock()
        self.stats.dials += 1
        if answered:
            self.stats.answered += 1
            entry.failures = 0
        else:
            entry.failures += 1
        entry.next_dial_at = now + retry_delay_s(entry.failures, now - entry.lost_at, self.rng)

    def lost(self) -> list[str]:
        return sorted(p for p, e in self.known.items() if e.lost_at is not None)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="redial")

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._dials) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task, self._dials = None, set()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug(f"redial failed: {e!r}")

    async def tick(self) -> None:
        """Dial every peer whose dial is due, each in its own task: a dial into a partition waits out its
        timeout, and must not hold up the dial that would get through once the partition heals."""
        if self.watch is not None:
            present, gone = self.watch()
            self.observe(present, gone)
        if self.dht is None:
            return
        for peer, addresses in self.due():
            self.known[peer].next_dial_at = float("inf")  # in flight; `dialed` schedules the next one
            task = asyncio.create_task(self._dial(peer, addresses), name=f"redial-{peer[-8:]}")
            self._dials.add(task)
            task.add_done_callback(self._dials.discard)

    async def _dial(self, peer: str, addresses: tuple[str, ...]) -> None:
        answered = False
        try:
            answered = bool(await in_dht(self.dht, partial(_ping_all, targets=[(peer, addresses)]), DIAL_TIMEOUT_S + 5))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug(f"redial of {peer[-8:]} failed: {e!r}")
        self.dialed(peer, answered)
        if answered:  # "back in view" follows once its records arrive
            logger.debug(f"re-dialed lost peer {peer[-8:]}: it answered")


async def _ping_all(_dht: hivemind.DHT, node: DHTNode, targets: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """(Runs in the DHT process.) The peers among `targets` whose DHT node answered a ping; each
    answer puts the two nodes in each other's routing tables and lifts hivemind's own blacklisting."""

    async def ping(peer_id: str, addresses: tuple[str, ...]) -> Optional[str]:
        peer = PeerID.from_base58(peer_id)
        maddrs = [_without_peer_id(a, peer_id) for a in addresses]
        if maddrs:
            try:  # p2pd may have dropped the addresses of a peer it lost; a failure here is the ping's to report
                await asyncio.wait_for(node.p2p._client.connect(peer, maddrs), DIAL_TIMEOUT_S)
            except Exception as e:
                logger.debug(f"connect to {peer_id[-8:]} failed: {e!r}")
        if await node.protocol.call_ping(peer) is None:
            return None
        node.blacklist.register_success(peer)
        return peer_id

    results = await asyncio.gather(*(ping(p, a) for p, a in targets), return_exceptions=True)
    return [r for r in results if isinstance(r, str)]


def _without_peer_id(address: str, peer_id: str) -> Multiaddr:
    maddr = Multiaddr(address)
    suffix = Multiaddr(f"/p2p/{peer_id}")
    return maddr.decapsulate(suffix) if str(maddr).endswith(str(suffix)) else maddr
