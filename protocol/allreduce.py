"""Phases 3–5 of a round: butterfly all-reduce of one flat vector over a formed group.

Member i cuts its vector into one part per member, sends part j to member j and gets
back the aggregate of part j (scatter and gather share one call); as reducer of part i
it collects everyone's part i, aggregates it with the configured rule once all members
sent theirs or the deadline passed, and answers every waiting sender with the same
bytes. Bytes per peer: 2·(n−1)/n of the vector. A member that dies or stalls is dropped:
its part is aggregated without it, and if it was a reducer the part it owned comes
back missing (reported, zero-filled) instead of stalling the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from aggregation.errors import AggregationInputError, PeerProtocolError, RoundAbortedError
from protocol.codec import Codec, decode, encode, encoded_size_bound
from protocol.partition import partition_bounds
from protocol.transport import Transport
from protocol.wire import RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

PART_METHOD = "part"
MAX_WAITING_CALLS = 256  # calls for rounds we have not registered yet, held at most this many
Reducer = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # (n, d), weights -> (d,)


class PartHeader(WireModel):
    round_id: RoundId
    part: int  # index of the part (= index of its reducer in the member list)
    numel: int  # elements in this part
    codec: str  # Codec value the payload is encoded with
    weight: float  # sender's contribution weight; reducers clip it to [0, 1]


class AggregateHeader(WireModel):
    contributors: int  # how many members' parts went into the aggregate


@dataclass(frozen=True)
class RoundSpec:
    """What every member agreed on for one all-reduce."""

    round_id: bytes
    members: tuple[str, ...]
    numel: int
    codec: Codec
    deadline: float  # time.monotonic() by which reducers stop waiting for parts

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return partition_bounds(self.numel, len(self.members))


@dataclass
class AllReduceResult:
    vector: torch.Tensor  # (numel,) float32 on CPU; zeros where `missing_parts`
    missing_parts: tuple[int, ...]  # parts whose reducer failed
    dropped_senders: tuple[str, ...]  # members whose part this peer's reducer did not get
    contributors: int  # contributions to this peer's own part
    bytes_sent: int
    bytes_received: int
    duration_s: float


@dataclass
class _Reduction:
    """Collects every member's copy of this peer's part and computes its aggregate once."""

    spec: RoundSpec
    my_index: int
    reducer: Reducer
    rows: torch.Tensor  # (n, part_numel)
    weights: torch.Tensor  # (n,)
    received: set[int] = field(default_factory=set)
    closed: bool = False  # set once aggregation starts; later parts are refused
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    result: Optional[asyncio.Future] = None
    encoded: Optional[tuple[bytes, bytes | memoryview]] = None

    def add(self, index: int, values: torch.Tensor, weight: float) -> None:
        if self.closed:
            raise RoundAbortedError("part arrived after the reducer's deadline")
        if index in self.received:
            raise PeerProtocolError("sent its part twice", peer=self.spec.members[index])
        self.rows[index].copy_(values)
        self.weights[index] = min(max(weight, 0.0), 1.0)  # never trust a self-reported weight beyond 1
        self.received.add(index)
        if len(self.received) == len(self.spec.members):
            self.complete.set()


class AllReduceService:
    """Routes incoming parts to the round they belong to; one per peer."""

    def __init__(self, transport: Transport, *, registration_wait_s: float = 30.0) -> None:
        self.transport = transport
        self.registration_wait_s = registration_wait_s
        self._rounds: dict[bytes, _Reduction] = {}
        self._registered: dict[bytes, asyncio.Event] = {}
        self._waiting = 0
        transport.register(PART_METHOD, self._serve_part, max_payload=1 << 34)

    async def run(
        self,
        spec: RoundSpec,
        vector: torch.Tensor,
        reducer: Reducer,
        *,
        weight: float = 1.0,
        call_timeout_s: float,
    ) -> AllReduceResult:
        """All-reduce `vector` (numel,) with the group in `spec`; this peer must be a member."""
        started = time.monotonic()
        sent0, recv0 = self.transport.stats.bytes_sent, self.transport.stats.bytes_received
        me = spec.members.index(self.transport.peer_id)
        bounds = spec.bounds
        vector = vector.detach().to("cpu", torch.float32).contiguous().view(-1)
        if vector.numel() != spec.numel:
            raise ValueError(f"vector has {vector.numel()} elements, the round agreed on {spec.numel}")
        lo, hi = bounds[me]
        reduction = _Reduction(
            spec, me, reducer, torch.empty(len(spec.members), hi - lo), torch.zeros(len(spec.members))
        )
        reduction.result = asyncio.get_running_loop().create_future()
        reduction.add(me, vector[lo:hi], weight)
        self._rounds[spec.round_id] = reduction
        self._registered.setdefault(spec.round_id, asyncio.Event()).set()
        output = torch.zeros(spec.numel)
        missing: list[int] = []
        try:
            reduce_task = asyncio.create_task(self._reduce(reduction))
            calls = [
                self._send_part(spec, j, vector[a:b], weight, output[a:b], call_timeout_s)
                for j, (a, b) in enumerate(bounds)
                if j != me
            ]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            others = [j for j in range(len(spec.members)) if j != me]
            for j, outcome in zip(others, outcomes):
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, asyncio.CancelledError):
                        raise outcome
                    logger.info(f"part {j} (reducer {spec.members[j][-8:]}) failed: {outcome}")
                    missing.append(j)
            own = await reduce_task
            output[lo:hi] = own
        finally:
            # keep serving replies that are in flight, then forget the round
            asyncio.get_running_loop().call_later(5.0, self._forget, spec.round_id)
        return AllReduceResult(
            vector=output,
            missing_parts=tuple(missing),
            dropped_senders=tuple(spec.members[i] for i in range(len(spec.members)) if i not in reduction.received),
            contributors=len(reduction.received),
            bytes_sent=self.transport.stats.bytes_sent - sent0,
            bytes_received=self.transport.stats.bytes_received - recv0,
            duration_s=time.monotonic() - started,
        )

    def _forget(self, round_id: bytes) -> None:
        self._rounds.pop(round_id, None)
        self._registered.pop(round_id, None)

    async def _send_part(self, spec, j, part, weight, out, timeout_s) -> None:
        header = PartHeader(round_id=spec.round_id, part=j, numel=part.numel(), codec=spec.codec.value, weight=weight)
        payload = encode(part, spec.codec)
        reply_header, reply = await self.transport.call(
            spec.members[j],
            PART_METHOD,
            pack(header),
            payload,
            max_reply_payload=encoded_size_bound(part.numel(), spec.codec),
            timeout_s=timeout_s,
        )
        unpack(reply_header, AggregateHeader, peer=spec.members[j])
        out.copy_(decode(reply, spec.codec, part.numel(), peer=spec.members[j]))

    async def _reduce(self, reduction: _Reduction) -> torch.Tensor:
        remaining = reduction.spec.deadline - time.monotonic()
        try:
            await asyncio.wait_for(reduction.complete.wait(), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:
            pass
        reduction.closed = True
        got = sorted(reduction.received)
        rows, weights = reduction.rows[got], reduction.weights[got]
        try:
            # torch releases the GIL: aggregate off the event loop
            value = await asyncio.get_running_loop().run_in_executor(None, reduction.reducer, rows, weights)
        except AggregationInputError as e:
            reduction.result.set_exception(RoundAbortedError(f"aggregation failed: {e}"))
            raise RoundAbortedError(f"aggregation failed: {e}") from e
        reduction.encoded = (pack(AggregateHeader(contributors=len(got))), encode(value, reduction.spec.codec))
        reduction.result.set_result(value)
        # what we send is what the others decode: keep our own part bit-identical to theirs
        if reduction.spec.codec is not Codec.NONE:
            value = decode(reduction.encoded[1], reduction.spec.codec, value.numel())
        return value

    async def _serve_part(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes | memoryview]:
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
        values = decode(payload, spec.codec, head.numel, peer=peer)
        reduction.add(spec.members.index(peer), values, head.weight)
        await asyncio.shield(reduction.result)
        return reduction.encoded

    async def _wait_for_round(self, round_id: bytes, peer: str) -> _Reduction:
        reduction = self._rounds.get(round_id)
        if reduction is not None:
            return reduction
        if self._waiting >= MAX_WAITING_CALLS:
            raise RoundAbortedError("too many calls for unknown rounds")
        event = self._registered.setdefault(round_id, asyncio.Event())
        self._waiting += 1
        try:
            await asyncio.wait_for(event.wait(), timeout=self.registration_wait_s)
        except asyncio.TimeoutError:
            self._registered.pop(round_id, None)
            raise RoundAbortedError("unknown round") from None
        finally:
            self._waiting -= 1
        reduction = self._rounds.get(round_id)
        if reduction is None:
            raise RoundAbortedError("round already finished")
        return reduction
