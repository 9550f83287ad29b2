"""Handing the current model and optimizer state to a peer that needs it.

A member publishes a snapshot (named CPU tensors + step + version) after a round in
which it was named donor, or whenever it likes for newcomers of asynchronous modes; a
recipient fetches it by round id and checks every tensor's name, dtype and shape
against its own model before using a byte of it.

A state is laid out as one payload cut into chunks of CHUNK_BYTES. A recipient with several
donors (the members of the round it resyncs after) downloads disjoint runs of chunks from each
at once and checks every chunk against the SHA-256 digests its designated donor sends; a chunk
that fails, or whose donor fails, comes again from the designated donor.

In verified runs every member of a round with a recipient keeps its snapshot as a witness,
and answers `check`: the snapshot's fingerprint along random directions the recipient draws
after it holds the donor's bytes (security.projection.state_fingerprint). A donor cannot
shape a poisoned state to directions it did not know.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
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
CHUNK_BYTES = 8 << 20  # the unit of a download from several donors, each checked by its digest
MAX_CHUNKS = 8192  # 64 GiB of state: the digests of every chunk fit one message
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
    first_chunk: Annotated[int, Field(ge=0, lt=MAX_CHUNKS)] = 0
    chunk_count: Annotated[int, Field(ge=0, le=MAX_CHUNKS)] = 0  # 0: the whole state, without digests


class CheckRequest(WireModel):
    round_id: RoundId  # the round whose witness snapshot is asked about
    seed: Annotated[bytes, Field(min_length=32, max_length=32)]  # the recipient's, drawn after the download


class CheckReply(WireModel):
    fingerprint: Annotated[list[float], Field(max_length=3 * 10_000)]  # state_fingerprint of the snapshot


Digest = Annotated[bytes, Field(min_length=32, max_length=32)]


class StateHeader(WireModel):
    step: int
    version: bytes
    tensors: Annotated[list[TensorMeta], Field(max_length=10_000)]
    digests: Annotated[list[Digest], Field(max_length=MAX_CHUNKS)] = []  # SHA-256 of every chunk, if asked in chunks


@dataclass(frozen=True)
class StateSnapshot:
    step: int
    version: bytes
    tensors: dict[str, torch.Tensor]  # CPU, contiguous, owned copies


@dataclass
class _Published:
    header: StateHeader
    payload: bytearray
    digests: Optional[asyncio.Future] = field(default=None, repr=False)  # list[bytes], from the first need of them

    def chunk_digests(self) -> asyncio.Future:
        if self.digests is None:
            self.digests = asyncio.get_running_loop().run_in_executor(None, chunk_digests, self.payload)
        return self.digests


def chunk_digests(payload: bytes | bytearray | memoryview) -> list[bytes]:
    view = memoryview(payload)
    return [hashlib.sha256(view[i : i + CHUNK_BYTES]).digest() for i in range(0, len(view), CHUNK_BYTES)]


class ChunkHasher:
    """SHA-256 of each CHUNK_BYTES of a stream that starts on a chunk boundary, fed as it arrives."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._hash = hashlib.sha256()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), CHUNK_BYTES - self._filled)
            self._hash.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == CHUNK_BYTES:
                self._digests.append(self._hash.digest())
                self._hash, self._filled = hashlib.sha256(), 0

    def digests(self) -> list[bytes]:
        return self._digests + ([self._hash.digest()] if self._filled else [])


def describe(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name=k, dtype=_NAMES[t.dtype], shape=list(t.shape)) for k, t in tensors.items()]


class StateService:
    """Serves published snapshots and fetches them from others."""

    def __init__(self, transport: Transport, *, max_state_bytes: int = 1 << 36) -> None:
        self.transport = transport
        self.max_state_bytes = max_state_bytes
        self._by_round: dict[bytes, tuple[float, _Published]] = {}
        self._latest: Optional[_Published] = None
        self._published = asyncio.Condition()
        self._checked: set[tuple[str, bytes]] = set()  # (peer, round id): each fingerprint computed once
        self._joined: dict[bytes, float] = {}  # rounds this peer is in or was in -> expiry
        self._standing: set[bytes] = set()  # keys published again and again (lasgd's base), not once per round
        self._abandoned: dict[bytes, float] = {}  # rounds this peer left without a snapshot -> expiry
        self._waiting = WaitingCalls(MAX_WAITING_REQUESTS)
        self.refetched_chunks = 0  # chunks downloaded again from the designated donor (failed or forged elsewhere)
        transport.register(STATE_METHOD, self._serve, max_payload=0)
        transport.register(CHECK_METHOD, self._serve_check, max_payload=0)

    async def publish(self, snapshot: StateSnapshot, round_id: Optional[bytes] = None) -> None:
        header = StateHeader(step=snapshot.step, version=snapshot.version, tensors=describe(snapshot.tensors))
        payload = bytearray().join(_raw_bytes(t) for t in snapshot.tensors.values())  # writable: checks view it
        now = time.monotonic()
        async with self._published:
            for rid in [r for r, (t, _) in self._by_round.items() if t < now]:
                del self._by_round[rid]
            self._checked = {(p, r) for p, r in self._checked if r in self._by_round}  # forget expired rounds
            published = _Published(header, payload)
            if round_id is not None and round_id not in self._standing:
                published.chunk_digests()  # a recipient downloading in chunks asks soon: start hashing now
            if round_id is not None:
                self._by_round[round_id] = (now + SNAPSHOT_TTL_S, published)
            self._latest = published
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

    async def _snapshot_of(self, round_id: Optional[bytes], peer: str) -> _Published:
        """The snapshot published after `round_id` (None: the latest), once it is; `peer`'s requests wait
        for one a few at a time."""
        with self._waiting.hold(peer):
            return await self._wait_for_snapshot(round_id)

    async def _wait_for_snapshot(self, round_id: Optional[bytes]) -> _Published:

        def ready() -> Optional[_Published]:
            if round_id is None:
                return self._latest
            entry = self._by_round.get(round_id)
            if entry is None and round_id in self._abandoned:
                raise RoundAbortedError("this peer's part in that round failed: it has no state after it")
            return None if entry is None else entry[1]

        async with self._published:
            if round_id is not None and round_id not in self._standing:  # a round this peer never joins has none
                try:
                    await asyncio.wait_for(
                        self._published.wait_for(lambda: ready() is not None or round_id in self._joined),
                        timeout=UNKNOWN_ROUND_GRACE_S,
                    )
                except asyncio.TimeoutError:
                    raise RoundAbortedError(
                        "this peer is not a member of that round: it has no state after it"
                    ) from None
            try:
                return await asyncio.wait_for(self._published.wait_for(ready), timeout=SNAPSHOT_TTL_S)
            except asyncio.TimeoutError:
                raise RoundAbortedError("no such snapshot") from None

    async def _serve(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, StateRequest, peer=peer)
        found = await self._snapshot_of(request.round_id, peer)
        if not request.chunk_count:
            return pack(found.header), found.payload
        digests = await asyncio.shield(found.chunk_digests())
        if request.first_chunk + request.chunk_count > len(digests):
            raise PeerProtocolError(
                f"asked for chunks {request.first_chunk}..{request.first_chunk + request.chunk_count - 1} of a state of"
                f" {len(digests)}",
                peer=peer,
            )
        start = request.first_chunk * CHUNK_BYTES
        end = min(len(found.payload), start + request.chunk_count * CHUNK_BYTES)
        reply = found.header.model_copy(update={"digests": digests})
        return pack(reply), memoryview(found.payload)[start:end]

    async def _serve_check(self, peer: str, header: bytes, payload: bytearray) -> tuple[bytes, bytes]:
        request = unpack(header, CheckRequest, peer=peer)
        if (peer, request.round_id) in self._checked:  # a pass over the whole state each: once per recipient
            raise PeerProtocolError("asked twice to check one round's state", peer=peer)
        self._checked.add((peer, request.round_id))
        found = await self._snapshot_of(request.round_id, peer)
        tensors = list(_tensors_from(found.header.tensors, found.payload, copy=False).values())
        fingerprint = await asyncio.get_running_loop().run_in_executor(None, state_fingerprint, request.seed, tensors)
        return pack(CheckReply(fingerprint=fingerprint)), b""

    async def check(self, peer: str, round_id: bytes, seed: bytes, *, timeout_s: float) -> list[float]:
        """`peer`'s fingerprint, along `seed`'s directions, of the snapshot it kept after `round_id`."""
        raw, _ = await self.transport.call(
            peer,
            CHECK_METHOD,
            pack(CheckRequest(round_id=round_id, seed=seed)),
            max_reply_payload=0,
            timeout_s=timeout_s,
        )
        return list(unpack(raw, CheckReply, peer=peer).fingerprint)

    async def fetch(
        self, peer: str, round_id: Optional[bytes], template: dict[str, torch.Tensor], *, timeout_s: float
    ) -> StateSnapshot:
        """Download `peer`'s snapshot; it must match `template`'s names, dtypes and shapes exactly."""
        expected = describe(template)
        size = self._size(expected)
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
        return _snapshot(header, expected, payload, peer)

    async def fetch_from(
        self, donors: list[str], round_id: Optional[bytes], template: dict[str, torch.Tensor], *, timeout_s: float
    ) -> StateSnapshot:
        """Download the snapshot after `round_id` in disjoint runs of chunks from every donor at once.

        donors[0] is the designated donor: its header (step, version, digests) is the reference, and
        every chunk another donor sent is checked against its digest. A chunk that fails the check, or
        whose donor fails or disagrees, is downloaded again from donors[0]; if donors[0] fails, the
        download fails, as it would with it alone."""
        expected = describe(template)
        size = self._size(expected)
        chunks = -(-size // CHUNK_BYTES)
        if len(donors) < 2 or chunks < 2:
            return await self.fetch(donors[0], round_id, template, timeout_s=timeout_s)
        payload = bytearray(size)
        view = memoryview(payload)
        spans = _spans(chunks, min(len(donors), chunks))
        donors = donors[: len(spans)]

        async def get(donor: str, first: int, count: int) -> tuple[StateHeader, list[int]]:
            """`donor`'s header and which of chunks first..first+count-1 fail its own digests."""
            start, end = first * CHUNK_BYTES, min(size, (first + count) * CHUNK_BYTES)
            request = StateRequest(round_id=round_id, first_chunk=first, chunk_count=count)
            hasher = ChunkHasher()
            raw, _ = await self.transport.call(
                donor, STATE_METHOD, pack(request), max_reply_payload=end - start, timeout_s=timeout_s,
                expect_large_reply=True, reply_into=view[start:end], reply_hasher=hasher,
            )  # fmt: skip
            header = unpack(raw, StateHeader, peer=donor)
            if header.tensors != expected:
                raise PeerProtocolError("state does not match our model (names, dtypes or shapes differ)", peer=donor)
            if len(header.digests) != chunks:
                raise PeerProtocolError(f"state has {len(header.digests)} chunk digests, expected {chunks}", peer=donor)
            got = hasher.digests()
            return header, [first + i for i, d in enumerate(got) if d != header.digests[first + i]]

        results = await asyncio.gather(
            *(get(d, first, count) for d, (first, count) in zip(donors, spans, strict=True)), return_exceptions=True
        )
        if isinstance(results[0], BaseException):
            raise results[0]
        designated = donors[0]
        reference, bad = results[0]
        if bad:
            raise PeerProtocolError("state chunks do not match the digests sent with them", peer=designated)
        again: list[int] = []
        for donor, (first, count), result in zip(donors[1:], spans[1:], results[1:], strict=True):
            if isinstance(result, BaseException):
                logger.info("state chunks from %s failed (%s): downloading them from the donor", donor[-8:], result)
                again += range(first, first + count)
                continue
            header, bad = result
            if (header.step, header.version, header.digests) != (reference.step, reference.version, reference.digests):
                logger.warning("%s holds another state than the donor: its chunks are downloaded again", donor[-8:])
                again += range(first, first + count)
            elif bad:
                logger.warning("%d state chunks from %s failed their digests", len(bad), donor[-8:])
                again += bad
        for chunk in again:
            header, bad = await get(designated, chunk, 1)
            if header.digests != reference.digests or bad:
                raise PeerProtocolError("the donor's state changed during the download", peer=designated)
        self.refetched_chunks += len(again)
        return _snapshot(reference, expected, payload, designated, copy=False)  # the tensors keep `payload` alive

    def _size(self, expected: list[TensorMeta]) -> int:
        size = sum(_nbytes(m) for m in expected)
        if size > self.max_state_bytes:
            raise ValueError(f"state of {size} bytes exceeds max_state_bytes")
        return size


def _spans(chunks: int, parts: int) -> list[tuple[int, int]]:
    """`parts` runs (first chunk, count) that cover 0..chunks-1, as equal as they can be."""
    base, extra = divmod(chunks, parts)
    spans, first = [], 0
    for i in range(parts):
        count = base + (i < extra)
        spans.append((first, count))
        first += count
    return spans


def _snapshot(
    header: StateHeader, expected: list[TensorMeta], payload: bytes | bytearray, peer: str, *, copy: bool = True
) -> StateSnapshot:
    tensors = _tensors_from(expected, payload, copy=copy)
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
