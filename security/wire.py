"""Input limits for messages from the network: msgpack bytes validated into strict pydantic models.

msgpack cannot execute code; every decode passes explicit size limits to the unpacker
and then a strict model, so a malformed message from a peer becomes a
`PeerProtocolError` (evidence) instead of a crash or an unbounded allocation.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from phalanx.errors import PeerProtocolError

MAX_MESSAGE_BYTES = 1 << 20  # small messages only; tensors travel as payload records
MAX_PEERS_PER_MESSAGE = 1024

PeerIdStr = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]  # base58
RoundId = Annotated[bytes, Field(min_length=8, max_length=32)]
Address = Annotated[str, Field(min_length=1, max_length=256)]


class WireModel(BaseModel):
    """Base of every message: unknown fields, wrong types and coercions are all rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


M = TypeVar("M", bound=WireModel)


def pack(message: WireModel) -> bytes:
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def unpack(raw: bytes | memoryview, model: type[M], *, peer: str | None = None) -> M:
    """Decode `raw` into `model`, or raise PeerProtocolError naming what was wrong."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise PeerProtocolError(f"{model.__name__} of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}", peer=peer)
    try:
        obj: Any = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=4 * MAX_PEERS_PER_MESSAGE,
            max_map_len=256,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise PeerProtocolError(f"undecodable {model.__name__}: {e}", peer=peer) from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "<root>"
        raise PeerProtocolError(f"invalid {model.__name__}.{where}: {first['msg']}", peer=peer) from None
