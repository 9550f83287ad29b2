"""Signed statements: what a peer says in a round (commitments, reveals, reports, aggregates,
accusations, ban votes), bound to its peer ID so any third peer can check who said it.

A statement names its kind and round, so a signature can never be replayed as another
kind of message or in another round; `open_statement` checks all of that before the
body is parsed.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import Field

from phalanx.errors import PeerProtocolError
from phalanx.security.identity import Identity, verify
from phalanx.security.wire import PeerIdStr, WireModel, pack, unpack

DOMAIN = b"phalanx-statement-v1\0"
MAX_BODY_BYTES = 256 << 10

B = TypeVar("B", bound=WireModel)


class Statement(WireModel):
    kind: Annotated[str, Field(min_length=1, max_length=32)]  # what the body is: a RoundPhase it is sent in, part, ...
    round_id: Annotated[bytes, Field(max_length=32)]  # the round it belongs to; b"" for none
    sender: PeerIdStr  # who says it; must match the signing key
    body: Annotated[bytes, Field(max_length=MAX_BODY_BYTES)]  # msgpack of the kind's own model


class Signed(WireModel):
    statement: Annotated[bytes, Field(max_length=MAX_BODY_BYTES + 1024)]  # pack(Statement)
    public_key: Annotated[bytes, Field(max_length=1024)]  # libp2p-encoded key behind `sender`
    signature: Annotated[bytes, Field(max_length=1024)]


def sign_statement(identity: Identity, kind: str, round_id: bytes, body: WireModel) -> Signed:
    statement = pack(Statement(kind=kind, round_id=round_id, sender=identity.peer_id, body=pack(body)))
    return Signed(statement=statement, public_key=identity.public_key, signature=identity.sign(DOMAIN + statement))


def check_statement(signed: Signed, *, kind: str, round_id: bytes | None = None, sender: str | None = None) -> Statement:
    """Check signature, kind, round and sender, without parsing the body; PeerProtocolError otherwise."""
    kind = str(kind)  # a RoundPhase by its wire name, in messages too
    statement = unpack(signed.statement, Statement, peer=sender)
    verify(statement.sender, signed.public_key, DOMAIN + signed.statement, signed.signature)
    if statement.kind != kind:
        raise PeerProtocolError(f"a {statement.kind!r} statement where a {kind!r} was expected", peer=statement.sender)
    if round_id is not None and statement.round_id != round_id:
        raise PeerProtocolError(f"{kind} statement of another round (replayed?)", peer=statement.sender)
    if sender is not None and statement.sender != sender:
        raise PeerProtocolError(f"{kind} statement signed by {statement.sender}, not by the sender", peer=sender)
    return statement


def open_statement(
    signed: Signed,
    body_model: type[B],
    *,
    kind: str,
    round_id: bytes | None = None,
    sender: str | None = None,
) -> tuple[Statement, B]:
    """Check signature, kind, round and sender, then parse the body; PeerProtocolError otherwise."""
    statement = check_statement(signed, kind=kind, round_id=round_id, sender=sender)
    return statement, unpack(statement.body, body_model, peer=statement.sender)
