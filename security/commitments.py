"""Phase 2 and the MPRNG of a verified round: what members commit to before any data moves.

Each member signs, before sending a byte of its vector, the hash of every part it
will send (the exact bytes, after compression) and a commitment to a random share.
Parts are later checked against these hashes, and the round's public seed is the hash
of all revealed shares — unknown to anyone while parts and aggregates are committed.
"""

from __future__ import annotations

import hashlib
import secrets

import blake3
from typing import Annotated, Optional

from pydantic import Field

from phalanx.aggregation.compression import INT8_BLOCK
from phalanx.security.wire import PeerIdStr, WireModel

HASH_BYTES = 32
MAX_MEMBERS = 256

Hash = Annotated[bytes, Field(min_length=HASH_BYTES, max_length=HASH_BYTES)]
MaybeHash = Annotated[bytes, Field(max_length=HASH_BYTES)]  # b"" where nothing was seen


def part_hash(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3 of a part's exact bytes: collision-resistant like SHA-256, about 3x faster on big tensors."""
    return blake3.blake3(data).digest()


def part_hasher() -> blake3.blake3:
    """part_hash fed piece by piece (`update`, then `digest`): hashes received bytes while they are in cache."""
    return blake3.blake3()


def members_digest(members: list[str] | tuple[str, ...]) -> bytes:
    return hashlib.sha256("\n".join(members).encode()).digest()


class GroupBody(WireModel):
    """The leader's signed group (kind "group"): proves who was asked into the round."""

    members: Annotated[list[PeerIdStr], Field(min_length=1, max_length=MAX_MEMBERS)]
    issued_at: float = 0.0  # the leader's wall clock (s since the epoch): members refuse stale groups


class CommitBody(WireModel):
    """Kind "commit": signed by a member before it sends any part."""

    members: Hash  # members_digest of the round's ordered member list
    parts: Annotated[list[Hash], Field(min_length=1, max_length=MAX_MEMBERS)]  # part_hash of each part it sends
    mprng: Hash  # share_commitment of its random share
    # a member sitting this round out: it reduces, reports, judges and gets the aggregates, and its parts
    # (zeros, sent only to be answered) count in no aggregate (a DiLoCo validator replaying another's phase)
    sits_out: bool = False


# The most bytes an honest encoder (protocol/codec.py) writes for a part, by codec name. They live here so
# that anyone can check a signed part size against its signed numel and codec without knowing the round.
# hivemind's Tensor message (fp16, 8bit) wraps its buffer in: the buffer's tag and length varint, the packed
# shape (tag, length, one varint), dtype "float32" (tag, length, 7 bytes) and the compression enum (tag, value)
HIVEMIND_FIXED_BYTES = 1 + 2 + 9 + 2
HIVEMIND_SLACK_BYTES = 4  # room for the fields an honest encoder leaves at their defaults (requires_grad, chunks)
UINT8_CODEBOOK_BYTES = 8 + 4 * 256  # hivemind's 8-bit buffer starts with its codebook: an int64 length, 256 float32
EXACT_SIZE_CODECS = frozenset({"none", "int8"})  # every honest part of n values takes exactly max_part_bytes


def _varint_bytes(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def max_part_bytes(numel: int, codec: str) -> Optional[int]:
    """The most bytes an honest part of `numel` values takes in `codec` (a Codec value); None for a codec
    nobody speaks. Raw float32 and int8 (scales, then codes) take exactly this; sparse parts at most the
    dense form (a form byte and float32 values); fp16 and 8bit hivemind's buffer and its framing."""
    if numel < 0:
        return None
    if codec == "none":
        return 4 * numel
    if codec == "int8":
        return 4 * -(-numel // INT8_BLOCK) + numel
    if codec == "sparse":
        return 1 + 4 * numel
    if codec in ("fp16", "8bit"):
        buffer = 2 * numel if codec == "fp16" else UINT8_CODEBOOK_BYTES + numel
        return buffer + _varint_bytes(buffer) + _varint_bytes(numel) + HIVEMIND_FIXED_BYTES + HIVEMIND_SLACK_BYTES
    return None


class PartBody(WireModel):
    """Kind "part": signed with every part sent; must match the commitment (else it is proof). Its size,
    numel and codec head the bytes, so a reducer refuses an oversized part before allocating it, and a
    size beyond what the codec can take for that numel proves its signer lied (security.evidence)."""

    part: Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]
    hash: Hash
    weight: float  # must be 1: the projection check counts every member once
    numel: Annotated[int, Field(ge=0)]  # values in the part
    codec: Annotated[str, Field(max_length=16)]  # the Codec value its bytes are encoded with
    size: Annotated[int, Field(ge=0)]  # bytes of the encoded part: the payload that follows

    def oversized(self) -> bool:
        """Whether `size` exceeds what any honest encoding of `numel` values in `codec` takes."""
        bound = max_part_bytes(self.numel, self.codec)
        return bound is not None and self.size > bound


class AggregateBody(WireModel):
    """Kind "aggregate": the reducer's signed result for its part, sent with the bytes."""

    part: Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]
    hash: Hash
    contributors: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]], Field(max_length=MAX_MEMBERS)]

    def well_formed(self, members: int, sits_out: bool = False) -> bool:
        """Contributors are member indices in increasing order, and the reducer counted its own part
        (none if it sat the round out)."""
        c = self.contributors
        return all(a < b for a, b in zip(c, c[1:])) and (not c or c[-1] < members) and (self.part in c) != sits_out


PartIndex = Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]


class ReportEntry(WireModel):
    part: PartIndex
    aggregate: Hash  # hash of the aggregate v it was computed against
    s: float  # ⟨z_part, clipped (x − v)⟩
    norm: float  # ‖x − v‖


class ReportBody(WireModel):
    """Kind "report": a member's projections of its part against every aggregate that counted it, and
    the parts it disputes. Sent to every member; two different ones from one member prove equivocation."""

    entries: Annotated[list[ReportEntry], Field(max_length=MAX_MEMBERS)]
    undelivered: Annotated[list[PartIndex], Field(max_length=MAX_MEMBERS)] = []  # parts never received
    left_out: Annotated[list[PartIndex], Field(max_length=MAX_MEMBERS)] = []  # aggregates that did not count us


def new_share() -> bytes:
    return secrets.token_bytes(HASH_BYTES)


def share_commitment(round_id: bytes, peer: str, share: bytes) -> bytes:
    return hashlib.sha256(b"mprng\0" + round_id + peer.encode() + share).digest()


def public_seed(round_id: bytes, shares: dict[str, bytes]) -> bytes:
    """The round's public randomness from every revealed share (order-independent)."""
    h = hashlib.sha256(b"seed\0" + round_id)
    for peer in sorted(shares):
        h.update(peer.encode() + b"\0" + shares[peer])
    return h.digest()


def validator_pairs(seed: bytes, members: list[str], count: int) -> list[tuple[str, str]]:
    """The round's public (validator, target) pairs: the seed orders the members, and each of the first
    `count` validates the next one (a cycle), so nobody validates itself and no two validators share a
    target; everyone is validated once `count` reaches the group size."""
    if count < 1 or len(set(members)) < 2:
        return []
    order = sorted(set(members), key=lambda peer: hashlib.sha256(seed + b"validators\0" + peer.encode()).digest())
    return [(order[k], order[(k + 1) % len(order)]) for k in range(min(count, len(order)))]
