"""The round engine: matchmaking, then the butterfly all-reduce, with state versions.

Every member of a group holds the same state version, a hash chained over the rounds
it completed: version' = H(version ‖ round id ‖ which parts came back). Peers that
completed the same rounds with the same parts hold the same version, so the leader
can tell who is in sync without comparing parameters, and anyone whose round went
differently (a lost part, a missed round, a split group) resyncs from a donor.
Verified rounds (`_verified_round`) add phases 2 (commitments) and 6 (verification) around the data exchange.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch

from phalanx.errors import PeerProtocolError, RoundAbortedError, RoundTimeoutError
from phalanx.protocol.allreduce import AllReduceResult, AllReduceService, RoundSpec
from phalanx.protocol.bans import BanBook, refresh_forever
from phalanx.protocol.btard import BtardService, Recompute, Verdict, VerifiedRound
from phalanx.protocol.btard.behavior import Behavior
from phalanx.protocol.codec import encode
from phalanx.protocol.config import Codec, RoundConfig
from phalanx.protocol.exchange import ExchangeService
from phalanx.protocol.link_quality import LinkQuality
from phalanx.protocol.matchmaking import MIXING_LAG, GroupSpec, JoinReply, Matchmaker
from phalanx.protocol.membership import Membership
from phalanx.protocol.quarantine import Quarantine
from phalanx.protocol.round_counts import RoundCounts
from phalanx.protocol.state_sync import StateService, StateSnapshot
from phalanx.protocol.sync_policy import SyncPolicy
from phalanx.protocol.transport import CallFailed, Transport
from phalanx.security.commitments import GroupBody
from phalanx.security.identity import Identity
from phalanx.security.projection import fingerprints_match, state_fingerprint
from phalanx.security.statements import Signed, open_statement
from phalanx.security.wire import unpack

logger = logging.getLogger(__name__)

Prepare = Callable[[GroupSpec], Awaitable[tuple[torch.Tensor, float]]]  # group -> (contribution, weight)
# what a round raises when it fails for this peer (it counts in `stats.rounds_failed`); the peer trains on
ROUND_FAILURES = (RoundAbortedError, RoundTimeoutError, PeerProtocolError)


def initial_version(run_hash: bytes, tensors: dict[str, torch.Tensor], step: int) -> bytes:
    """Version of a state nobody averaged yet (a fresh start or a checkpoint): a hash of its content,
    so peers that start from identical states can group right away."""
    h = hashlib.sha256(run_hash + step.to_bytes(8, "little"))
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


GROUP_FRESH_S = 300.0  # how far a group statement's time may be from ours
USED_ROUNDS = 16_384  # remembered round ids: more than rounds can start in 2 × GROUP_FRESH_S


def next_version(version: bytes, round_id: bytes, missing_parts: tuple[int, ...]) -> bytes:
    return hashlib.sha256(version + round_id + repr(sorted(missing_parts)).encode()).digest()


@dataclass(frozen=True)
class Averaged:
    """The group's aggregate; apply it, then call `engine.completed(...)`."""

    group: GroupSpec
    result: AllReduceResult
    verdict: Optional[Verdict] = None  # verified rounds: who was banned, which parts were thrown away
    # mixing rounds: the group's mean model (numel,), scaled as the request's; where a part of it did not come
    # back, this peer's own model (a zero there would wipe those parameters)
    model: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Resync:
    """This peer is not in sync: download `donor`'s state after `group.round_id`, then load it."""

    group: GroupSpec
    donor: str

    @property
    def together(self) -> bool:
        """The donor's state comes out of a round with others (see `RoundEngine.together`)."""
        return len(self.group.members) > 1


@dataclass(frozen=True)
class Verification:
    """This member's part in checking the others: only verified rounds read it (unverified ones refuse
    `sit_out`), so the plain request leaves it out."""

    recompute: Optional[Recompute] = None  # a validator's recomputation of another member's contribution
    # how long one `recompute` takes here, which the round waits for validators beyond its phase timeout
    recompute_s: float = 0.0
    # this member reduces, reports, judges and gets the result, but no aggregate counts its vector (a DiLoCo
    # validator that replayed `target`'s phase instead of training); unverified rounds refuse it
    sit_out: bool = False
    target: Optional[str] = None  # sitting out: the member whose contribution it checks


@dataclass(frozen=True)
class RoundRequest:
    """What this peer brings to a round: `RoundRequest(vector)` in the plain case.

    Instead of a vector, `prepare(group)` may return (vector, weight) once the group is known
    (asynchronous modes correct stale contributions with what the group says)."""

    vector: Optional[torch.Tensor] = None  # (numel,)
    weight: float = 1.0  # verified rounds count every member once: 1 only
    prepare: Optional[Prepare] = None
    verification: Verification = Verification()
    # the caller asks for the next round as soon as this one lands (sync): join it while this one runs, so
    # the next group is formed by then (see RoundEngine._join_next)
    next_follows: bool = False
    # this member's model (numel,), which a mixing group (MatchmakingConfig.group_size) averages besides the
    # vector: asked for only when the group mixes
    model: Optional[Callable[[], torch.Tensor]] = None


@dataclass(frozen=True)
class _NextJoin:
    task: asyncio.Task  # of Matchmaker.join
    version: bytes  # the state it joined with: the one a whole round leads to
    step: int
    sent_at: float  # time.monotonic()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@dataclass
class EngineStats:
    rounds_ok: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    resyncs: int = 0
    bans_voted: int = 0
    last_group_size: int = 0
    last_round_s: float = 0.0
    members_dropped_idle: int = 0  # senders this peer's reducer dropped because their bytes stopped (or link broke)
    members_dropped_late: int = 0  # senders still missing at the all-reduce deadline
    parts_dropped_idle: int = 0  # reducers that moved no bytes after our own part was reduced

    def counts(self) -> RoundCounts:
        return RoundCounts(self.rounds_ok, self.rounds_partial, self.rounds_failed, self.resyncs)


def _mixed(spec: RoundSpec, result: AllReduceResult, verdict: Optional[Verdict], group: GroupSpec, own: torch.Tensor) -> Averaged:
    """A mixing round's outcome: the vector's aggregate, and the model's with this peer's own where a part is missing."""
    numel = own.numel()
    model = result.vector[numel:]
    for part in result.missing_parts:
        start, end = spec.bounds[part]
        start, end = max(start, numel) - numel, max(end, numel) - numel
        model[start:end] = own[start:end]
    return Averaged(group, dataclasses.replace(result, vector=result.vector[:numel]), verdict, model)


class RoundEngine:
    """One per peer: owns the membership, matchmaker, all-reduce and state services."""

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        config: RoundConfig,
        run_hash: bytes,
        *,
        identity: Optional[Identity] = None,
        bans: Optional[BanBook] = None,
        behavior: Optional[Behavior] = None,
        sync_policy: Optional[SyncPolicy] = None,
        loss: Callable[[], Optional[float]] = lambda: None,
    ) -> None:
        self.transport, self.membership, self.config, self.run_hash = transport, membership, config, run_hash
        self.identity, self.bans, self.behavior = identity, bans, behavior or Behavior()
        if transport.banned is not membership.banned or (bans is not None and bans.banned is not membership.banned):
            raise ValueError("the transport, membership and ban book must share one banned set (give each the same)")
        # members this peer's reducers caught declaring oversized parts: their parts are refused, and the
        # matchmaker keeps them out of the groups it forms or joins, for a cool-off
        self.quarantine = Quarantine()
        # which peers are slow and whether this one steps down as leader: the matchmaker feeds it, the membership
        # publishes it. It announces through the membership, built before the engine (node, fixtures): so the
        # membership is handed it here, the one place it is
        self.link = LinkQuality(transport.peer_id, announce=membership.announce_soon, in_view=membership.peers)
        membership.link = self.link
        self.matchmaker = Matchmaker(
            transport, membership, config.matchmaking, run_hash, link=self.link, identity=identity,
            sync_policy=sync_policy, loss=loss, majority_state=config.verify is not None, quarantine=self.quarantine,
        )  # fmt: skip
        self.allreduce = AllReduceService(
            transport,
            registration_wait_s=config.matchmaking.join_timeout_s,
            part_idle_timeout_s=config.part_idle_timeout_s,
            quarantine=self.quarantine,
        )
        self.state = StateService(transport)
        self.reducer = self.behavior.wrap_reducer(config.make_reducer())
        self.btard: Optional[BtardService] = None
        if config.verify is not None:
            if identity is None:
                raise ValueError("verified rounds need the peer's identity to sign")
            if config.compression is Codec.UINT8:
                raise ValueError("verified rounds need compression none, fp16 or int8 (8-bit codebooks have no error bound)")
            self.exchange = ExchangeService(transport, wait_for_round_s=config.verify.phase_timeout_s)
            self.btard = BtardService(transport, self.exchange, identity)
        self._output: Optional[torch.Tensor] = None  # reused by every round: see run_round
        self._numel = 0  # of the last round's vector (its model part aside)
        self._used_rounds: dict[bytes, None] = {}  # verified round ids this peer took part in (oldest first)
        # the memory of used round ids dies with the process: groups stamped before it started are refused, so
        # a peer restarted under the same identity cannot be replayed a group it signed for in its last life
        self.started_at = self.matchmaker.wall_clock()
        self.version = b""
        self.step = 0
        # whether the state came out of a round with other peers (or from a donor of one): a state trained
        # alone (cut off) or loaded from a checkpoint ranks below it when a leader picks the state a group
        # starts from, so a healed peer that trained alone does not overwrite the swarm's
        self.together = False
        self.stats = EngineStats()
        self._groups = 0  # rounds past matchmaking: their other members count on our part
        self._next: Optional[_NextJoin] = None  # the join of the next round, sent while this one runs

    @property
    def in_group(self) -> bool:
        """Whether a round of ours is past matchmaking: leaving it now costs its other members our part."""
        return self._groups > 0

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def set_state(self, version: bytes, step: int, *, together: bool = False) -> None:
        self.version, self.step, self.together = version, step, together
        self.membership.step = step

    async def start(self) -> None:
        """Background work: keep the ban list in sync with the swarm's ban votes."""
        if self.bans is not None:
            self._ban_refresh = asyncio.create_task(refresh_forever(self.bans, interval_s=5.0), name="ban-refresh")

    async def aclose(self) -> None:
        task = getattr(self, "_ban_refresh", None)
        if task is not None:
            await _cancel(task)
        await self._drop_next()
        await self.matchmaker.aclose()

    async def run_round(self, request: RoundRequest) -> Union[Averaged, Resync]:
        """Form a group and all-reduce the request's vector with it, or learn that we must resync.

        The averaged vector lives in a buffer that the next call overwrites (fresh 40 MB buffers
        cost page faults every round): apply or copy it before the next round. A round that raises one of
        ROUND_FAILURES counts as failed; a cancelled one counts nowhere."""
        try:
            return await self._run_round(request)
        except ROUND_FAILURES:
            self.stats.rounds_failed += 1
            raise

    async def _run_round(self, request: RoundRequest) -> Union[Averaged, Resync]:
        started = time.monotonic()
        reply = await self._joined_early()
        if reply is None:
            reply = await self.matchmaker.join(version=self.version, step=self.step, together=self.together)
        return await self._run_reply(reply, request, started)

    async def leave(self) -> None:
        """Before this peer closes: a round it joined early counts on its part (and on its reduction of the
        others'), so it runs that round with nothing to contribute (weight 0; in verified rounds, which count
        every member once, it sits the round out) instead of leaving its members to wait out their deadlines."""
        reply = await self._joined_early()
        if reply is None:  # (a round joined early implies one before it, so _output is set)
            return
        if reply.group.members == [self.peer_id]:  # no member waits for our parts; a recipient hears "no state"
            self.state.abandon(reply.group.round_id)
            return
        logger.info("leaving: taking part in the round joined early, contributing nothing")
        zeros = torch.zeros(self._numel)
        if self.btard is None:
            request = RoundRequest(zeros, weight=0.0, model=lambda: zeros)
        else:
            request = RoundRequest(zeros, verification=Verification(sit_out=True))
        try:
            await self._run_reply(reply, request, time.monotonic())
        except ROUND_FAILURES + (CallFailed,) as e:
            logger.info(f"leaving: the round joined early failed ({e})")

    async def _run_reply(self, reply: JoinReply, request: RoundRequest, started: float) -> Union[Averaged, Resync]:
        if reply.kind == "resync":
            self.stats.resyncs += 1
            if reply.group.step == self.step:  # a partial round left members at one step with different parameters
                why = f"state {self.step} differs from the swarm's at the same step"
            else:
                why = f"state {self.step} is {'behind' if reply.group.step > self.step else 'ahead of'} the swarm's {reply.group.step}"
            logger.info(f"{why}: resyncing from {reply.donor[-8:]}")
            if request.next_follows:
                # the round's members join the next one while it runs; so does its recipient, with the state it
                # downloads, or under a sync policy of K it would arrive after every next group had formed
                self._join_next(reply.group, reply.group.version, reply.group.step)
            return Resync(reply.group, reply.donor)
        group = reply.group
        known = sorted(p[-8:] for p in group.members if p in self.membership.banned)
        if known:
            logger.info(f"the leader's group includes peers we banned ({known}): they take part in this round")
        self.state.joined(group.round_id)
        self._groups += 1
        if request.next_follows:
            self._join_next(group, self.version, group.step if group.mixing else self.step)
        with self.transport.round_with(group.members):
            try:
                return await self._run_group(group, started, request)
            except BaseException:  # failed or cancelled: peers told to resync from us must not wait for it
                self.state.abandon(group.round_id)
                await self._drop_next()  # nor a next group for our part
                raise
            finally:
                self._groups -= 1

    def _join_next(self, group: GroupSpec, version: bytes, step: int) -> None:
        """Join the next round now, with the state this round leads to if every part comes back, so the
        leader forms the next group while this round's parts travel: a sync round then waits one round
        trip (scatter, gather) instead of two (join, then scatter and gather). A verified group joined so is
        signed for the round it opens like any other: its members check it when they run it. See
        docs/algorithms.md §10. `version` and `step` are the state `group` starts from."""
        version = next_version(version, group.round_id, ())
        step = step + 1
        task = asyncio.create_task(
            self.matchmaker.join(version=version, step=step, together=len(group.members) > 1), name="join-next"
        )
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (a failure is read, or dropped, later)
        self._next = _NextJoin(task, version, step, time.monotonic())

    async def _joined_early(self) -> Optional[JoinReply]:
        """The next group, joined during the last round, if this peer's state is the one it joined with (the
        last round came back whole) and none of its members was found dead since; else None: join anew."""
        early, self._next = self._next, None
        if early is None:
            return None
        if (self.version, self.step) != (early.version, early.step):
            await self._drop(early)
            return None
        try:
            reply = await early.task
        except ROUND_FAILURES + (CallFailed,):
            return None
        if reply.kind != "group":
            return None
        # (a mixing group's members hold versions of their own, and may be a few steps behind its step)
        if reply.group.mixing:
            wrong = not 0 <= reply.group.step - self.step <= MIXING_LAG
        else:
            wrong = (reply.group.version, reply.group.step) != (self.version, self.step)
        if wrong:
            await self._drop(early)
            return None
        # only what we learned after joining: a peer we suspected before, which the leader put in the group
        # on its own join since (a restarted peer), is alive; dropping the group on our older evidence
        # alone left its other members waiting for our part, round after round
        gone = [p for p in reply.group.members if p != self.peer_id and self.membership.suspected_since(p, early.sent_at)]
        if gone:
            logger.info(f"the next group, joined early, holds peers found dead since ({sorted(p[-8:] for p in gone)}); joining anew")
            await self._drop(early)
            return None
        return reply

    async def _drop_next(self) -> None:
        early, self._next = self._next, None
        if early is not None:
            await self._drop(early)

    async def _drop(self, early: _NextJoin) -> None:
        """Drop a join of the next round; a group it got will not have us: peers told to resync from us
        after that round hear so at once, instead of waiting for us to join it."""
        if early.task.done() and not early.task.cancelled() and early.task.exception() is None:
            reply = early.task.result()
            if reply.kind == "group":
                self.state.abandon(reply.group.round_id)
        await _cancel(early.task)

    async def _run_group(self, group: GroupSpec, started: float, request: RoundRequest):
        vector, weight = request.vector, request.weight
        if request.prepare is not None:
            vector, weight = await request.prepare(group)
        self._numel = vector.numel()
        own_model = None
        if group.mixing:  # the vector, then the model: one all-reduce of both
            if request.model is None:
                raise ValueError("a mixing round averages models too: the request needs its model")
            own_model = request.model().detach().to("cpu", torch.float32).reshape(-1)
            if own_model.numel() != vector.numel():
                raise ValueError(f"model of {own_model.numel()} values beside a vector of {vector.numel()}")
            vector = torch.cat([vector.detach().to("cpu", torch.float32).reshape(-1), own_model])
        spec = RoundSpec(
            round_id=group.round_id,
            members=tuple(group.members),
            numel=vector.numel(),
            codec=self.config.compression,
            deadline=time.monotonic() + self.config.allreduce_timeout_s,
            reducers=group.reducers if self.btard is None else 0,  # verified rounds: every member reduces a part
        )
        if self._output is None or self._output.numel() != vector.numel():
            self._output = torch.empty(vector.numel())
        verdict = None
        if self.btard is None:
            if request.verification.sit_out:
                raise ValueError("only verified rounds let a member sit out; unverified ones weight its contribution")
            result = await self.allreduce.run(
                spec, vector, self.reducer, weight=weight, call_timeout_s=self.config.allreduce_timeout_s + 10, out=self._output
            )
        else:
            if weight != 1.0:  # the fixed-point check and the reports assume every member counts once
                raise ValueError("verified rounds weight every member 1 (BTARD-SGD); got a weighted contribution")
            result, verdict = await self._verified_round(group, spec, vector, request.verification)
        if result.missing_parts or result.dropped_senders:
            self.stats.rounds_partial += 1
        else:
            self.stats.rounds_ok += 1
        self.stats.members_dropped_idle += len(result.idle_senders)
        self.stats.members_dropped_late += len(result.late_senders)
        self.stats.parts_dropped_idle += len(result.idle_parts)
        # a member whose own bytes to us stopped, or that left our probes unanswered as a reducer (dead, frozen,
        # cut off), is not waited for by the next group
        # this peer forms, nor chosen as leader, until it joins again (which clears the suspicion) or ttl_s
        # passes. Reducers whose reply was late are not suspected: under packet loss every reducer waiting
        # on the lossy sender is late, and suspecting them all left this peer training in a group of one.
        for peer in (*result.idle_senders, *result.unreachable):
            self.membership.suspect(peer, for_s=self.membership.ttl_s)
        self.link.note_round(group.members, result.slow_senders)
        self.stats.last_group_size = len(group.members)
        self.stats.last_round_s = time.monotonic() - started
        if own_model is None:
            return Averaged(group, result, verdict)
        return _mixed(spec, result, verdict, group, own_model)

    async def _verified_round(self, group: GroupSpec, spec: RoundSpec, vector: torch.Tensor, verification: Verification):
        """Phases 2–6 with BTARD: commit, data with signed statements, verify, judge, ban."""
        statement = self._check_group(group)
        if self.behavior.silent:
            raise RoundAbortedError("silent by design (attack)")
        # a member sitting out sends zeros: its parts only ask for the aggregates (the same call)
        sit_out = verification.sit_out
        vector = torch.zeros(vector.numel()) if sit_out else vector.detach().to("cpu", torch.float32).contiguous().view(-1)
        exchange = self.exchange
        exchange.open_round(spec.round_id, spec.members)
        vr = None
        try:
            vr = VerifiedRound(
                self.btard,
                round_id=spec.round_id,
                members=spec.members,
                group_statement=statement,
                bounds=spec.bounds,
                codec=spec.codec,
                config=self.config.verify,
                behavior=self.behavior,
                vector=vector,
                recompute=verification.recompute,
                recompute_s=verification.recompute_s,
                target=verification.target if sit_out else None,
            )
            t0 = time.monotonic()
            await vr.commit([encode(vector[a:b], spec.codec) for a, b in spec.bounds], sits_out=sit_out)
            t_commit = time.monotonic() - t0
            skip = frozenset(i for i, p in enumerate(spec.members) if p not in vr.committed)
            # the data phase's deadline starts now: waiting for late commitments must not eat into it
            spec = dataclasses.replace(spec, deadline=time.monotonic() + self.config.allreduce_timeout_s)
            if self.peer_id not in vr.committed:
                raise RoundAbortedError("our commitment was not collected")
            sent = self.behavior.sent_vector(vector)
            result = await self.allreduce.run(
                spec, sent, self.reducer, weight=self.behavior.claimed_weight(1.0), call_timeout_s=self.config.allreduce_timeout_s + 10,
                out=self._output, guard=vr, skip=skip,
            )  # fmt: skip
            t1 = time.monotonic()
            verdict = await vr.verify(result.vector, result.own_rows, result.own_received)
            if verdict.clean and result.recycle_rows is not None:  # nobody needs the parts as evidence
                result.own_rows = None
                result.recycle_rows()
            logger.debug(
                f"round {spec.round_id.hex()[:8]}: commit {t_commit:.3f} s, data {result.duration_s:.3f} s, "
                f"verify {time.monotonic() - t1:.3f} s"
            )
        finally:
            if vr is not None:
                await vr.close()  # a failed data phase leaves projections waiting for a seed
            exchange.close_round(spec.round_id)
        for part in verdict.bad_parts:  # aggregates of convicted reducers, or disputed ones, are not applied
            a, b = spec.bounds[part]
            result.vector[a:b] = 0.0
        result.missing_parts = tuple(sorted(set(result.missing_parts) | verdict.bad_parts))
        # the round's own verdict counts its group as the leader sent it; the swarm needs the commitments
        self.membership.banned.update(verdict.banned)
        if verdict.votes and self.bans is not None:
            self.stats.bans_voted += len(verdict.votes)
            await self.bans.publish(verdict.votes)
        return result, verdict

    def _check_group(self, group: GroupSpec) -> Signed:
        """A verified round needs the leader's signed group statement, listing exactly these members, for
        a round id this peer never took part in: two different statements it signed for one round id
        are proof of equivocation, so a leader that handed out a round id again could get it banned.
        Round ids are remembered in memory, as far back as statements are fresh and this process lived."""
        leader = self.matchmaker.last_leader
        signed = unpack(group.statement, Signed, peer=leader)
        _, body = open_statement(signed, GroupBody, kind="group", round_id=group.round_id, sender=leader)
        if list(body.members) != list(group.members):
            raise PeerProtocolError("group statement lists other members", peer=leader)
        age = self.matchmaker.wall_clock() - body.issued_at
        if not abs(age) <= GROUP_FRESH_S:  # the memory of used round ids reaches back that far
            raise PeerProtocolError(
                f"group statement issued {age:.0f} s ago by the leader's clock (replayed, or a clock off by over"
                f" {GROUP_FRESH_S:.0f} s: check both machines' time)",
                peer=leader,
            )
        if body.issued_at < self.started_at:
            raise PeerProtocolError(
                f"group statement issued {self.started_at - body.issued_at:.1f} s before this peer started (replayed,"
                " or the leader's clock is behind ours)",
                peer=leader,
            )
        if group.round_id in self._used_rounds:
            raise PeerProtocolError("the leader reused a round id", peer=leader)
        self._used_rounds[group.round_id] = None
        while len(self._used_rounds) > USED_ROUNDS:
            self._used_rounds.pop(next(iter(self._used_rounds)))
        return signed

    async def completed(self, averaged: Averaged, snapshot_fn) -> None:
        """Advance the version after the caller applied `averaged`; publish state if we are a donor.
        `snapshot_fn()` returns the tensors to hand over (called only when needed)."""
        contributors = len(averaged.group.members) - len(averaged.result.dropped_senders)
        self.set_state(
            next_version(self.version, averaged.group.round_id, averaged.result.missing_parts),
            averaged.group.step + 1,  # (a member of a mixing group a few steps behind takes the group's step)
            together=contributors > 1,
        )
        self.membership.state = "online"
        # every member serves the state after a round with recipients: they download chunks of it from
        # several members at once; in verified runs each member's copy is also a witness of the donor's
        if averaged.group.donations:
            tensors = self.behavior.served_state(snapshot_fn())
            await self.state.publish(StateSnapshot(step=self.step, version=self.version, tensors=tensors), averaged.group.round_id)

    async def fetch_state(self, resync: Resync, template: dict[str, torch.Tensor]) -> StateSnapshot:
        snapshot = await self.state.fetch_from(
            self._donors(resync), resync.group.round_id, template, timeout_s=self.config.state_timeout_s
        )
        if snapshot.step != resync.group.step + 1:
            raise PeerProtocolError(f"donor sent step {snapshot.step}, expected {resync.group.step + 1}", peer=resync.donor)
        if self.btard is not None:
            await self._check_state(resync, snapshot)
        return snapshot

    def _donors(self, resync: Resync) -> list[str]:
        """The designated donor, then other members of its round in an order of this peer's own, so that
        recipients of one round spread over its members."""
        others = [p for p in resync.group.members if p not in (resync.donor, self.peer_id)]
        others.sort(key=lambda p: hashlib.sha256(f"{self.peer_id} {p}".encode()).digest())
        return [resync.donor, *others][: max(1, self.config.state_donors)]

    async def fetch_swarm_state(self, template: dict[str, torch.Tensor]) -> Optional[StateSnapshot]:
        """A newcomer's download of the swarm's state: join as a peer holding no state (an empty
        version, which no member holds) and take a donor's state after that round. None when no
        peer with a state was ready to form a round with us: there is nothing to download."""
        reply = await self.matchmaker.join(version=b"", step=0)
        if reply.kind != "resync":
            return None
        self.stats.resyncs += 1
        return await self.fetch_state(Resync(reply.group, reply.donor), template)

    async def _check_state(self, resync: Resync, snapshot: StateSnapshot) -> None:
        """Accept the donor's state only if most of its round's members hold the same (up to rounding):
        each sends its own snapshot's fingerprint along directions drawn only now, after the download."""
        group, donor = resync.group, resync.donor
        others = [p for p in group.members if p not in (donor, self.peer_id)]
        seed = os.urandom(32)
        tensors = list(snapshot.tensors.values())
        numels = [t.numel() for t in tensors]
        mine = await asyncio.get_running_loop().run_in_executor(None, state_fingerprint, seed, tensors)
        timeout_s = 3 * self.config.verify.phase_timeout_s
        checks = [asyncio.ensure_future(self.state.check(p, group.round_id, seed, timeout_s=timeout_s)) for p in others]
        agree = 1  # the donor
        try:
            for done in asyncio.as_completed(checks):
                try:
                    theirs = await done
                except (CallFailed, RoundAbortedError, PeerProtocolError):
                    continue
                agree += fingerprints_match(mine, theirs, numels, self.config.verify.contribution_rtol)
                if 2 * agree > len(group.members):
                    return
        finally:
            for check in checks:
                check.cancel()
            await asyncio.gather(*checks, return_exceptions=True)
        raise PeerProtocolError(
            f"state refused: {agree - 1} of the round's {len(others)} other members hold the same", peer=donor
        )
