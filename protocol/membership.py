"""Who is in the swarm: each trainer announces itself in the DHT; everyone keeps a view.

Records live under one DHT key per run (subkey = peer ID) and expire unless refreshed,
so a crashed peer disappears from every view within `ttl_s` (longer only while this peer's refreshes
take longer: a record outlives CYCLES_PER_TTL of them, see `Membership.record_ttl_s`). Each is signed by the peer it
names, for this key and its expiration (security.records), so nobody else can add, change or
evict a peer. The view feeds leader choice and the set of peers a group waits for. Banned
peers are never in the view.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal, Optional

from hivemind import DHT
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr
from pydantic import AfterValidator, Field

from phalanx.protocol.dht_calls import dht_get, dht_store
from phalanx.protocol.dht_records import SignedRecordValidator, read_signed
from phalanx.protocol.link_quality import LinkQuality
from phalanx.security.identity import Identity
from phalanx.security.records import sign_record
from phalanx.security.wire import PeerIdStr, WireModel

logger = logging.getLogger(__name__)

PeerState = Literal["joining", "online", "leaving"]
LEADER_PERIOD_S = 600.0  # verified runs: how long one leader serves (a change redirects a forming group's joiners)
MAX_SLOW_MARKS = 16  # peers one record may name as slow
MAX_RELAYS = 4  # relay addresses one record may name
MAX_RELAY_ADDRESS = 400  # characters of one
REREAD_S = 0.5  # the least time between two early re-reads of the view (see Membership.reread)
MAX_TTL_S = 60.0  # DHT nodes refuse records that live longer: a peer gone silent leaves every view within this
# A record lives through at least this many of its peer's refreshes (announce, then read) as last measured: on a
# starved machine (32 trainers starting on 2 cores) one took over 8 s, so every record, this peer's own included,
# had expired by the time the read that followed it came back, and every view was empty for a minute
CYCLES_PER_TTL = 3.0
# A peer suspected again soon after its last suspicion ended is suspected twice as long each time, up to 2**this
# times: a record whose peer never answers (made up by a key holder, docs/threat-model.md) stops costing rounds
MAX_SUSPICION_DOUBLINGS = 4
# a peer nobody can dial keeps waiting for a dialable leader this long after its record was last read (one
# read can miss it); only then do such peers pick one of their own to lead
DIALABLE_MEMORY_S = 30.0
MAX_SUSPECTS_KEPT = 1024  # suspicions remembered past their end (to double the next one), before the oldest go


def _circuit_address(text: str) -> str:
    if len(text) > MAX_RELAY_ADDRESS:
        raise ValueError(f"a relay address has at most {MAX_RELAY_ADDRESS} characters")
    maddr = Multiaddr(text)  # raises on malformed ones
    if str(maddr).count("/p2p-circuit/p2p/") != 1:
        raise ValueError("a relay address is <relay>/p2p-circuit/p2p/<peer>")
    return text


RelayAddress = Annotated[str, AfterValidator(_circuit_address)]


class PeerRecord(WireModel):
    """A trainer's announcement (the DHT value under its subkey)."""

    state: PeerState
    step: int  # training step of its parameters
    role: Literal["trainer"] = "trainer"
    # peers this one found slow lately (their parts reached its reducer far behind the others', or, as its
    # leader, they kept its joins long; itself while it steps down): see `Membership.slow_votes`
    slow: list[PeerIdStr] = Field(default=[], max_length=MAX_SLOW_MARKS)
    # it stepped down lately and is back in groups, but does not lead yet (LinkQuality.on_probation)
    probation: bool = False
    reachable: bool = True  # others can dial it; False: it only dials out (home router), so it never leads
    # where a peer nobody can dial is reached: circuits through relays it holds a slot on (empty: nowhere)
    relays: list[RelayAddress] = Field(default=[], max_length=MAX_RELAYS)

    def circuits(self, peer: str) -> list[str]:
        """Its relay addresses that lead to `peer` (the record's signer): no other peer can be named."""
        return [r for r in self.relays if r.endswith(f"/p2p-circuit/p2p/{peer}")]


@dataclass
class MembershipStats:
    refreshes: int = 0
    failed_refreshes: int = 0
    invalid_records: int = 0


@dataclass
class Membership:
    """Announce this peer and track the others. Open with `start()`, close with `aclose()`."""

    dht: DHT
    key: str  # the run's DHT key, derived from its configuration hash
    peer_id: str
    identity: Optional[Identity] = None  # signs this peer's records (None: a view that never announces)
    reachable: bool = True  # whether others can dial this peer (published; one that cannot never leads)
    relays: list[str] = field(default_factory=list)  # circuits others reach it through (published; RelayKeeper)
    refresh_s: float = 2.0
    ttl_s: float = 8.0
    state: PeerState = "joining"
    step: int = 0
    banned: set[str] = field(default_factory=set)
    stats: MembershipStats = field(default_factory=MembershipStats)
    _view: dict[str, tuple[PeerRecord, float]] = field(default_factory=dict)
    _suspects: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, tuple[int, float]] = field(default_factory=dict)  # peer -> (doublings, its last suspicion's length)
    _suspected_at: dict[str, float] = field(default_factory=dict)  # peer -> time.monotonic() it was last suspected
    _dialable_seen: dict[str, float] = field(default_factory=dict)  # peers others can dial -> when last in view
    _task: Optional[asyncio.Task] = None
    _refreshed: Optional[asyncio.Event] = None
    _soon: Optional[asyncio.Event] = None  # wakes the refresh loop early (see announce_soon)
    _reread_at: float = float("-inf")
    _cycle_s: float = 0.0  # how long the last refresh took, announce and read
    _stepping_down: dict[str, float] = field(default_factory=dict)  # peer -> time.monotonic() it leads again
    admitted: Optional[Callable[[str], bool]] = None  # private swarms: peers without a certificate are invisible
    # verified runs: the leader is drawn anew each period (see `leader`); None: the lowest peer ID leads
    leader_period_s: Optional[float] = None
    leader_clock: Callable[[], float] = get_dht_time  # numbers the periods (every peer's clock is the DHT's)
    # the peers this one finds slow and whether it is on probation, published in its record. The RoundEngine
    # hands it over: it builds it after this view, as it announces through announce_soon (None: no marks)
    link: Optional[LinkQuality] = None

    async def start(self) -> None:
        self._refreshed, self._soon = asyncio.Event(), asyncio.Event()
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="membership")

    async def aclose(self, announce_leaving: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if announce_leaving:
            self.state = "leaving"
            try:
                await asyncio.wait_for(self._announce(expire_in_s=self.refresh_s), timeout=5)
            except Exception as e:
                logger.debug(f"could not announce leaving: {e!r}")

    def announce_soon(self) -> None:
        """Refresh now rather than at the next period (a record's content changed)."""
        if self._refreshed is not None:
            self._soon.set()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._soon.wait(), timeout=self.refresh_s)
            except asyncio.TimeoutError:
                pass
            self._soon.clear()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.stats.failed_refreshes += 1
                logger.debug(f"membership refresh failed: {e!r}")

    @property
    def record_ttl_s(self) -> float:
        """How long this peer's record lives: `ttl_s`, or CYCLES_PER_TTL of its refreshes where those are slower."""
        return min(max(self.ttl_s, CYCLES_PER_TTL * self._cycle_s), MAX_TTL_S)

    async def refresh(self) -> None:
        """Announce ourselves and re-read everyone's records."""
        began = time.monotonic()
        await self._announce(expire_in_s=self.record_ttl_s)
        await self._read()
        self._cycle_s = time.monotonic() - began

    async def reread(self, *, timeout_s: float = 1.0) -> None:
        """Re-read everyone's records now, at most every REREAD_S (a join this peer would redirect says its view
        and the joiner's disagree, e.g. a leader just stepped down); failures leave the view as it was."""
        now = time.monotonic()
        if now - self._reread_at < REREAD_S:
            return
        self._reread_at = now
        try:
            await asyncio.wait_for(self._read(), timeout=timeout_s)
        except Exception as e:  # (a timeout included)
            logger.debug(f"membership re-read failed: {e!r}")

    async def _read(self) -> None:
        found = await dht_get(self.dht, self.key)
        records, invalid = read_signed(found, PeerRecord, key=self.key, max_ttl_s=MAX_TTL_S, now=get_dht_time())
        self.stats.invalid_records += invalid
        self._view = {peer: entry for peer, entry in records.items() if peer not in self.banned}
        now = time.monotonic()
        self._dialable_seen.update((peer, now) for peer, (record, _) in self._view.items() if record.reachable)
        self.stats.refreshes += 1
        if self._refreshed is not None:
            self._refreshed.set()

    async def _announce(self, expire_in_s: float) -> None:
        if self.identity is None:
            raise ValueError("a membership without an identity cannot announce")
        record = PeerRecord(
            state=self.state, step=self.step, slow=self._own_marks(),
            probation=self.on_probation(), reachable=self.reachable, relays=self.relays[:MAX_RELAYS],
        )  # fmt: skip
        value, expiration = sign_record(self.identity, self.key, record, signed_at=get_dht_time(), ttl_s=expire_in_s)
        await dht_store(self.dht, self.key, value, expiration, subkey=self.peer_id)

    def peers(self, *, states: tuple[PeerState, ...] = ("joining", "online")) -> dict[str, PeerRecord]:
        """Unexpired, unbanned records in the given states (ourselves included once announced)."""
        now = get_dht_time()
        return {
            p: rec
            for p, (rec, exp) in self._view.items()
            if exp > now and rec.state in states and p not in self.banned and (self.admitted is None or self.admitted(p))
        }

    def suspect(self, peer: str, for_s: float) -> None:
        """Treat `peer` as unreachable for a while (it failed a call or missed a round): `for_s`, doubled for
        each time in a row it was suspected again within as long as its last suspicion lasted."""
        now = time.monotonic()
        doublings, last_s = self._strikes.get(peer, (0, 0.0))
        until = self._suspects.get(peer)
        if until is None or now - until > last_s:
            doublings = 0  # it stayed clear as long as it was last suspected: start over
        elif until <= now:
            doublings = min(doublings + 1, MAX_SUSPICION_DOUBLINGS)  # suspected again as soon as it was let back
        length = for_s * 2**doublings
        self._suspects[peer] = max(until or now, now + length)
        self._strikes[peer] = (doublings, length)
        self._suspected_at[peer] = now
        if len(self._suspects) > MAX_SUSPECTS_KEPT:  # made-up peers come and go: forget those long let back
            for other in [p for p, t in self._suspects.items() if now - t > self._strikes[p][1]]:
                del self._suspects[other], self._strikes[other]
                self._suspected_at.pop(other, None)

    def clear_suspicion(self, peer: str) -> None:
        self._suspects.pop(peer, None)
        self._strikes.pop(peer, None)
        self._suspected_at.pop(peer, None)

    def is_suspect(self, peer: str) -> bool:
        until = self._suspects.get(peer)
        return until is not None and until >= time.monotonic()  # an expired entry stays: `suspect` counts from it

    def suspected_since(self, peer: str, since: float) -> bool:
        """Whether `peer` is a suspect on evidence from `since` (time.monotonic()) or later."""
        return self.is_suspect(peer) and self._suspected_at.get(peer, float("-inf")) >= since

    def note_stepping_down(self, peer: str, for_s: float) -> None:
        """`peer` told us itself (a join it redirected) that it steps down: as if its record named it, until then."""
        self._stepping_down[peer] = time.monotonic() + for_s

    def _dialable_lately(self, excluding: frozenset[str]) -> list[str]:
        """Peers others can dial that were in view within DIALABLE_MEMORY_S, banned and `excluding` aside."""
        now = time.monotonic()
        return sorted(
            p for p, seen in self._dialable_seen.items()
            if now - seen < DIALABLE_MEMORY_S and p not in excluding and p not in self.banned and p != self.peer_id
        )  # fmt: skip

    def slow_votes(self) -> dict[str, int]:
        """Peers that more than half of the others in view name as slow in their records, with how many name
        them. Every peer reads the same records, the slow one included, so all agree it should not lead:
        every join and group reply crosses the leader's link, and a lossy leader held every group of a
        `k:<K>` swarm back. A peer so named has no vote itself (it still counts among the others): on a
        lossy link it sees everyone's parts come in late and names them at random. A peer that names
        itself steps down (LinkQuality.note_report) and counts as named by all, from when it says so in a
        join reply (`note_stepping_down`) too."""
        records = self.peers()
        now = time.monotonic()
        stepping_down = {p for p, until in self._stepping_down.items() if until > now}
        self._stepping_down = {p: self._stepping_down[p] for p in stepping_down}
        if self.peer_id in records:  # our own marks as they are now, not as last published (a leader stepping down)
            records[self.peer_id] = records[self.peer_id].model_copy(update={"slow": self._own_marks()})

        def named(void: set[str]) -> dict[str, int]:
            votes = {}
            for peer in records:
                if peer in records[peer].slow or peer in stepping_down:  # it steps down (its joiners found it slow)
                    votes[peer] = len(records) - 1
                    continue
                count = sum(peer in rec.slow for other, rec in records.items() if other != peer and other not in void)
                if 2 * count > len(records) - 1:
                    votes[peer] = count
            return votes

        return named(set(named(set())))

    def _own_marks(self) -> list[str]:
        return sorted(self.link.slow_peers())[:MAX_SLOW_MARKS] if self.link is not None else []

    def on_probation(self) -> bool:
        """This peer stepped down lately: it leads no group yet (see LinkQuality.on_probation)."""
        return self.link is not None and self.link.on_probation()

    def slow_flagged(self) -> set[str]:
        return set(self.slow_votes())

    def stepping_aside(self) -> set[str]:
        """Peers on probation (they stepped down lately): in groups, leading none; this one by its fresh state."""
        aside = {p for p, record in self.peers().items() if record.probation and p != self.peer_id}
        return aside | {self.peer_id} if self.on_probation() else aside

    def leader(self, *, excluding: frozenset[str] = frozenset(), trusting: bool = False) -> str:
        """Every peer computes the same answer from the same view (disagreement only costs a redirect or a
        resync): among announced, unsuspected peers and ourselves, not flagged slow (unless all are) nor on
        probation (unless all others are), the lowest peer ID, or with `leader_period_s` the lowest hash of
        (period number, peer ID). The leader
        forms the groups, and anyone can make a key with a low peer ID; no key has a low hash in every
        period, so a Byzantine peer leads about its share of the periods, not all of them. `excluding`: who
        would lead without them; `trusting`: who would lead if no one were suspected. Only peers others can dial
        lead (every joiner must reach the leader), unless none is in view."""
        view = {p: record for p, record in self.peers().items() if p not in excluding and p != self.peer_id}
        others = [p for p in view if trusting or not self.is_suspect(p)]
        dialable = [p for p in others if view[p].reachable]
        if self.reachable:
            pool = [*dialable, self.peer_id]
        elif dialable or (lately := [p for p, record in view.items() if record.reachable] or self._dialable_lately(excluding)):
            # we lead no one while a peer others can dial is in view, suspected or not, or was a moment ago (its
            # record may miss one read): leading ourselves would train alone, as nobody can join us; a suspected
            # leader is waited for (its joins fail, and are retried)
            pool = dialable or lately
        else:  # nobody in view can be dialed: all of us pick the same one by the usual rule (relays may help)
            pool = [*others, self.peer_id]
        slow, aside = self.slow_flagged(), self.stepping_aside()
        candidates = [p for p in pool if p not in slow | aside] or [p for p in pool if p not in slow] or pool
        if self.leader_period_s is None:
            return min(candidates)
        period = int(self.leader_clock() // self.leader_period_s).to_bytes(8, "little")
        return min(candidates, key=lambda p: hashlib.sha256(period + p.encode()).digest())



def membership_validator(key: str) -> SignedRecordValidator:
    """What every DHT node of the run checks of the records under `key` (see peer/dht_keys.py)."""
    return SignedRecordValidator(key, PeerRecord, MAX_TTL_S)
