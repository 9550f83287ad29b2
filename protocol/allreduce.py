"""Phases 3–5 of a round: butterfly all-reduce of one flat vector over a formed group.

Member i cuts its vector into one part per member, sends part j to member j and gets
back the aggregate of part j (scatter and gather share one call); as reducer of part i
it collects everyone's part i, aggregates it with the configured rule once all members
sent theirs or the deadline passed, and answers every waiting sender with the same
bytes. Bytes per peer: 2·(n−1)/n of the vector. A member that dies or stalls is dropped:
its part is aggregated without it, and if it was a reducer the part it owned comes
back missing (reported, zero-filled) instead of stalling the others. Dead, frozen and
cut-off members are noticed by their closed connection or by bytes that stop flowing
(`part_idle_timeout_s`), not by waiting out the deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Optional

import torch

from phalanx.errors import AggregationInputError, PeerProtocolError, RoundAbortedError
from phalanx.protocol.channel import Activity, Hasher
from phalanx.protocol.codec import MAX_PART_NUMEL, Codec, check_payload_size, decode, encode, encoded_size_bound
from phalanx.protocol.patience import Patience
from phalanx.protocol.quarantine import Quarantine
from phalanx.protocol.reduction import Reduction
from phalanx.protocol.round_spec import (
    AggregateHeader,
    AliveQuery,
    AliveReply,
    AllReduceResult,
    PartGuard,
    PartHeader,
    Reducer,
    RoundSpec,
)
from phalanx.protocol.transport import SMALL_CALL_BYTES, CallFailed, Landing, Transport
from phalanx.protocol.waiting import WaitingCalls
from phalanx.security.wire import pack, unpack

logger = logging.getLogger(__name__)

PART_METHOD = "part"
ALIVE_METHOD = "alive"
REDUCER_PROBE_S = 1.0  # once our part is reduced, a reducer whose reply has not come is probed this often ...
REDUCER_ALIVE_S = 4.0  # ... and given up on when a probe is not answered within this (cut off, frozen)
LOOP_HELD_UP_S = 0.5  # a wait for parts that ended this much past its time: this process was held up
MAX_WAITING_CALLS = 256  # calls for rounds we have not registered yet, held at most this many (see WaitingCalls)
# The transport's limit on a part, checked before its round is known (the sink then holds it to the round's
# exact bound): the largest codec's bytes for the most values a part can hold.
MAX_PART_BYTES = max(encoded_size_bound(MAX_PART_NUMEL, codec) for codec in Codec)
# A member that declared more bytes for its part than its codec can take (to make reducers allocate them)
# is kept out of this peer's groups this long: a dozen rounds of a few seconds, and an honest peer never does it.
OVERSIZED_QUARANTINE_S = 60.0
CLOSED_ROUNDS_KEPT = 64  # closed rounds whose counted senders a probe may still ask about
ANSWERS_KEPT = 256  # replies to small parts of forgotten rounds, kept for a part sent again (a few rounds' worth)


class AllReduceService:
    """Routes incoming parts to the round they belong to; one per peer."""

    def __init__(
        self,
        transport: Transport,
        *,
        registration_wait_s: float = 30.0,
        part_idle_timeout_s: Optional[float] = None,
        quarantine: Optional[Quarantine] = None,
    ) -> None:
        """`quarantine`: peers whose parts are refused; senders of oversized parts go there (the round
        engine shares it with its matchmaker, which keeps them out of the next groups)."""
        self.transport = transport
        self.registration_wait_s = registration_wait_s
        # None: wait for every part until the deadline; else the upper bound of each sender's own limit, and
        # what a sender waits for a reducer (which it cannot know the patience of)
        self.part_idle_timeout_s = part_idle_timeout_s
        self.patience = Patience(part_idle_timeout_s)
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self._rounds: dict[bytes, Reduction] = {}
        self._registered: dict[bytes, asyncio.Event] = {}
        self._waiting = WaitingCalls(MAX_WAITING_CALLS)
        self._spare_rows: dict[tuple[int, int], torch.Tensor] = {}  # fresh memory costs page faults every round
        # closed rounds: their members and the senders counted, for probes of senders we left out
        self._closed: dict[bytes, tuple[tuple[str, ...], frozenset[int]]] = {}
        # forgotten rounds' small parts, by (sender, part header: it names the round): the part's digest and
        # the reply it got (see Reduction.digests); a part sent again comes with the very same header
        self._answered: dict[tuple[str, bytes], tuple[bytes, tuple[bytes, bytes | memoryview]]] = {}
        transport.register(PART_METHOD, self._serve_part, max_payload=MAX_PART_BYTES, sink=self._part_sink)
        transport.register(ALIVE_METHOD, self._serve_alive, max_payload=0)

    async def _serve_alive(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        """Answers a probe; with a round id, also whether we still mean to answer `peer`'s part of it."""
        if not header:
            return b"", b""
        return pack(AliveReply(waiting=self._waiting_for(peer, unpack(header, AliveQuery, peer=peer).round_id))), b""

    def _waiting_for(self, peer: str, round_id: bytes) -> bool:
        """False once `peer`'s part of `round_id` can get no aggregate from us: we stopped waiting for it
        (its bytes stopped, it was refused) or closed the round without it. True for a round we do not
        know (not started yet, or long forgotten): the caller's other limits decide then."""
        reduction = self._rounds.get(round_id)
        if reduction is not None:
            members, counted, closed = reduction.spec.members, reduction.received, reduction.closed
            if peer not in members:
                return True
            index = members.index(peer)
            return index in counted or (not closed and index not in reduction.refused)
        if round_id in self._closed:
            members, counted = self._closed[round_id]
            return peer not in members or members.index(peer) in counted
        return True

    async def _probe(self, peer: str, round_id: bytes) -> bool:
        """Whether `peer`, the reducer of one of our parts, stopped waiting for it (CallFailed: no answer)."""
        reply, _ = await self.transport.call(
            peer, ALIVE_METHOD, pack(AliveQuery(round_id=round_id)), max_reply_payload=0, timeout_s=REDUCER_ALIVE_S
        )
        return bool(reply) and not unpack(reply, AliveReply, peer=peer).waiting

    async def run(
        self,
        spec: RoundSpec,
        vector: torch.Tensor,
        reducer: Reducer,
        *,
        weight: float = 1.0,
        call_timeout_s: float,
        out: Optional[torch.Tensor] = None,
        guard: Optional[PartGuard] = None,
        skip: frozenset[int] = frozenset(),
    ) -> AllReduceResult:
        """All-reduce `vector` (numel,) with the group in `spec`; this peer must be a member.
        The result is written into `out` (numel,) float32 when given (callers reuse one buffer).
        Parts whose reducer is in `skip` are not sent and come back missing."""
        started = time.monotonic()
        sent0, recv0 = self.transport.stats.bytes_sent, self.transport.stats.bytes_received
        me = spec.members.index(self.transport.peer_id)
        bounds = spec.bounds
        vector = vector.detach().to("cpu", torch.float32).contiguous().view(-1)
        if vector.numel() != spec.numel:
            raise ValueError(f"vector has {vector.numel()} elements, the round agreed on {spec.numel}")
        lo, hi = bounds[me]
        shape = (len(spec.members), hi - lo)
        rows = self._spare_rows.pop(shape, None)
        reduction = Reduction(spec, me, reducer, torch.empty(shape) if rows is None else rows, torch.zeros(shape[0]))
        reduction.guard = guard
        reduction.result = asyncio.get_running_loop().create_future()
        reducing = spec.reduces(me)
        if reducing:
            reduction.claim(me)
            reduction.add(me, vector[lo:hi], weight)
            for i in skip:
                reduction.refuse(i)
            for i in reduction.pending():  # every other member starts sending as soon as it has the group, as we did
                reduction.activity[i] = Activity(on_broken=lambda i=i: reduction.broken(i))
        else:  # nobody can dial us: we reduce nothing, and nobody sends us anything
            reduction.received = set(range(len(spec.members)))
            reduction.closed = True
            reduction.result.set_result(torch.empty(0))
        self._rounds[spec.round_id] = reduction
        self._registered.setdefault(spec.round_id, asyncio.Event()).set()
        if out is not None and (out.shape != (spec.numel,) or out.dtype != torch.float32 or out.device.type != "cpu"):
            raise ValueError(f"out must be a CPU float32 tensor of shape ({spec.numel},)")
        output = torch.empty(spec.numel) if out is None else out
        missing: list[int] = []
        idle_parts: list[int] = []
        unreachable: list[int] = []
        try:
            reduce_task = asyncio.create_task(self._reduce(reduction) if reducing else _nothing())
            others = [j for j in range(len(spec.members)) if j != me and j not in skip and spec.reduces(j)]
            activities = {j: Activity() for j in others}
            calls = {
                j: asyncio.ensure_future(
                    self._send_part(spec, j, vector[a:b], weight, output[a:b], call_timeout_s, guard, activities[j])
                )
                for j, (a, b) in ((j, bounds[j]) for j in others)
            }  # fmt: skip
            # verified rounds get a late reducer's aggregate relayed by the others (see _reply_or_relayed)
            watch = self.part_idle_timeout_s if guard is None else None
            probe = (lambda j: self._probe(spec.members[j], spec.round_id)) if watch is not None else None
            idle_parts, unreachable, dropped_us = await _await_calls(
                calls, activities, reduce_task, watch, silent=reduction.idle, probe=probe
            )
            outcomes = [
                _outcome(calls[j], j in idle_parts, watch, j in reduction.idle, j in unreachable, j in dropped_us)
                for j in others
            ]
            gathered = time.monotonic()
            for j in sorted(skip - {me}):
                missing.append(j)
                output[bounds[j][0] : bounds[j][1]] = 0.0
            for j, outcome in zip(others, outcomes):
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, asyncio.CancelledError):
                        raise outcome
                    logger.info(f"part {j} (reducer {spec.members[j][-8:]}) failed: {outcome}")
                    missing.append(j)
                    output[bounds[j][0] : bounds[j][1]] = 0.0
            own = await reduce_task
            if guard is None and others and reduction.late and reduction.received == {me} and set(others) <= set(missing):
                # Nothing from anyone, and the deadline passed: a peer that was frozen (SIGSTOP, a laptop lid)
                # or cut off, not a group that lost members. Its "average" would be its own stale part alone.
                raise RoundAbortedError(
                    "no other member's bytes arrived before the deadline (was this peer frozen or cut off?)"
                )
            output[lo:hi] = own
            if reducing:
                logger.debug(
                    f"round {spec.round_id.hex()[:8]}: parts back after {gathered - started:.3f} s, own part reduced after "
                    f"{reduction.reduced_at - started:.3f} s (all parts in after {reduction.complete_at - started:.3f} s)"
                )
        finally:
            # keep serving replies that are in flight, then forget the round (at once when every member has its
            # reply: with rounds of a few seconds, 5 s of kept aggregates would be copies of the vector held)
            reduction.finished = True
            if guard is None and reduction.all_replied():
                self._forget(spec.round_id)
            else:
                asyncio.get_running_loop().call_later(5.0, self._forget, spec.round_id)
            if guard is None and reducing:
                self._recycle(reduction)
        return AllReduceResult(
            vector=output,
            missing_parts=tuple(missing),
            dropped_senders=tuple(spec.members[i] for i in range(len(spec.members)) if i not in reduction.received),
            contributors=len(reduction.received) if reducing else 0,
            bytes_sent=self.transport.stats.bytes_sent - sent0,
            bytes_received=self.transport.stats.bytes_received - recv0,
            duration_s=time.monotonic() - started,
            idle_senders=tuple(spec.members[i] for i in sorted(reduction.idle)),
            late_senders=tuple(spec.members[i] for i in sorted(reduction.late)),
            idle_parts=tuple(idle_parts),
            unreachable=tuple(spec.members[j] for j in unreachable),
            slow_senders=tuple(spec.members[i] for i in reduction.slow(started)),
            own_rows=reduction.rows if guard is not None else None,
            own_received=tuple(reduction.counted),
            own_value=output[lo:hi],
            recycle_rows=(lambda: self._recycle(reduction)) if guard is not None else None,
        )

    def has_round(self, round_id: bytes) -> bool:
        """Whether this peer has started (and not yet forgotten) the data phase of `round_id`."""
        return round_id in self._rounds

    def _recycle(self, reduction: Reduction) -> None:
        """Keep the rows for the next round, unless a late part may still be landing in them."""
        if reduction.closed and not reduction.receiving:
            self._spare_rows = {tuple(reduction.rows.shape): reduction.rows}

    def _forget(self, round_id: bytes) -> None:
        reduction = self._rounds.pop(round_id, None)
        self._registered.pop(round_id, None)
        if reduction is not None:
            self._closed[round_id] = (tuple(reduction.spec.members), frozenset(reduction.received))
            while len(self._closed) > CLOSED_ROUNDS_KEPT:
                self._closed.pop(next(iter(self._closed)))
            for i, (header, reply) in reduction.answers.items():
                self._answered[(reduction.spec.members[i], header)] = (reduction.digests[i], reply)
            while len(self._answered) > ANSWERS_KEPT:
                self._answered.pop(next(iter(self._answered)))
            reduction.release()

    async def _send_part(self, spec, j, part, weight, out, timeout_s, guard: Optional[PartGuard], activity: Activity) -> None:
        payload = encode(part, spec.codec)
        signature = guard.sign_part(j, payload, weight) if guard is not None else b""
        header = PartHeader(
            round_id=spec.round_id, part=j, numel=part.numel(), codec=spec.codec.value, weight=weight, signature=signature
        )
        raw = spec.codec is Codec.NONE  # the reply's bytes can land in `out` directly
        hasher = guard.hasher() if guard is not None else None

        def announced(raw: bytes) -> None:  # verified rounds: the reducer's signed statement precedes the bytes
            guard.announced(j, unpack(raw, AggregateHeader, peer=spec.members[j]))

        call = self.transport.call(
            spec.members[j],
            PART_METHOD,
            pack(header),
            payload,
            max_reply_payload=encoded_size_bound(part.numel(), spec.codec),
            timeout_s=timeout_s,
            reply_into=_bytes_of(out) if raw else None,
            reply_hasher=hasher,
            on_reply_header=announced if guard is not None else None,
            activity=activity,
        )
        if guard is None:
            reply_header, reply = await call
            unpack(reply_header, AggregateHeader, peer=spec.members[j])
        else:
            reply, relayed = await _reply_or_relayed(call, guard, j, spec.members[j], hasher)
            if raw and relayed:  # the reducer's reply never landed in `out`
                _bytes_of(out)[:] = reply
        if not raw:
            out.copy_(decode(reply, spec.codec, part.numel(), peer=spec.members[j]))
        if guard is not None:
            guard.landed(j, out)

    async def _wait_for_parts(self, reduction: Reduction) -> None:
        """Until every part is in or given up on: a sender whose bytes stopped for its idle limit (none
        came, or they stopped mid-part; see protocol/patience.py) is dropped then; the rest at the deadline."""
        members = reduction.spec.members
        woke, due = time.monotonic(), None
        while not reduction.complete.is_set():
            wait = reduction.spec.deadline - woke
            if wait <= 0:
                reduction.late.update(reduction.pending())
                return
            # this process itself was held up (descheduled, stopped): the bytes that came meanwhile are
            # still unread, so every sender looks idle; read them before judging anyone
            held_up = due is not None and woke - due > LOOP_HELD_UP_S
            for i in reduction.pending():
                limit = self.patience.limit(members[i])
                if limit is None:
                    continue
                idle = reduction.activity[i].idle_s() if i in reduction.activity else 0.0
                if idle >= limit and not held_up:
                    reduction.drop_idle(i, f"no bytes for {idle:.1f} s; its limit {limit:.1f} s")
                else:
                    wait = min(wait, max(limit - idle, 0.0))
            if reduction.complete.is_set():
                return
            wait = max(wait, 0.01 if not held_up else 0.05)
            due = time.monotonic() + wait
            try:
                await asyncio.wait_for(reduction.complete.wait(), timeout=wait)
            except TimeoutError:
                pass
            woke = time.monotonic()

    def _note_patience(self, reduction: Reduction) -> None:
        """What each sender whose part came in whole kept us waiting this round, for its next limits."""
        for i in reduction.received - {reduction.my_index}:
            activity = reduction.activity.get(i)
            if activity is not None:
                self.patience.note(reduction.spec.members[i], activity.longest)

    async def _reduce(self, reduction: Reduction) -> torch.Tensor:
        await self._wait_for_parts(reduction)
        reduction.closed = True
        self._note_patience(reduction)
        reduction.complete_at = time.monotonic()
        got = sorted(reduction.received)
        if reduction.guard is not None:
            got = reduction.guard.counted(got)
        reduction.counted = got
        if len(got) == len(reduction.spec.members):
            rows, weights = reduction.rows, reduction.weights  # everyone's part arrived: no copy
        else:
            rows, weights = reduction.rows[got], reduction.weights[got]
        try:
            # torch releases the GIL: aggregate off the event loop
            value = await asyncio.get_running_loop().run_in_executor(None, reduction.reducer, rows, weights)
        except AggregationInputError as e:
            reduction.result.set_exception(RoundAbortedError(f"aggregation failed: {e}"))
            reduction.result.exception()  # reported by the raise below; a member that asked for the aggregate gets it too
            raise RoundAbortedError(f"aggregation failed: {e}") from e
        reduction.reduced_at = time.monotonic()
        if value.dim() == 2:  # a per-member rule (ClippedGossip): row r is the result for member got[r]
            for row, index in zip(value, got):
                head = pack(AggregateHeader(contributors=len(got)))
                reduction.encoded_for[index] = (head, encode(row, reduction.spec.codec))
            value = value[got.index(reduction.my_index)]
        payload = encode(value, reduction.spec.codec)
        statement = b"" if reduction.guard is None else reduction.guard.sign_aggregate(reduction.my_index, payload, got)
        reduction.encoded = (pack(AggregateHeader(contributors=len(got), statement=statement)), payload)
        reduction.result.set_result(value)
        # what we send is what the others decode: keep our own part bit-identical to theirs
        if reduction.spec.codec is not Codec.NONE:
            value = decode(reduction.encoded[1], reduction.spec.codec, value.numel())
        if reduction.guard is not None:
            reduction.guard.landed(reduction.my_index, value, rows, got)
        return value

    async def _checked_part(self, peer: str, header: bytes) -> tuple[PartHeader, Reduction, int]:
        head = unpack(header, PartHeader, peer=peer)
        reduction = await self._wait_for_round(head.round_id, peer)
        spec = reduction.spec
        if peer not in spec.members:
            raise PeerProtocolError("sent a part for a round it is not a member of", peer=peer)
        lo, hi = spec.bounds[reduction.my_index]
        if head.part != reduction.my_index or head.numel != hi - lo or head.codec != spec.codec.value:
            raise PeerProtocolError(
                f"part header (part={head.part}, numel={head.numel}, codec={head.codec[:8]}) does not match the round",
                peer=peer,
            )
        return head, reduction, spec.members.index(peer)

    async def _part_sink(self, peer: str, header: bytes, payload_len: int) -> Landing:
        """Check a part before its payload is read, its declared size above all: the transport allocates what
        the sender declares. Raw float32 parts are received straight into their row (and, in verified rounds,
        hashed record by record on the way). A sender that declared more than its codec can take for the
        part is quarantined (verified rounds: one that signed such a size is proven, see `check_size`)."""
        if (peer, bytes(header)) in self._answered:
            return Landing()  # the part of a forgotten round sent again: compared once its bytes are in
        head, reduction, index = await self._checked_part(peer, header)
        if peer in self.quarantine:
            _refuse(reduction, index)
            raise PeerProtocolError(f"in quarantine for {self.quarantine.remaining_s(peer):.0f} s more", peer=peer)
        try:
            if reduction.guard is not None:
                reduction.guard.check_size(index, reduction.my_index, head, payload_len)
            check_payload_size(payload_len, head.numel, reduction.spec.codec, peer=peer)
        except PeerProtocolError:
            _refuse(reduction, index)
            if payload_len > encoded_size_bound(head.numel, reduction.spec.codec):
                logger.info(
                    f"round {reduction.spec.round_id.hex()[:8]}: {peer[-8:]} declared {payload_len} bytes for a part "
                    f"of {head.numel} values; quarantined for {OVERSIZED_QUARANTINE_S:.0f} s"
                )
                self.quarantine.add(peer, OVERSIZED_QUARANTINE_S)
            raise
        if index in reduction.digests:
            return Landing()  # most likely the same part sent again: compared once its bytes are in
        reduction.claim(index)
        hasher = None
        if reduction.guard is not None:
            hasher = reduction.hashers[index] = reduction.guard.hasher()
        into = _bytes_of(reduction.rows[index]) if reduction.spec.codec is Codec.NONE else None
        return Landing(into, hasher, reduction.activity.get(index))

    async def _serve_part(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes | memoryview]:
        before = self._answered.get((peer, bytes(header)))
        if before is not None:
            digest, reply = before
            _check_same_part(digest, header, payload, peer)
            return reply
        head, reduction, index = await self._checked_part(peer, header)
        if index in reduction.digests:
            _check_same_part(reduction.digests[index], header, payload, peer)
            logger.info(f"round {reduction.spec.round_id.hex()[:8]}: {peer[-8:]} sent its part again (its reply was lost); answering again")
            if index in reduction.answers:
                return reduction.answers[index][1]
        else:
            if reduction.guard is not None:
                try:
                    hasher = reduction.hashers.pop(index, None)
                    if hasher is None:
                        raise PeerProtocolError("part arrived without passing the sink", peer=peer)
                    reduction.guard.accept_part(index, reduction.my_index, payload, head, hasher.digest())
                except PeerProtocolError:
                    reduction.refuse(index)
                    raise
            if len(payload) <= SMALL_CALL_BYTES:
                reduction.digests[index] = _part_digest(header, payload)
            if reduction.spec.codec is Codec.NONE:
                reduction.add(index, None, head.weight)  # the sink already put the bytes in place
            else:
                reduction.add(index, decode(payload, reduction.spec.codec, head.numel, peer=peer), head.weight)
        await asyncio.shield(reduction.result)
        if reduction.guard is not None:
            reply = reduction.guard.reply_for(index, *reduction.encoded)
        else:
            reply = reduction.encoded_for.get(index, reduction.encoded)
            reduction.replied.add(index)
        if index in reduction.digests:
            reduction.answers[index] = (bytes(header), reply)
        if reduction.guard is None and reduction.finished and reduction.all_replied():
            self._forget(reduction.spec.round_id)  # the transport holds the reply until it is sent
        return reply

    async def _wait_for_round(self, round_id: bytes, peer: str) -> Reduction:
        """The round `round_id`, once this peer starts it: a sender may be a step ahead. Such calls wait in a
        list capped in all and per caller, so made-up round ids from one peer cannot lock out the others."""
        reduction = self._rounds.get(round_id)
        if reduction is not None:
            return reduction
        with self._waiting.hold(peer):
            event = self._registered.setdefault(round_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout=self.registration_wait_s)
            except TimeoutError:
                if self._registered.get(round_id) is event and not event.is_set():
                    del self._registered[round_id]
                raise RoundAbortedError("unknown round") from None
        reduction = self._rounds.get(round_id)
        if reduction is None:
            raise RoundAbortedError("round already finished")
        return reduction


async def _await_calls(
    calls: dict[int, asyncio.Future],
    activities: dict[int, Activity],
    reduced: asyncio.Task,
    idle_s: Optional[float],
    silent: frozenset[int] | set[int] = frozenset(),
    probe: Optional[Callable[[int], Awaitable[bool]]] = None,
) -> tuple[list[int], list[int], list[int]]:
    """Wait for the calls to the reducers; returns the parts whose call was given up because it stalled,
    those of them whose reducer stopped answering probes, and those whose reducer answered that it
    stopped waiting for our part.

    Until this peer's own part is reduced, a reducer may rightly be waiting for a slow sender. After
    that, every live reducer has its parts or drops its stragglers within `idle_s` of their last byte
    (which may have reached it later than us): a call on which no byte moved for twice that since then
    (the reducer is dead, frozen or cut off) is cancelled. A reducer in `silent` (our own reduction
    already dropped it as a sender: its bytes to us stopped or its connection broke) whose call has
    moved no byte for `idle_s` is dead, frozen or cut off for certain: a live one, however slow, keeps
    sending us its part. Its call is cancelled at once, not waited for twice `idle_s` more.
    A reducer whose reply is still missing REDUCER_PROBE_S after that is probed (`probe(j)`) every
    REDUCER_PROBE_S; one that leaves a probe unanswered for REDUCER_ALIVE_S is cut off or frozen, and
    its call is cancelled then: a live reducer waiting on a slow sender answers its probes. One that
    answers it stopped waiting for our part (`probe(j)` is True: our bytes to it stalled, or came too
    late) will send no aggregate, and its call is cancelled at once: a lossy link from us to it, whose
    bytes the reducer never saw, would have been waited out for the whole idle limit.
    """
    pending = set(calls.values())
    stalled: list[int] = []
    unreachable: list[int] = []
    dropped_us: list[int] = []
    probes: dict[int, asyncio.Task] = {}
    try:
        while pending and (idle_s is None or not reduced.done()):
            waiters = pending if idle_s is None else pending | {reduced}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            pending = {c for c in pending if not c.done()}
        since, limit_s = time.monotonic(), 2 * (idle_s or 0.0)
        next_probe = since + REDUCER_PROBE_S
        while pending:
            wait = limit_s
            now = time.monotonic()
            for j, call in calls.items():
                if call not in pending:
                    continue
                answered = probes.get(j)
                if answered is not None and answered.done():
                    del probes[j]
                    if answered.exception() is not None:  # CallFailed: no answer within REDUCER_ALIVE_S
                        call.cancel()
                        pending.discard(call)
                        stalled.append(j)
                        unreachable.append(j)
                        continue
                    if answered.result():  # it stopped waiting for our part: no aggregate will come
                        call.cancel()
                        pending.discard(call)
                        stalled.append(j)
                        dropped_us.append(j)
                        continue
                # silent reducers: counted from the call's last byte, not from our part's reduction
                idle = activities[j].idle_s() if j in silent else activities[j].idle_s(since)
                limit_j = idle_s if j in silent else limit_s
                if idle >= limit_j:
                    call.cancel()
                    pending.discard(call)
                    stalled.append(j)
                else:
                    wait = min(wait, limit_j - idle)
                    if probe is not None and j not in probes and now >= next_probe:
                        probes[j] = asyncio.ensure_future(probe(j))
            if probe is not None and now >= next_probe:
                next_probe = now + REDUCER_PROBE_S
            if pending:
                wait = min(wait, max(next_probe - now, 0.01)) if probe is not None else wait
                await asyncio.wait(pending | set(probes.values()), timeout=max(wait, 0.01), return_when=asyncio.FIRST_COMPLETED)
                pending = {c for c in pending if not c.done()}
        await asyncio.gather(*(calls[j] for j in stalled), return_exceptions=True)
    except BaseException:
        for call in calls.values():
            call.cancel()
        await asyncio.gather(*calls.values(), return_exceptions=True)
        raise
    finally:
        for task in probes.values():
            task.cancel()
        await asyncio.gather(*probes.values(), return_exceptions=True)
    return sorted(stalled), sorted(unreachable), sorted(dropped_us)


def _outcome(
    call: asyncio.Future,
    stalled: bool,
    idle_s: Optional[float],
    silent: bool = False,
    unreachable: bool = False,
    dropped_us: bool = False,
) -> Optional[BaseException]:
    if dropped_us:
        return CallFailed("it stopped waiting for our part (our bytes to it stalled or came late): no aggregate comes")
    if unreachable:
        return CallFailed(f"it left a liveness probe unanswered for {REDUCER_ALIVE_S:g} s (cut off or frozen)")
    if stalled and silent:
        return CallFailed(f"its bytes to us stopped and none moved on our call to it for {idle_s:.1f} s")
    if stalled:
        return CallFailed(f"no bytes moved for {2 * idle_s:.1f} s after our own part was reduced")
    return call.exception()


async def _reply_or_relayed(call, guard: PartGuard, j: int, reducer: str, hasher: Hasher) -> tuple[bytes | memoryview, bool]:
    """Part `j`'s aggregate bytes and whether another member relayed them (when the reducer failed us or
    took too long); RoundAbortedError once neither came in time. The call is over before this returns:
    nothing may still write into the output."""
    fallback = guard.fallback(j)
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task, fallback}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():
        try:
            reply_header, reply = task.result()
            guard.accept_aggregate(j, reply, unpack(reply_header, AggregateHeader, peer=reducer), hasher.digest())
            return reply, False
        except (CallFailed, RoundAbortedError, PeerProtocolError) as e:
            logger.info(f"aggregate of part {j} failed ({e}); asking the other members for it")
            guard.reducer_failed(j)
    relayed = await fallback
    if relayed is None:
        raise RoundAbortedError("stopped waiting for this aggregate")
    return relayed, True


async def _nothing() -> torch.Tensor:
    """The aggregate of a member that reduces no part."""
    return torch.empty(0)


def _part_digest(header: bytes, payload) -> bytes:
    digest = hashlib.blake2b(header, digest_size=16)
    digest.update(payload)
    return digest.digest()


def _check_same_part(digest: bytes, header: bytes, payload, peer: str) -> None:
    """A part sent again must be the same bytes: a relayed unary call that reset is sent again whole."""
    if _part_digest(header, payload) != digest:
        raise PeerProtocolError("sent two different parts for one round", peer=peer)


def _refuse(reduction: Reduction, index: int) -> None:
    """Stop waiting for `index`'s part, refused at the sink, unless a part of its is still landing in its row:
    then only this second call is refused (the row must not be reused under those bytes)."""
    if index not in reduction.receiving:
        reduction.refuse(index)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU float32 tensor (no copy)."""
    return memoryview(tensor.numpy()).cast("B")
