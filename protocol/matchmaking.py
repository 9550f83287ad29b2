"""Phase 1 of a round: peers that are ready form a group around a leader.

The leader is the lowest peer ID in the membership view (verified runs: drawn anew each period,
see `Membership.leader`). Every ready peer sends it a join carrying the version of the state it
holds; the leader closes the group when every peer it expects has joined, when
`target_group_size` is reached, or at the deadline with at least `min_group_size` joiners. It
then answers all of them at once:
  * members: joiners whose version is the swarm's current one (highest step; ties go to
    the larger count, then the larger hash) get the ordered member list and round id;
  * everyone else (newcomers, stragglers that missed a round, the losing side of a
    split) is told to resync: download the state a named donor holds after this round,
    then join the next one, which waits for them.
A peer that is not the leader in its own view redirects the joiner to the one it sees, and a
forming group whose leader stops leading sends its joiners there too. A joiner waiting on a leader
probes it every second: a leader that does not answer within LEADER_ALIVE_S (cut off, frozen) or has
left this peer's view is given up on and suspected, so the swarm regroups around the next one instead
of waiting out the whole join call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal, Optional

from pydantic import Field, model_validator

from phalanx.errors import PeerProtocolError, RoundTimeoutError
from phalanx.protocol.config import MatchmakingConfig
from phalanx.protocol.groups import draw_groups
from phalanx.protocol.link_quality import SLOW_FOR_S, LinkQuality
from phalanx.protocol.membership import Membership
from phalanx.protocol.quarantine import Quarantine
from phalanx.protocol.sync_policy import SyncPolicy
from phalanx.protocol.transport import CallFailed, Transport
from phalanx.security.commitments import GroupBody
from phalanx.security.identity import Identity
from phalanx.security.statements import sign_statement
from phalanx.security.wire import PeerIdStr, RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

JOIN_METHOD = "join"
PROBE_METHOD = "join_probe"
LEADER_PROBE_S = 1.0  # a joiner probes the leader holding its join this often ...
LEADER_ALIVE_S = 4.0  # ... and gives up on it when a probe is not answered within this (a live one answers in ms)
MAX_REDIRECTS = 3
# A leader whose host answers but serves no joins yet is starting (a swarm restarted whole finds its peers'
# records from before): it is asked again rather than suspected, or each peer would train its first rounds alone
LEADER_STARTING_S = 10.0
LEADER_STARTING_RETRY_S = 0.5
LEADER_RECHECK_S = 1.0  # a forming group checks this often that its former still leads
# A joiner held by a forming group probes its leader every LEADER_PROBE_S; one not heard from for this long
# (a join that arrived just before a cut) is left out of the group: its members would wait out the
# all-reduce's idle timeout for its parts (5 s more after the 4 s spent finding out who else was cut off).
JOINER_SILENT_S = 3.0
FORMER_STALLED_S = LEADER_RECHECK_S + 0.5  # a forming group's passes this far apart: its loop stalled (probes queued)
RECHECK_LEADER_S = 1.0  # a joiner probes the leader it suspects at most this often (see Matchmaker._recheck_leader)
# Sync policies (K of N): a joiner most of the others name slow in their membership records (protocol.link_quality)
# does not count towards K for SLOW_WAIT_S, and is left out when K others are in sync
SLOW_WAIT_S = 1.0
MAX_OVERHEAD_MS = 3_600_000
# groups of bounded size: a joiner this many steps behind the leading one is a member (its model is mixed in, and
# it takes the group's step) rather than told to download a donor's state
MIXING_LAG = 4
ANSWERED_KEEP_S = 60.0  # how long a leader answers a repeated join with the group it placed the join in


class JoinRequest(WireModel):
    run: Annotated[bytes, Field(max_length=32)]  # configuration hash: peers of another run (or another config) are refused
    version: Annotated[bytes, Field(max_length=32)]  # hash of the state the joiner holds (see protocol.engine)
    step: Annotated[int, Field(ge=0)]  # training step of that state
    together: bool = False  # that state came out of a round with others (not trained alone, not a checkpoint)
    # how long the joiner's previous join to this leader took beyond what the leader held it (its link, see
    # LinkQuality.note_report); 0: none, or to another leader
    overhead_ms: Annotated[int, Field(ge=0, le=MAX_OVERHEAD_MS)] = 0
    reachable: bool = True  # others can dial the joiner: it may reduce a part (False: it only dials out)
    # one join() of the joiner, through its redirects and retries: a leader that placed this very join in a
    # group answers it again with that group (the reply was lost with a relayed connection that broke, and
    # the call came again), instead of holding it for the next one while the group waits for its parts
    attempt: Annotated[bytes, Field(max_length=16)] = b""


class LeaderProbe(WireModel):
    run: Annotated[bytes, Field(max_length=32)]


class ProbeReply(WireModel):
    leading: bool  # the probed peer is the leader in its own view (a joiner it does not lead is redirected anyway)


class Donation(WireModel):
    recipient: PeerIdStr  # peer that must download the state ...
    donor: PeerIdStr  # ... from this member, as it stands after the round


class GroupSpec(WireModel):
    round_id: RoundId
    members: list[PeerIdStr]  # ordered: member i reduces part i (the first `reducers` of them, if set)
    step: int  # every member's step before the round
    version: bytes  # every member's state version before the round
    donations: list[Donation]
    statement: Annotated[bytes, Field(max_length=64 << 10)] = b""  # verified runs: the leader's signed "group"
    versions: list[Annotated[int, Field(ge=0)]] = []  # each member's state version as it joined (async modes)
    k: Annotated[int, Field(ge=0)] = 0  # how many members the sync policy asked for
    # unverified rounds: only the first `reducers` members reduce a part; the rest are peers nobody can dial,
    # which send their parts and take the aggregates back over connections they open (0: every member)
    reducers: Annotated[int, Field(ge=0)] = 0
    # a mixing round (MatchmakingConfig.group_size): its members hold different models, and each brings its
    # model besides its gradient, so that the group ends on one model (docs/algorithms.md §11)
    mixing: bool = False

    @model_validator(mode="after")
    def _reducers_are_members(self) -> GroupSpec:
        if self.reducers > len(self.members):
            raise ValueError(f"{self.reducers} reducers in a group of {len(self.members)}")
        return self


class JoinReply(WireModel):
    kind: Literal["group", "resync", "redirect", "retry"]
    group: Optional[GroupSpec] = None  # for "group" and "resync" (the round the donor takes part in)
    donor: Optional[PeerIdStr] = None  # for "resync"
    leader: Optional[PeerIdStr] = None  # for "redirect"
    held_ms: Annotated[int, Field(ge=0)] = 0  # how long the leader held the join: the rest of the call is its link
    # "redirect" from a leader stepping down (see LinkQuality.note_report): for how much longer. Its record says
    # so too, but a record stored over the very link that made it step down reaches the others seconds late,
    # and meanwhile they kept sending their joins back to it
    stepping_down_ms: Annotated[int, Field(ge=0, le=int(SLOW_FOR_S * 1000))] = 0


@dataclass
class MatchmakingStats:
    groups_formed: int = 0
    joins_served: int = 0
    redirects: int = 0
    retries: int = 0
    leader_failures: int = 0
    leaders_unresponsive: int = 0  # leaders given up on by a probe (cut off, frozen) or gone from the view


@dataclass
class _Pending:
    request: JoinRequest
    reply: asyncio.Future


@dataclass
class Matchmaker:
    """Both sides of phase 1: `join()` for this peer, and the leader's group former."""

    transport: Transport
    membership: Membership
    config: MatchmakingConfig
    run_hash: bytes
    link: LinkQuality  # which peers are slow, and whether this one steps down as leader
    identity: Optional[Identity] = None  # signs the groups this peer leads (verified runs)
    # verified runs: a round starts from the state most joiners hold (ties: the later one), not from the
    # latest anyone claims, or one peer claiming a step far ahead would make everyone download its state
    majority_state: bool = False
    sync_policy: Optional[SyncPolicy] = None  # K per round; None: everyone expected (or target_group_size)
    loss: Callable[[], Optional[float]] = lambda: None  # this peer's recent training loss, for AdaSync
    # peers this one caught misbehaving (protocol.quarantine): not admitted to the groups it leads, not
    # waited for, and not followed as leaders while their cool-off lasts
    quarantine: Quarantine = field(default_factory=Quarantine)
    stats: MatchmakingStats = field(default_factory=MatchmakingStats)
    last_leader: Optional[str] = None  # who answered the last successful join
    wall_clock: Callable[[], float] = time.time  # stamps the groups this peer leads (members check freshness)
    new_round_id: Callable[[], bytes] = lambda: secrets.token_bytes(16)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _expected_next: set[str] = field(default_factory=set)
    _arrived: Optional[asyncio.Event] = None
    _former: Optional[asyncio.Task] = None
    _probes: dict[str, asyncio.Task] = field(default_factory=dict)  # probes of the peer that would lead next
    _heard: dict[str, float] = field(default_factory=dict)  # joiner -> when its join or last probe came in
    _answered: dict[str, tuple[bytes, JoinReply, float]] = field(default_factory=dict)  # joiner -> (attempt, reply, when)
    _rechecked_at: float = float("-inf")  # when we last probed a leader we suspect
    _rng: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))
    _started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._arrived = asyncio.Event()
        self.transport.register(JOIN_METHOD, self._serve_join, max_payload=0)
        self.transport.register(PROBE_METHOD, self._serve_probe, max_payload=0)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def _leader(self, *, excluding: frozenset[str] = frozenset(), trusting: bool = False) -> str:
        """Who leads in our view, passing over the peers in quarantine (a quarantined leader gets no joins
        of ours; we lead when it would otherwise, and so does every peer that caught it too)."""
        return self.membership.leader(excluding=excluding | self.quarantine.peers(), trusting=trusting)

    async def aclose(self) -> None:
        if self._former is not None:
            self._former.cancel()
            await asyncio.gather(self._former, return_exceptions=True)
        for probe in list(self._probes.values()):
            probe.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        for pending in self._pending.values():
            if not pending.reply.done():
                pending.reply.set_result(JoinReply(kind="retry"))

    # ---- joiner ---------------------------------------------------------------------------

    async def join(self, *, version: bytes, step: int, together: bool = False) -> JoinReply:
        """Get into a group (or a resync order); raises RoundTimeoutError after join_timeout_s."""
        request = JoinRequest(
            run=self.run_hash, version=version, step=step, together=together, reachable=self.membership.reachable,
            attempt=secrets.token_bytes(16),
        )  # fmt: skip
        deadline = time.monotonic() + self.config.join_timeout_s
        target: Optional[str] = None
        redirects = 0
        starting_since: dict[str, float] = {}  # leaders found up but not serving joins yet: since when
        while time.monotonic() < deadline:
            self._recheck_leader()
            leader = target or self._leader()
            target = None
            if leader == self.peer_id:
                reply = await self._submit(self.peer_id, request)
            else:
                try:
                    reply = await self._join_remote(leader, request)
                except (CallFailed, PeerProtocolError) as e:
                    if isinstance(e, CallFailed) and e.not_serving:
                        if leader not in starting_since:
                            logger.info(f"leader {leader[-8:]} does not serve joins yet (starting); asking it again")
                        starting = starting_since.setdefault(leader, time.monotonic())
                        if time.monotonic() - starting < LEADER_STARTING_S:
                            target = leader
                            await asyncio.sleep(LEADER_STARTING_RETRY_S)
                            continue
                    self.stats.leader_failures += 1
                    logger.info(f"leader {leader[-8:]} failed ({e}); choosing another")
                    self.membership.suspect(leader, for_s=self.membership.ttl_s * 2)
                    continue
            if reply.kind == "redirect" and reply.stepping_down_ms:  # (only remote replies carry it)
                self.membership.note_stepping_down(leader, reply.stepping_down_ms / 1000)
            if reply.kind == "redirect" and reply.leader is not None:
                self.stats.redirects += 1
                redirects += 1
                followed = not self.membership.is_suspect(reply.leader) and reply.leader not in self.quarantine
                if redirects <= MAX_REDIRECTS and followed:
                    target = reply.leader
                else:
                    await asyncio.sleep(0.2)
                continue
            if reply.kind == "retry":
                self.stats.retries += 1
                await asyncio.sleep(0.1)
                continue
            if reply.group is None or (reply.kind == "group" and self.peer_id not in reply.group.members):
                raise PeerProtocolError("join reply without a group that includes us", peer=leader)
            self.last_leader = leader
            return reply
        raise RoundTimeoutError(f"no group formed within {self.config.join_timeout_s:.0f} s")

    async def _join_remote(self, leader: str, request: JoinRequest) -> JoinReply:
        """The join call to `leader`, abandoned (CallFailed) as soon as the leader stops answering probes: a
        cut-off or frozen leader would otherwise hold every joiner for the call's timeout. Its leaving the
        DHT view is no reason: under packet loss a live leader's record can lapse, and joiners that gave up
        on it formed groups of one while it still formed theirs."""
        timeout_s = self.config.matchmaking_timeout_s * 2 + 5
        if overhead_s := self.link.overhead_to_report(leader):
            request = request.model_copy(update={"overhead_ms": min(int(overhead_s * 1000), MAX_OVERHEAD_MS)})
        began = time.monotonic()
        call = asyncio.create_task(
            self.transport.call(leader, JOIN_METHOD, pack(request), max_reply_payload=0, timeout_s=timeout_s),
            name="join-call",
        )
        probe: Optional[asyncio.Task] = None
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=LEADER_PROBE_S)
                if done:
                    header, _ = call.result()
                    reply = unpack(header, JoinReply, peer=leader)
                    overhead = max(time.monotonic() - began - reply.held_ms / 1000, 0.0)
                    logger.debug(f"join to {leader[-8:]}: {reply.kind} after {time.monotonic() - began:.3f} s (held {reply.held_ms} ms)")
                    self.link.note_join_overhead(leader, overhead)
                    return reply
                probe = asyncio.create_task(self._probe(leader), name="join-probe")
                # the peer this one would turn to next is probed too: a split or cut that took the leader away
                # often took it as well, and finding that out only after the leader costs twice. When that peer
                # is this one, it would wait for everyone it expects: those are probed instead.
                fallback = self._leader(excluding=frozenset({leader}))
                self._watch(self._expected() - {leader} if fallback == self.peer_id else {fallback})
                done, _ = await asyncio.wait({call, probe}, return_when=asyncio.FIRST_COMPLETED)
                if call in done:
                    probe.cancel()
                    await asyncio.gather(probe, return_exceptions=True)
                    continue  # read the reply above
                try:
                    header, _ = probe.result()
                    unpack(header, ProbeReply, peer=leader)
                except CallFailed as e:
                    if call.done():
                        continue  # the reply landed while the probe failed: take it
                    self.stats.leaders_unresponsive += 1
                    raise CallFailed(f"leader {leader[-8:]} does not answer probes ({e})") from None
        finally:  # (also when this join is cancelled: a join sent during a round may be dropped)
            for task in (call, probe):
                if task is not None and not task.done():
                    task.cancel()
            await asyncio.gather(*(t for t in (call, probe) if t is not None), return_exceptions=True)

    async def _probe(self, peer: str) -> tuple[bytes, bytearray | memoryview]:
        request = pack(LeaderProbe(run=self.run_hash))
        return await self.transport.call(peer, PROBE_METHOD, request, max_reply_payload=0, timeout_s=LEADER_ALIVE_S)

    def _recheck_leader(self) -> None:
        """Probe the peer that would lead but for our suspicion: one that answers is trusted again. A leader
        whose probe failed just before a partition healed was passed over for the suspicion's whole 16 s,
        while the peers that had not suspected it joined it: two groups, each waiting for the other."""
        now = time.monotonic()
        if now - self._rechecked_at < RECHECK_LEADER_S:  # (every join passes here: the view is read once a second)
            return
        self._rechecked_at = now
        trusted = self._leader(trusting=True)
        if not self.membership.is_suspect(trusted) or trusted in self._probes:
            return
        self._probes[trusted] = asyncio.create_task(self._probe_watched(trusted, trust=True), name="recheck-probe")

    def _watch(self, peers: set[str]) -> None:
        """Probe each of `peers` (one probe in flight per peer) and suspect those that leave it unanswered."""
        for peer in peers - {self.peer_id} - set(self._probes):
            self._probes[peer] = asyncio.create_task(self._probe_watched(peer), name="watch-probe")

    async def _probe_watched(self, peer: str, *, trust: bool = False) -> None:
        try:
            header, _ = await self._probe(peer)
            unpack(header, ProbeReply, peer=peer)
            if trust:
                logger.info(f"peer {peer[-8:]} answers again; no longer suspected")
                self.membership.clear_suspicion(peer)
        except (CallFailed, PeerProtocolError) as e:
            (logger.debug if trust else logger.info)(f"peer {peer[-8:]} does not answer probes ({e}); not waiting for it")
            self.membership.suspect(peer, for_s=self.membership.ttl_s * 2)
            self._arrived.set()  # a forming group re-counts whom it waits for
        finally:
            self._probes.pop(peer, None)

    # ---- leader -----------------------------------------------------------------------------

    async def _serve_probe(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, LeaderProbe, peer=peer)
        if request.run != self.run_hash:
            raise PeerProtocolError("probe for a different run configuration", peer=peer)
        if peer in self._pending:
            self._heard[peer] = time.monotonic()
        return pack(ProbeReply(leading=self._leader() == self.peer_id)), b""

    async def _serve_join(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, JoinRequest, peer=peer)
        if request.run != self.run_hash:
            raise PeerProtocolError("join for a different run configuration", peer=peer)
        if peer in self.membership.banned:
            raise PeerProtocolError("banned peer", peer=peer)
        if peer in self.quarantine:
            raise PeerProtocolError(f"in quarantine for {self.quarantine.remaining_s(peer):.0f} s more", peer=peer)
        self.stats.joins_served += 1
        self.link.note_report(peer, request.overhead_ms / 1000)
        began = time.monotonic()
        reply = await self._submit(peer, request)
        update = {"held_ms": int((time.monotonic() - began) * 1000)}
        stepping_down_s = self.link.stepping_down_s()
        if reply.kind == "redirect" and stepping_down_s > 0:
            update["stepping_down_ms"] = min(int(stepping_down_s * 1000), int(SLOW_FOR_S * 1000))
        return pack(reply.model_copy(update=update)), b""

    async def _submit(self, peer: str, request: JoinRequest) -> JoinReply:
        leader = self._leader()
        if leader != self.peer_id and peer != leader:
            await self.membership.reread()  # the joiner's view and ours disagree: read the records again first
            leader = self._leader()
        if leader != self.peer_id and peer != leader:
            return JoinReply(kind="redirect", leader=leader)
        now = time.monotonic()
        answered = self._answered.get(peer)
        if answered is not None and request.attempt and answered[0] == request.attempt and now - answered[2] < ANSWERED_KEEP_S:
            return answered[1]  # this join again: the group it is in already
        previous = self._pending.pop(peer, None)
        if previous is not None and not previous.reply.done():
            previous.reply.set_result(JoinReply(kind="retry"))  # a re-join replaces a stale one
        future = asyncio.get_running_loop().create_future()
        self._pending[peer] = _Pending(request, future)
        self._heard[peer] = time.monotonic()
        self.membership.clear_suspicion(peer)
        self._arrived.set()
        if self._former is None or self._former.done():
            self._former = asyncio.create_task(self._form_group(), name="form-group")
        reply = await future
        if request.attempt and reply.kind in ("group", "resync"):
            placed = time.monotonic()
            self._answered = {p: a for p, a in self._answered.items() if placed - a[2] < ANSWERED_KEEP_S}
            self._answered[peer] = (request.attempt, reply, placed)
        return reply

    def _expected(self) -> set[str]:
        view = set(self.membership.peers())
        expected = (view | self._expected_next) - self.membership.banned - self.quarantine.peers()
        return {p for p in expected if not self.membership.is_suspect(p)} | {self.peer_id}

    def _k(self) -> Optional[int]:
        """How many members the sync policy wants in this group (None: no policy)."""
        if self.sync_policy is None or self.sync_policy.name == "full":
            return None  # everyone expected: the group closes when all of them joined (or at the deadline)
        return self.sync_policy.k(len(self._expected()), time.monotonic() - self._started, self.loss())

    async def _form_group(self) -> None:
        """Close the group at K joiners (sync policy / target size), when everyone expected joined, at
        the end of the asynchronous window, or at the deadline — each with at least min_group_size."""
        first_join = time.monotonic()
        deadline = first_join + self.config.matchmaking_timeout_s
        window_end = None if self.config.window_s is None else first_join + self.config.window_s
        k = self._k()
        limits = [x for x in (self.config.target_group_size, k) if x]
        target = max(min(limits), self.config.min_group_size) if limits else None
        timed_out = False
        ticked = first_join
        while True:
            self._arrived.clear()
            now = time.monotonic()
            if now - ticked < FORMER_STALLED_S:
                self._leave_out_silent(now)
            self._leave_out_quarantined()
            ticked = now
            self._recheck_leader()
            leader = self._leader()
            if leader != self.peer_id:
                self._release_all(JoinReply(kind="redirect", leader=leader))
                return
            joined = set(self._pending)
            enough = len(joined) >= self.config.min_group_size
            # K counts joiners at the leading step: one behind (a straggler, one left out of the last round)
            # is told to resync, so it does not fill the group (counting it made groups of 2 under k:3, and
            # the member left out of each fell behind in turn). One at that step whose version differs (its
            # last round was partial) counts: waiting for a third matching version would last until the deadline.
            # slow joiners count towards K only after SLOW_WAIT_S, and only where waiting can help: when K
            # unflagged peers are expected (a falsely flagged healthy peer made every group wait otherwise)
            slow = self.membership.slow_flagged()
            patient = (
                bool(k and self.config.lockstep and slow)
                and len(self._expected() - slow) >= k
                and time.monotonic() < first_join + SLOW_WAIT_S
            )
            if target is not None and self._at_leading_step(self._pending, skip=slow if patient else set()) >= target:
                break
            if target is None and joined >= self._expected():  # (asynchronous modes too: no one left to wait for)
                break
            now = time.monotonic()
            if window_end is not None and enough and now >= window_end:
                break  # asynchronous modes: whoever is ready
            if now >= deadline:
                if enough:
                    timed_out = True
                    break
                self._release_all(JoinReply(kind="retry"))
                return
            wake_at = min(deadline, window_end) if window_end is not None and enough else deadline
            wake_at = min(wake_at, now + LEADER_RECHECK_S)  # a new leader in view (or period) releases the joiners
            if now >= first_join + LEADER_PROBE_S:
                # expected peers that have not joined within a second are probed: one cut off or frozen is
                # then not waited for beyond LEADER_ALIVE_S (its DHT record would hold the group ttl_s)
                self._watch(self._expected() - joined)
            else:
                wake_at = min(wake_at, first_join + LEADER_PROBE_S)
            if patient:
                wake_at = min(wake_at, first_join + SLOW_WAIT_S)  # then slow joiners count too
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=max(wake_at - now, 0.001))
            except asyncio.TimeoutError:
                pass
        missing = self._expected() - set(self._pending)
        if logger.isEnabledFor(logging.DEBUG):
            slow = sorted(p[-8:] for p in self.membership.slow_flagged())
            logger.debug(
                f"group closes {time.monotonic() - first_join:.3f} s after the first join: {len(self._pending)} joined, "
                f"{len(missing)} expected missing, K={k}, slow by the swarm's word: {slow}, marked slow here: "
                f"{sorted(p[-8:] for p in self.link.slow_peers())}"
            )
        if timed_out:
            for peer in missing:  # do not wait for them again until they join
                self.membership.suspect(peer, for_s=self.membership.ttl_s)
            if missing:
                logger.info(f"group closed without {len(missing)} expected peer(s): {sorted(p[-8:] for p in missing)}")
        pending, self._pending = self._pending, {}
        # lockstep: one group per step, whoever is in sync by now (two groups would start two models);
        # asynchronous modes: groups of the target size
        size = self.config.target_group_size if self.config.lockstep else target
        for peer in self._announce_groups(pending, k or 0, size):  # joiners that fit no group wait for the next one
            self._pending[peer] = pending[peer]
        self._heard = {p: t for p, t in self._heard.items() if p in self._pending}
        if self._pending:
            self._former = asyncio.create_task(self._form_group(), name="form-group")

    def _leave_out_silent(self, now: float) -> None:
        """Answer "retry" to remote joiners silent for JOINER_SILENT_S, and suspect them: cut off or frozen
        since they joined. A live one rejoins at once (its join clears the suspicion)."""
        silent = [p for p in self._pending if p != self.peer_id and now - self._heard.get(p, now) > JOINER_SILENT_S]
        for peer in silent:
            _resolve(self._pending.pop(peer).reply, JoinReply(kind="retry"))
            self.membership.suspect(peer, for_s=self.membership.ttl_s)
        if silent:
            logger.info(f"left out joiner(s) silent for over {JOINER_SILENT_S:g} s: {sorted(p[-8:] for p in silent)}")

    def _leave_out_quarantined(self) -> None:
        """Answer "retry" to joiners put in quarantine since they joined (their next join is refused)."""
        caught = [p for p in self._pending if p in self.quarantine]
        for peer in caught:
            _resolve(self._pending.pop(peer).reply, JoinReply(kind="retry"))
        if caught:
            logger.info(f"left out joiner(s) in quarantine: {sorted(p[-8:] for p in caught)}")

    def _release_all(self, reply: JoinReply) -> None:
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.reply.done():
                entry.reply.set_result(reply)

    def _leading_state(self, pending: dict[str, _Pending]) -> tuple[int, bytes]:
        """The (step, version) a group starts from: a state trained together before one trained alone or
        loaded from a checkpoint, then the highest step, then the most joiners, then the larger hash
        (verified runs: the most joiners first)."""
        counts = Counter((p.request.step, p.request.version) for p in pending.values())
        together = {(p.request.step, p.request.version) for p in pending.values() if p.request.together}
        if self.majority_state:
            return max(counts, key=lambda sv: (counts[sv], sv[0], sv[1]))
        return max(counts, key=lambda sv: (sv in together, sv[0], counts[sv], sv[1]))

    def _at_leading_step(self, pending: dict[str, _Pending], *, skip: frozenset[str] | set[str] = frozenset()) -> int:
        """How many joiners hold the leading state's step (asynchronous modes: every joiner), not counting `skip`."""
        if not self.config.lockstep or not pending:
            return len(pending)
        step, _ = self._leading_state(pending)
        return sum(e.request.step == step and p not in skip for p, e in pending.items())

    def _in_sync(self, pending: dict[str, _Pending]) -> list[str]:
        """The joiners that contribute to the next group; in lockstep modes those holding the leading state
        (with groups of bounded size, those at its step or up to MIXING_LAG behind: mixing rounds average
        different models anyway, and a download would cost more than a model a few steps old)."""
        if not self.config.lockstep:
            return sorted(pending)  # asynchronous modes: every version is welcome
        leading = self._leading_state(pending)
        if self.config.group_size is not None:
            return sorted(p for p, entry in pending.items() if 0 <= leading[0] - entry.request.step <= MIXING_LAG)
        return sorted(p for p, entry in pending.items() if (entry.request.step, entry.request.version) == leading)

    def _split(self, in_sync: list[str], size: Optional[int]) -> tuple[list[list[str]], list[str]]:
        """(groups, leftover): lockstep groups of bounded size are ⌈n/G⌉ random groups whose sizes differ
        by one at most; otherwise the first `size` drawn form a group and the rest wait for the next one."""
        self._rng.shuffle(in_sync)
        if self.config.lockstep and self.config.group_size is not None:
            draw = draw_groups(len(in_sync), self.config.group_size, self._rng.getrandbits(32), 0)
            return [[in_sync[i] for i in group] for group in draw], []
        size = size or len(in_sync)  # K (or the target size): the first K form a group, the rest wait
        chunks = [in_sync[i : i + size] for i in range(0, len(in_sync), size)]
        leftover: list[str] = []
        if len(chunks) > 1 and len(chunks[-1]) < max(self.config.min_group_size, size if not self.config.lockstep else 0):
            leftover = chunks.pop()  # groups keep their size; the rest wait for the next ones
        return chunks, leftover

    def _announce_groups(self, pending: dict[str, _Pending], k: int, size: Optional[int] = None) -> list[str]:
        """Answer every joiner that fits a group; returns the ones left over (fewer than a group)."""
        step, version = self._leading_state(pending)
        in_sync = self._in_sync(pending)
        if k and self.config.lockstep:  # slow ones resync from this group, the most named first, while K remain
            votes = self.membership.slow_votes()
            for peer in sorted((p for p in in_sync if p in votes), key=lambda p: (-votes[p], p)):
                if len(in_sync) <= k:
                    break
                in_sync.remove(peer)
        behind = sorted(peer for peer in pending if peer not in set(in_sync))
        # members hold different models when the swarm is split this round or was split before
        mixing = self.config.group_size is not None and (
            len(in_sync) > self.config.group_size or len({pending[p].request.version for p in in_sync}) > 1
        )
        chunks, leftover = self._split(in_sync, size)
        # donors: members the swarm does not find slow where there are any (a state from a lossy peer comes late),
        # and that the recipient can dial
        slow = self.membership.slow_flagged()
        dialable = [p for p in in_sync if pending[p].request.reachable]
        donors = [p for p in dialable if p not in slow] or dialable or in_sync
        donations = {peer: donors[i % len(donors)] for i, peer in enumerate(behind)}
        self._expected_next = set(pending)
        for chunk in chunks:
            members, reducers = self._reducers_first(chunk, pending)
            round_id = self.new_round_id()
            statement = b""
            if self.identity is not None:
                body = GroupBody(members=members, issued_at=self.wall_clock())
                statement = pack(sign_statement(self.identity, "group", round_id, body))
            group = GroupSpec(
                round_id=round_id,
                members=members,
                step=step,
                version=version,
                donations=[Donation(recipient=r, donor=d) for r, d in donations.items() if d in members],
                statement=statement,
                versions=[pending[m].request.step for m in members],
                k=k,
                reducers=reducers if reducers < len(members) else 0,
                mixing=mixing,
            )
            if k:
                logger.info(f"group of {len(members)} formed (sync policy {self.sync_policy.spec}: K={k})")
            self.stats.groups_formed += 1
            for peer in members:
                _resolve(pending[peer].reply, JoinReply(kind="group", group=group))
            for recipient, donor in donations.items():
                if donor in members:
                    _resolve(pending[recipient].reply, JoinReply(kind="resync", group=group, donor=donor))
        return leftover


    def _reducers_first(self, chunk: list[str], pending: dict[str, _Pending]) -> tuple[list[str], int]:
        """(members, how many reduce): joiners others can dial first, as drawn. Verified rounds have every member
        reduce a part (their checks count on it): there, a member nobody can dial fails as a reducer would; so
        it does in a group with no member others can dial (through relays, if they have any)."""
        dialable = [p for p in chunk if pending[p].request.reachable]
        if self.majority_state or not dialable:
            return chunk, len(chunk)
        return dialable + [p for p in chunk if not pending[p].request.reachable], len(dialable)


def _resolve(future: asyncio.Future, reply: JoinReply) -> None:
    if not future.done():
        future.set_result(reply)
