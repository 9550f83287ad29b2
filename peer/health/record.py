"""Signed health records: what each peer publishes about itself in the DHT every few seconds.

Key `phalanx.<run id>.health`, subkey = the publisher's peer ID, value =
`{record: msgpack bytes of HealthRecord, public_key, signature}`. The signature covers the
exact record bytes and is bound to the peer ID (security.identity), and the record names the
same peer ID as the subkey, so a peer can publish only its own record. The signed
`published_at` caps how long a copy can be replayed, and DHT expirations beyond
`published_at + MAX_TTL_S` are refused by `HealthRecordValidator`.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any, Literal, Optional

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from pydantic import Field

from phalanx.errors import PeerProtocolError
from phalanx.security.identity import Identity, verify
from phalanx.security.wire import PeerIdStr, WireModel, unpack
from phalanx.tasks.metric import MetricKey

PUBLISH_EVERY_S = 3.0  # how often a peer refreshes its record
TTL_S = 10.0  # DHT expiration of a record: a silent peer vanishes from every view after this
MAX_TTL_S = 30.0  # validators refuse expirations further than this past the signed publish time
MAX_AGE_S = 60.0  # readers drop records published longer ago than this (replays of old copies)
MAX_SKEW_S = 30.0  # ... or further in the future than this (clock skew between volunteers)
MAX_ENVELOPE_BYTES = 64 * 1024
MAX_BANS = 256
MAX_VIOLATIONS = 16

Role = Literal["trainer", "bootstrap"]
State = Literal["joining", "online", "offline"]
Outcome = Literal["ok", "partial", "failed", "resync"]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=2**62)]
Hex = Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")]
Text = Annotated[str, Field(max_length=200)]


def health_key(run_id: str) -> str:
    """The DHT key every peer of a run (whatever its configuration) publishes its record under."""
    return f"phalanx.{run_id}.health"


class LastRound(WireModel):
    """The most recent round this peer took part in."""

    round_id: Hex  # hex of the round id the leader chose
    members: list[PeerIdStr] = Field(max_length=1024)  # the group, in reducer order
    outcome: Outcome  # ok: every part arrived; partial: some were dropped; resync: told to download state
    duration_s: NonNegative  # matchmaking + all-reduce, wall clock
    finished_at: NonNegative  # DHT time (seconds since the epoch)


class HealthRecord(WireModel):
    """One peer's self-reported health (every field is checked against explicit limits on read)."""

    peer_id: PeerIdStr  # must equal the DHT subkey and the signing key's peer ID
    role: Role
    state: State  # joining: no round completed yet; online: training; offline: shut down cleanly
    version: Annotated[str, Field(max_length=32)]  # package version
    protocol: Annotated[int, Field(ge=0, le=2**31)]  # protocol version (peer.config.PROTOCOL_VERSION)
    run_id: Annotated[str, Field(max_length=64)]
    config_hash: Hex  # run-configuration hash (hex); "" for a bootstrap peer
    published_at: NonNegative  # DHT time of signing
    started_at: NonNegative  # DHT time the process started
    addresses: list[Annotated[str, Field(max_length=256)]] = Field(max_length=16)  # visible multiaddrs
    # how others reach it: own address, a relay and holes punched through its router, a relay only, not at all
    reachability: Literal["direct", "punched", "relay", "client"]
    step: Count
    samples_per_s: NonNegative
    loss: Optional[Finite] = None
    accuracy: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    rounds_ok: Count = 0
    rounds_partial: Count = 0
    rounds_failed: Count = 0
    resyncs: Count = 0
    last_round: Optional[LastRound] = None
    peers_seen: Count = 0  # trainers in its membership view
    bans: list[PeerIdStr] = Field(default_factory=list, max_length=MAX_BANS)  # peers it has banned (first MAX_BANS)
    bans_digest: Hex = ""  # sha256 over the full sorted ban list: compared between peers
    bans_changed_at: NonNegative = 0.0  # DHT time its ban list last changed
    accusations_seen: Count = 0
    violations: list[Text] = Field(default_factory=list, max_length=MAX_VIOLATIONS)  # local legality check
    legal: bool = True  # its verdict: no violations
    leader: Optional[PeerIdStr] = None  # trainers: the matchmaking leader it follows (tells split groups apart)
    state_version: Hex = ""  # trainers: first 16 hex digits of its state version (equal at equal steps: same model)
    swarm_problems: list[Text] = Field(default_factory=list, max_length=MAX_VIOLATIONS)  # cut off, split, … (swarm_view)
    eval_loss: Optional[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = None  # last evaluation's loss (held-out split)
    metric: MetricKey = "accuracy"  # what its task is judged by: `accuracy` or `eval_loss` (tasks/metric.py)
    relayed_bytes: Count = 0  # bytes its rounds moved to and from peers reached through a relay

    def encode(self) -> bytes:
        """Canonical bytes (field order of the model, msgpack): what the signature covers."""
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)


def bans_digest(bans: set[str] | frozenset[str]) -> str:
    return hashlib.sha256("\n".join(sorted(bans)).encode()).hexdigest()


def sign_record(identity: Identity, record: HealthRecord) -> dict[str, bytes]:
    """The DHT value for `record`, signed by `identity` (which must be the record's peer)."""
    if record.peer_id != identity.peer_id:
        raise ValueError(f"record of {record.peer_id} cannot be signed by {identity.peer_id}")
    data = record.encode()
    return {"record": data, "public_key": identity.public_key, "signature": identity.sign(data)}


def verify_entry(subkey: Any, value: Any, *, now: Optional[float] = None) -> HealthRecord:
    """The record inside a DHT entry, or PeerProtocolError if anything about it is wrong.

    `now` (DHT time) also checks freshness: published within MAX_AGE_S, at most MAX_SKEW_S ahead."""
    if (
        not isinstance(subkey, str)
        or not isinstance(value, dict)
        or set(value) != {"record", "public_key", "signature"}
    ):
        raise PeerProtocolError("health entry is not {record, public_key, signature} under a peer-ID subkey")
    data, public_key, signature = value["record"], value["public_key"], value["signature"]
    if not all(isinstance(x, bytes) for x in (data, public_key, signature)) or len(data) > MAX_ENVELOPE_BYTES:
        raise PeerProtocolError("health entry fields must be bytes within limits", peer=subkey[:64])
    verify(subkey, public_key, data, signature)
    record = unpack(data, HealthRecord, peer=subkey)
    if record.peer_id != subkey:
        raise PeerProtocolError(f"record names {record.peer_id}, published under {subkey}", peer=subkey)
    if record.legal != (not record.violations):
        raise PeerProtocolError("record's verdict contradicts its violations", peer=subkey)
    if now is not None and not now - MAX_AGE_S <= record.published_at <= now + MAX_SKEW_S:
        raise PeerProtocolError(f"record published {now - record.published_at:.0f} s ago is out of bounds", peer=subkey)
    return record


def read_records(found: Any, *, now: float) -> tuple[dict[str, tuple[HealthRecord, float]], int]:
    """({peer ID: (record, expiration)}, number of invalid entries) from a `dht.get(health_key)` result."""
    records: dict[str, tuple[HealthRecord, float]] = {}
    invalid = 0
    if found is None or not isinstance(found.value, dict):
        return records, invalid
    for subkey, entry in found.value.items():
        try:
            expiration = float(entry.expiration_time)
            if expiration <= now:
                continue
            records[subkey] = (verify_entry(subkey, entry.value, now=now), expiration)
        except (PeerProtocolError, AttributeError, TypeError, ValueError):
            invalid += 1
    return records, invalid


class HealthRecordValidator(RecordValidatorBase):
    """DHT-side check (runs inside hivemind's DHT process): entries under the health key of `run_id`
    must carry a valid signature by their subkey's peer and an expiration bound to the signed time.
    Every other key passes untouched."""

    def __init__(self, run_id: str) -> None:
        self._key_id = DHTID.generate(source=health_key(run_id)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        try:
            subkey = msgpack.unpackb(
                record.subkey, raw=False, max_str_len=256, max_bin_len=0, max_array_len=0, max_map_len=0
            )
            value = _loads(record.value)
            health = verify_entry(subkey, value)
        except (PeerProtocolError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return False
        return math.isfinite(record.expiration_time) and record.expiration_time <= health.published_at + MAX_TTL_S

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, HealthRecordValidator) and other._key_id == self._key_id  # the same check twice


def _loads(raw: bytes) -> Any:
    """hivemind's MSGPackSerializer, with limits: the envelope is a map of three byte strings."""
    from hivemind.utils.serializer import MSGPackSerializer

    if len(raw) > MAX_ENVELOPE_BYTES:
        raise ValueError("oversized health entry")
    return MSGPackSerializer.loads(raw)
