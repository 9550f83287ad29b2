"""Signed records (security.records) in hivemind's DHT: the check every DHT node of the run applies to a
key's records, and the reader's own check of what a get returned.

A validator runs inside hivemind's DHT process, on every store a node is asked for and on every answer it
gets: it refuses plain values (one would replace the whole dictionary of subkeys), subkeys that are not
peer IDs, and records their subkey's peer did not sign for this key and this expiration. hivemind drops
a whole answer if one of its subkeys fails, so a node that stores junk only loses its own answers.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from phalanx.errors import PeerProtocolError
from phalanx.security.records import MAX_RECORD_BYTES, open_record
from phalanx.security.wire import WireModel

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=WireModel)


def load_subkey(raw: bytes) -> Any:
    """A DHT record's subkey as hivemind serialized it (msgpack), within limits; None for a plain value."""
    return msgpack.unpackb(raw, raw=False, max_str_len=256, max_bin_len=0, max_array_len=0, max_map_len=0, max_ext_len=0)


def load_value(raw: bytes) -> Any:
    """A DHT record's value as hivemind serialized it (msgpack), within limits."""
    return msgpack.unpackb(
        raw, raw=False, max_str_len=0, max_bin_len=MAX_RECORD_BYTES, max_array_len=0, max_map_len=0, max_ext_len=0
    )


class SignedRecordValidator(RecordValidatorBase, Generic[M]):
    """Refuses, at a DHT node, every value under `key` that is not a signed record of `model` (see module)."""

    def __init__(self, key: str, model: type[M], max_ttl_s: float) -> None:
        self.key, self.model, self.max_ttl_s = key, model, max_ttl_s
        self._key_id = DHTID.generate(source=key).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True  # another key: its own validator decides
        try:
            open_record(
                load_value(record.value),
                self.model,
                key=self.key,
                subkey=load_subkey(record.subkey),
                expiration=record.expiration_time,
                max_ttl_s=self.max_ttl_s,
                now=get_dht_time(),
            )
        except (PeerProtocolError, ValueError, TypeError) as e:  # msgpack's errors are ValueErrors
            logger.debug(f"refused a record under {self.key}: {e!r}")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator) and other._key_id == self._key_id  # the same check twice

    def __getstate__(self) -> dict:  # sent to the DHT process: the key, not its derived id
        return {"key": self.key, "model": self.model, "max_ttl_s": self.max_ttl_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["key"], state["model"], state["max_ttl_s"])


def read_signed(found: Any, model: type[M], *, key: str, max_ttl_s: float, now: float) -> tuple[dict[str, tuple[M, float]], int]:
    """({peer ID: (value, expiration)}, number of invalid entries) from a `dht_get(key)` result: every
    unexpired record checked again here, whatever the DHT node that answered did."""
    records: dict[str, tuple[M, float]] = {}
    invalid = 0
    if found is None:
        return records, invalid
    if not isinstance(found.value, dict):
        return records, 1  # a plain value: refused by our DHT node, unless it reached us some other way
    for subkey, entry in found.value.items():
        try:
            expiration = float(entry.expiration_time)
            if expiration <= now:
                continue
            value = open_record(entry.value, model, key=key, subkey=subkey, expiration=expiration, max_ttl_s=max_ttl_s, now=now)
        except (PeerProtocolError, AttributeError, TypeError, ValueError):
            invalid += 1
            continue
        records[subkey] = (value, expiration)
    return records, invalid
