"""Signed DHT records: what a peer stores under one of its run's DHT keys, in a subkey named by its peer ID.

The DHT is shared with strangers, and any node may store anything under any key. A record is therefore a
signed statement (kind "record") that binds its value to the DHT key, to its signer (who must be the
peer its subkey names) and to the exact DHT expiration it is stored with, at most `max_ttl_s` after it
was signed: nobody can write in another peer's name, move a record to another key or run, or keep it
alive longer than its signer chose. DHT nodes check it on every store and every answer
(protocol.dht_records), and the peer that reads it checks it again.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import Field

from phalanx.errors import PeerProtocolError
from phalanx.security.identity import Identity
from phalanx.security.statements import Signed, open_statement, sign_statement
from phalanx.security.wire import WireModel, pack, unpack

KIND = "record"
MAX_VALUE_BYTES = 16 << 10  # a record's own model: a membership record is about 100 bytes, 16 slow marks ~1 KB
MAX_RECORD_BYTES = MAX_VALUE_BYTES + 4096  # with the statement, an RSA key (~300 bytes) and its signature
# A record signed further ahead of the checker's clock than this is refused: without it, a signer could
# make a record that lives for years by signing it in the future. Volunteers' clocks are seconds apart;
# a clock this far off is refused by verified runs and certificates anyway (`phalanx doctor` warns).
MAX_SKEW_S = 300.0

M = TypeVar("M", bound=WireModel)
Time = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RecordBody(WireModel):
    key: Annotated[str, Field(min_length=1, max_length=256)]  # the raw DHT key it is stored under
    signed_at: Time  # the signer's DHT time when it signed
    expires_at: Time  # the DHT expiration it must be stored with
    value: Annotated[bytes, Field(max_length=MAX_VALUE_BYTES)]  # pack() of the key's own model


def sign_record(identity: Identity, key: str, value: WireModel, *, signed_at: float, ttl_s: float) -> tuple[bytes, float]:
    """(the DHT value, the expiration to store it with) for `value` under `key`, in `identity`'s subkey."""
    body = RecordBody(key=key, signed_at=signed_at, expires_at=signed_at + ttl_s, value=pack(value))
    return pack(sign_statement(identity, KIND, b"", body)), body.expires_at


def open_record(
    raw: Any, model: type[M], *, key: str, subkey: Any, expiration: float, max_ttl_s: float, now: float
) -> M:
    """The record's value if `raw`, found under `key`/`subkey` with DHT expiration `expiration`, is a record
    that `subkey`'s peer signed for exactly that; PeerProtocolError naming what is wrong otherwise."""
    if not isinstance(subkey, str) or not 0 < len(subkey) <= 128:
        raise PeerProtocolError("record under a subkey that is not a peer ID")
    if not isinstance(raw, bytes) or len(raw) > MAX_RECORD_BYTES:
        raise PeerProtocolError("record is not a signed statement within limits", peer=subkey)
    signed = unpack(raw, Signed, peer=subkey)
    _, body = open_statement(signed, RecordBody, kind=KIND, round_id=b"", sender=subkey)
    if body.key != key:
        raise PeerProtocolError(f"record signed for key {body.key[:64]!r}, stored under another", peer=subkey)
    if body.expires_at != expiration:
        raise PeerProtocolError("record stored with an expiration its signer did not sign", peer=subkey)
    if not 0 < body.expires_at - body.signed_at <= max_ttl_s:
        raise PeerProtocolError(f"record lives {body.expires_at - body.signed_at:.0f} s, over {max_ttl_s:g} s", peer=subkey)
    if body.signed_at > now + MAX_SKEW_S:
        raise PeerProtocolError(f"record signed {body.signed_at - now:.0f} s in the future", peer=subkey)
    return unpack(body.value, model, peer=subkey)
