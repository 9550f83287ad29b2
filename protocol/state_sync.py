"""Handing the current model and optimizer state to a peer that needs it.

A member publishes a snapshot (named CPU tensors + step + version) after a round in
which it was named donor, or whenever it likes for newcomers of asynchronous modes; a
recipient fetches it by round id and checks every tensor's name, dtype and shape
against its own model before using a byte of it.

In verified runs every member of a round with a recipient keeps its snapshot as a witness,
and answers `check`: the snapshot's fingerprint along random directions the recipient draws
after it holds the donor's bytes (security.projection.state_fingerprint). A donor cannot
shape a poisoned state to directions it did not know.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch
from pydantic import Field

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.transport import Transport
from phalanx.protocol.waiting import WaitingCalls
from phalanx.security.projection import state_fingerprint
from phalanx.security.wire import RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

STATE_METHOD = "state"
CHECK_METHOD = "state_check"
SNAPSHOT_TTL_S = 120.0
UNKNOWN_ROUND_GRACE_S = 5.0  # a resync order may reach the donor's state request before the donor's own group reply
# requests waiting for a snapshot at once (MAX_WAITING_PER_CALLER a caller: a recipient asks each member
# once for the state and once for a check): a swarm's newcomers fit, one peer's made-up round ids do not
MAX_WAITING_REQUESTS = 1024
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TensorMeta(WireModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"]
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=8)]


class StateRequest(WireModel):
    round_id: Optional[bytes]  # the round after which the state is wanted; None: the latest


class CheckRequest(WireModel):
    round_id: RoundId  # the round whose witness snapshot is asked about
    seed: Annotated[bytes, Field(min_length=32, max_length=32)]  # the recipient's, drawn after the download


class CheckReply(WireModel):
    fingerprint: Annotated[list[float], Field(max_length=3 * 10_000)]  # state_fingerprint of the snapshot


class StateHeader(WireModel):
    step: int
    version: bytes
    tensors: Annotated[list[TensorMeta], Field(max_length=10_000)]


@dataclass(frozen=True)
class StateSnapshot:
    step: int
    version: bytes
    tensors: dict[str, torch.Tensor]  # CPU, contiguous, owned copies


def describe(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name=k, dtype=_NAMES[t.dtype], shape=list(t.shape)) for k, t in tensors.items()]


class StateService:
    """Serves published snapshots and fetches them from others."""

    def __init__(self, transport: Transport, *, max_state_bytes: int = 1 << 36) -> None:
        self.transport = transport
        self.max_state_bytes = max_state_bytes
        self._by_round: dict[bytes, tuple[float, StateHeader, bytearray]] = {}
        self._latest: Optional[tuple[StateHeader, bytearray]] = None
        self._published = asyncio.Condition()
        self._checked: set[tuple[str, bytes]] = set()  # (peer, round id): each fingerprint computed once
        self._joined: dict[bytes, float] = {}  # rounds this peer is in or was in -> expiry
        self._standing: set[bytes] = set()  # keys published again and again (lasgd's base), not once per round
        self._abandoned: dict[bytes, float] = {}  # rounds this peer left without a snapshot -> expiry
        self._waiting = WaitingCalls(MAX_WAITING_REQUESTS)
        transport.register(STATE_METHOD, self._serve, max_payload=0)
        transport.register(CHECK_METHOD, self._serve_check, max_payload=0)

    async def publish(self, snapshot: StateSnapshot, round_id: Optional[bytes] = None) -> None:
        header = StateHeader(step=snapshot.step, version=snapshot.version, tensors=describe(snapshot.tensors))
        payload = bytearray().join(_raw_bytes(t) for t in snapshot.tensors.values())  # writable: checks view it
        now = time.monotonic()
        async with self._published:
            for rid in [r for r, (t, _, _) in self._by_round.items() if t < now]:
                del self._by_round[rid]
            self._checked = {(p, r) for p, r in self._checked if r in self._by_round}  # forget expired rounds
            if round_id is not None:
                self._by_round[round_id] = (now + SNAPSHOT_TTL_S, header, payload)
            self._latest = (header, payload)
            self._published.notify_all()

    def keep_serving(self, key: bytes) -> None:
        """`key` is republished as it changes: a request for it waits for its first snapshot."""
        self._standing.add(key)

    def joined(self, round_id: bytes) -> None:
        """This peer is a member of `round_id`: a peer told to resync from it may wait for its snapshot."""
        self._joined = self._note(self._joined, round_id)

    def abandon(self, round_id: bytes) -> None:
        """This peer's part in `round_id` failed: it will publish no snapshot after it, and a peer told
        to resync from it hears so at once instead of waiting out its state timeout."""
        self._abandoned = self._note(self._abandoned, round_id)

    def _note(self, rounds: dict[bytes, float], round_id: bytes) -> dict[bytes, float]:
        now = time.monotonic()
        rounds = {r: t for r, t in rounds.items() if t > now}
        rounds[round_id] = now + SNAPSHOT_TTL_S
        asyncio.get_running_loop().create_task(self._wake())
        return rounds

    async def _wake(self) -> None:
        async with self._published:
            self._published.notify_all()

    async def _snapshot_of(self, round_id: Optional[bytes], peer: str) -> tuple[StateHeader, bytes]:
        """The snapshot published after `round_id` (None: the latest), once it is; `peer`'s requests wait
        for one a few at a time."""
        with self._waiting.hold(peer):
            return await self._wait_for_snapshot(round_id)

    async def _wait_for_snapshot(self, round_id: Optional[bytes]) -> tuple[StateHeader, bytes]:

        def ready() -> Optional[tuple[StateHeader, bytes]]:
            if round_id is None:
                return self._latest
            entry = self._by_round.get(round_id)
            if entry is None and round_id in self._abandoned:
                raise RoundAbortedError("this peer's part in that round failed: it has no state after it")
            return None if entry is None else entry[1:]

        async with self._published:
            if round_id is not None and round_id not in self._standing:  # a round this peer never joins has none
                try:
                    await asyncio.wait_for(
                        self._published.wait_for(lambda: ready() is not None or round_id in self._joined),
                        timeout=UNKNOWN_ROUND_GRACE_S,
                    )
                except asyncio.TimeoutError:
                    raise RoundAbortedError("this peer is not a member of that round: it has no state after it") from None
            try:
                return await asyncio.wait_for(self._published.wait_for(ready), timeout=SNAPSHOT_TTL_S)
            except asyncio.TimeoutError:
                raise RoundAbortedError("no such snapshot") from None

    async def _serve(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, StateRequest, peer=peer)
        found = await self._snapshot_of(request.round_id, peer)
        return pack(found[0]), found[1]

    async def _serve_check(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, CheckRequest, peer=peer)
        if (peer, request.round_id) in self._checked:  # a pass over the whole state each: once per recipient
            raise PeerProtocolError("asked twice to check one round's state", peer=peer)
        self._checked.add((peer, request.round_id))
        state_header, data = await self._snapshot_of(request.round_id, peer)
        tensors = list(_tensors_from(state_header.tensors, data, copy=False).values())
        fingerprint = await asyncio.get_running_loop().run_in_executor(None, state_fingerprint, request.seed, tensors)
        return pack(CheckReply(fingerprint=fingerprint)), b""

    async def check(self, peer: str, round_id: bytes, seed: bytes, *, timeout_s: float) -> list[float]:
        """`peer`'s fingerprint, along `seed`'s directions, of the snapshot it kept after `round_id`."""
        raw, _ = await self.transport.call(
            peer, CHECK_METHOD, pack(CheckRequest(round_id=round_id, seed=seed)), max_reply_payload=0, timeout_s=timeout_s
        )
        return list(unpack(raw, CheckReply, peer=peer).fingerprint)

    async def fetch(
        self, peer: str, round_id: Optional[bytes], template: dict[str, torch.Tensor], *, timeout_s: float
    ) -> StateSnapshot:
        """Download `peer`'s snapshot; it must match `template`'s names, dtypes and shapes exactly."""
        expected = describe(template)
        size = sum(_nbytes(m) for m in expected)
        if size > self.max_state_bytes:
            raise ValueError(f"state of {size} bytes exceeds max_state_bytes")
        raw_header, payload = await self.transport.call(
            peer,
            STATE_METHOD,
            pack(StateRequest(round_id=round_id)),
            max_reply_payload=size,
            timeout_s=timeout_s,
            expect_large_reply=size > (64 << 10),
        )
        header = unpack(raw_header, StateHeader, peer=peer)
        if header.tensors != expected:
            raise PeerProtocolError("state does not match our model (names, dtypes or shapes differ)", peer=peer)
        if len(payload) != size:
            raise PeerProtocolError(f"state payload has {len(payload)} bytes, expected {size}", peer=peer)
        tensors = _tensors_from(expected, payload, copy=True)
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors.values()):
            raise PeerProtocolError("state contains NaN or Inf", peer=peer)
        return StateSnapshot(step=header.step, version=header.version, tensors=tensors)


def _tensors_from(metas: list[TensorMeta], payload: bytes | bytearray, *, copy: bool) -> dict[str, torch.Tensor]:
    """The named tensors laid out in `payload` (views into it unless `copy`)."""
    tensors, pos = {}, 0
    for meta in metas:
        dtype, count = _DTYPES[meta.dtype], _numel(meta)
        t = torch.frombuffer(payload, dtype=dtype, count=count, offset=pos) if count else torch.empty(0, dtype=dtype)
        tensors[meta.name] = (t.clone() if copy else t).reshape(meta.shape)
        pos += _nbytes(meta)
    return tensors


def _numel(meta: TensorMeta) -> int:
    n = 1
    for s in meta.shape:
        n *= s
    return n


def _nbytes(meta: TensorMeta) -> int:
    return _numel(meta) * _DTYPES[meta.dtype].itemsize


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
