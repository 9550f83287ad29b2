"""The reducer's side of one all-reduce: the rows it collects from every member for its own part, which
senders it still waits for, and which it stopped waiting for (refused, idle, late)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.channel import Activity, Hasher
from phalanx.protocol.round_spec import PartGuard, Reducer, RoundSpec

logger = logging.getLogger(__name__)

SLOW_MIN_S = 0.1
SLOW_FACTOR = 4.0


@dataclass
class Reduction:
    """Collects every member's copy of this peer's part and computes its aggregate once."""

    spec: RoundSpec
    my_index: int
    reducer: Reducer
    rows: torch.Tensor  # (n, part_numel)
    weights: torch.Tensor  # (n,)
    received: set[int] = field(default_factory=set)
    receiving: set[int] = field(default_factory=set)  # parts being written into `rows` right now
    refused: set[int] = field(default_factory=set)  # senders whose part was refused or who are skipped
    closed: bool = False  # set once aggregation starts; later parts are refused
    counted: list[int] = field(default_factory=list)  # the parts the aggregate was computed from
    complete_at: float = 0.0  # time.monotonic() when the last part arrived (or the deadline)
    reduced_at: float = 0.0
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    result: Optional[asyncio.Future] = None
    encoded: Optional[tuple[bytes, bytes | memoryview]] = None
    encoded_for: dict[int, tuple[bytes, bytes | memoryview]] = field(default_factory=dict)  # per-member results
    guard: Optional[PartGuard] = None
    hashers: dict[int, Hasher] = field(default_factory=dict)  # verified rounds: incoming parts' running hashes
    activity: dict[int, Activity] = field(default_factory=dict)  # per expected sender: when its bytes last moved
    idle: set[int] = field(default_factory=set)  # senders dropped because their bytes stopped or their connection broke
    late: set[int] = field(default_factory=set)  # senders still missing at the deadline
    replied: set[int] = field(default_factory=set)  # senders handed their result: once all are, nothing holds it
    finished: bool = False  # this peer's own run of the round returned
    arrived_at: dict[int, float] = field(default_factory=dict)  # time.monotonic() each sender's part was in
    # parts small enough for a unary call, which a relayed connection's reset makes the sender send again
    # whole: each one's digest, to tell the same part sent again from another part, and its header and reply
    digests: dict[int, bytes] = field(default_factory=dict)
    answers: dict[int, tuple[bytes, tuple[bytes, bytes | memoryview]]] = field(default_factory=dict)

    def slow(self, started: float) -> list[int]:
        """Senders whose part came in SLOW_MIN_S, and SLOW_FACTOR times the fastest other sender's time,
        after that fastest one: a lossy or thin link, or a descheduled process (one round says little: the
        peer marks a sender slow when it was in several of its last rounds, LinkQuality.note_round)."""
        others = {i: at - started for i, at in self.arrived_at.items() if i != self.my_index}
        if len(others) < 2:
            return []  # one other sender: nobody to be slow against
        fastest = min(others.values())
        return sorted(i for i, took in others.items() if took - fastest > max(SLOW_MIN_S, SLOW_FACTOR * fastest))

    def release(self) -> None:
        """Drop the aggregate and the per-member results once the round is forgotten. The activity
        callbacks point back at this object, a reference cycle that only the cyclic collector frees,
        rounds later: 100M values held that way per round added up to a copy of the vector each."""
        self.encoded, self.encoded_for, self.result, self.answers = None, {}, None, {}
        self.activity.clear()

    def all_replied(self) -> bool:
        """Every counted sender but us has its result, so the round's memory (the aggregate) can go."""
        return self.closed and set(self.counted) - {self.my_index} <= self.replied

    def claim(self, index: int) -> None:
        """Reserve row `index` for an incoming part (refuses late and repeated parts)."""
        if self.closed:
            raise RoundAbortedError("part arrived after the reducer's deadline")
        if index in self.idle:
            raise RoundAbortedError("part arrived after the reducer stopped waiting for it (no bytes came)")
        if index in self.received or index in self.receiving:
            raise PeerProtocolError("sent its part twice", peer=self.spec.members[index])
        self.receiving.add(index)
        if index in self.activity:
            self.activity[index].moved()

    def pending(self) -> list[int]:
        """Senders whose part this reducer still waits for."""
        return [i for i in range(len(self.spec.members)) if i not in self.received and i not in self.refused]

    def drop_idle(self, index: int, why: str) -> None:
        """Stop waiting for `index`'s part: its bytes stopped or its connection broke. Handled as a part
        that missed the deadline (left out of the aggregate, refused if it comes later); bytes of a part
        still landing keep its row out of reuse (`receiving` is left as it is)."""
        if index in self.received or index in self.refused or self.closed:
            return
        logger.info(f"round {self.spec.round_id.hex()[:8]}: stopped waiting for {self.spec.members[index][-8:]}'s part ({why})")
        self.idle.add(index)
        self.refused.add(index)
        self._check_complete()

    def broken(self, index: int) -> None:
        """The connection carrying `index`'s part broke: no more bytes will land in its row."""
        self.receiving.discard(index)
        self.drop_idle(index, "its connection broke")

    def add(self, index: int, values: Optional[torch.Tensor], weight: float) -> None:
        """Accept row `index`; `values` is None when the bytes were received straight into the row."""
        if self.closed:
            raise RoundAbortedError("part arrived after the reducer's deadline")
        if index in self.idle:
            self.receiving.discard(index)  # its bytes have all landed: the row is free again
            raise RoundAbortedError("part arrived after the reducer stopped waiting for it (no bytes came)")
        if values is not None:
            self.rows[index].copy_(values)
        self.weights[index] = min(max(weight, 0.0), 1.0)  # never trust a self-reported weight beyond 1
        self.receiving.discard(index)
        self.received.add(index)
        self.arrived_at[index] = time.monotonic()
        self._check_complete()

    def refuse(self, index: int) -> None:
        """Stop waiting for `index`'s part (refused, or a member left out of the round)."""
        self.receiving.discard(index)
        if index not in self.received:
            self.refused.add(index)
        self._check_complete()

    def _check_complete(self) -> None:
        if len(self.received | self.refused) >= len(self.spec.members):
            self.complete.set()
