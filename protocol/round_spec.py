"""What one all-reduce is agreed on and hands back: its spec, the headers its parts and aggregates travel
with, the guard a verified round (protocol.btard) puts around its data phases, and its result. The
all-reduce (allreduce.py) and the reducer's bookkeeping (reduction.py) both read these."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Optional, Protocol

import torch
from pydantic import Field

from phalanx.protocol.channel import Hasher
from phalanx.protocol.codec import Codec
from phalanx.protocol.partition import partition_bounds
from phalanx.security.wire import RoundId, WireModel

Reducer = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # (n, d), weights -> (d,)


class PartHeader(WireModel):
    round_id: RoundId
    part: int  # index of the part (= index of its reducer in the member list)
    numel: int  # elements in this part
    codec: str  # Codec value the payload is encoded with
    weight: float  # sender's contribution weight; reducers clip it to [0, 1]
    signature: Annotated[bytes, Field(max_length=4096)] = b""  # verified rounds: the signed "part" statement


class AggregateHeader(WireModel):
    contributors: int  # how many members' parts went into the aggregate
    statement: Annotated[bytes, Field(max_length=4096)] = b""  # verified rounds: the signed "aggregate" statement


class AliveQuery(WireModel):
    """A sender's probe of the reducer that owes it `round_id`'s aggregate."""

    round_id: RoundId


class AliveReply(WireModel):
    waiting: bool  # False: the reducer stopped waiting for the caller's part (or closed without it); no aggregate comes


class PartGuard(Protocol):
    """What a verified round (protocol.btard) checks and signs around the data phases.
    Methods raise PeerProtocolError to refuse a part or an aggregate. `digest` is the
    payload's hash from `hasher()`, computed by the transport as the bytes arrived."""

    def hasher(self) -> Hasher: ...
    def sign_part(self, part: int, payload: bytes | memoryview, weight: float) -> bytes: ...
    def check_size(self, sender: int, part: int, header: PartHeader, payload_len: int) -> None:
        """Before a byte of `sender`'s part is read: its signed size, numel and codec, against the round
        and the `payload_len` the transport declared (a size the codec cannot take is proof)."""
    def accept_part(self, sender: int, part: int, payload: bytes | memoryview, header: PartHeader, digest: bytes) -> None: ...
    def counted(self, received: list[int]) -> list[int]:
        """Which of the received parts go into the aggregate (all of them, unless an attack says otherwise)."""
    def sign_aggregate(self, part: int, payload: bytes | memoryview, contributors: list[int]) -> bytes: ...
    def reply_for(self, receiver: int, header: bytes, payload: bytes | memoryview) -> tuple[bytes, bytes | memoryview]: ...
    def announced(self, part: int, header: AggregateHeader) -> None:
        """The reply header of part `part` arrived; its payload follows (and goes to `accept_aggregate`)."""
    def accept_aggregate(self, part: int, payload: bytes | memoryview, header: AggregateHeader, digest: bytes) -> None: ...
    def fallback(self, part: int) -> asyncio.Future:
        """Resolves to part `part`'s aggregate bytes as another member relayed them (the call is then
        dropped), or to None once the member stopped waiting for it."""
    def reducer_failed(self, part: int) -> None:
        """The call to part `part`'s reducer failed: `fallback` is the only way left to get its aggregate."""
    def landed(self, part: int, value: torch.Tensor, rows: Optional[torch.Tensor] = None, received: list[int] = ...) -> None:
        """`value` is part `part`'s final aggregate; for this peer's own part also the rows it came from."""


@dataclass(frozen=True)
class RoundSpec:
    """What every member agreed on for one all-reduce."""

    round_id: bytes
    members: tuple[str, ...]
    numel: int
    codec: Codec
    deadline: float  # time.monotonic() by which reducers stop waiting for parts
    # the first `reducers` members reduce a part each; the others (peers nobody can dial: they only send their
    # parts and take the aggregates back over the connections they open) reduce nothing. 0: every member
    reducers: int = 0

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each member's part: empty for members that reduce nothing."""
        n, reducers = len(self.members), self.reducers or len(self.members)
        return partition_bounds(self.numel, reducers) + [(self.numel, self.numel)] * (n - reducers)

    def reduces(self, index: int) -> bool:
        return not self.reducers or index < self.reducers


@dataclass
class AllReduceResult:
    vector: torch.Tensor  # (numel,) float32 on CPU; zeros where `missing_parts`
    missing_parts: tuple[int, ...]  # parts whose reducer failed
    dropped_senders: tuple[str, ...]  # members whose part this peer's reducer did not get
    contributors: int  # contributions to this peer's own part
    bytes_sent: int
    bytes_received: int
    duration_s: float
    own_rows: Optional[torch.Tensor] = None  # (n, part) parts this peer reduced (rows of `own_received`)
    own_received: tuple[int, ...] = ()
    own_value: Optional[torch.Tensor] = None  # this peer's aggregate of its part, as the others decoded it
    recycle_rows: Optional[Callable[[], None]] = None  # hands `own_rows` back for the next round once unneeded
    idle_senders: tuple[str, ...] = ()  # dropped senders whose bytes stopped (or connection broke) before the deadline
    late_senders: tuple[str, ...] = ()  # dropped senders still missing when the deadline passed
    idle_parts: tuple[int, ...] = ()  # missing parts whose reducer moved no bytes for part_idle_timeout_s
    unreachable: tuple[str, ...] = ()  # reducers given up on because they stopped answering liveness probes
    slow_senders: tuple[str, ...] = ()  # senders whose part reached our reducer far behind the others (Reduction.slow)
