"""Signed health records: what a reader accepts, what it drops, and the DHT-side validator."""

from __future__ import annotations

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from phalanx.errors import PeerProtocolError
from phalanx.peer.health.record import (
    MAX_AGE_S,
    MAX_TTL_S,
    HealthRecord,
    HealthRecordValidator,
    health_key,
    sign_record,
    verify_entry,
)
from phalanx.security.identity import Identity

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def alice(tmp_path_factory) -> Identity:
    return Identity.generate_ed25519(tmp_path_factory.mktemp("alice") / "id")


@pytest.fixture(scope="module")
def mallory(tmp_path_factory) -> Identity:
    return Identity.generate_ed25519(tmp_path_factory.mktemp("mallory") / "id")


def record_of(identity: Identity, **changes) -> HealthRecord:
    fields = dict(
        peer_id=identity.peer_id, role="trainer", state="online", version="0.1.0", protocol=1, run_id="phalanx",
        config_hash="ab" * 32, published_at=NOW, started_at=NOW - 60, addresses=["/ip4/127.0.0.1/tcp/1"],
        reachability="direct", step=42, samples_per_s=1000.0, loss=0.5, accuracy=0.9,
    )  # fmt: skip
    return HealthRecord(**{**fields, **changes})


def test_signed_record_round_trips(alice):
    record = record_of(alice)
    assert verify_entry(alice.peer_id, sign_record(alice, record), now=NOW) == record


def test_a_language_models_record_carries_its_validation_loss_as_its_metric(alice):
    record = record_of(alice, accuracy=0.3, eval_loss=2.5, metric="loss")
    assert verify_entry(alice.peer_id, sign_record(alice, record), now=NOW) == record
    assert record_of(alice).metric == "accuracy" and record_of(alice).eval_loss is None  # what older peers sent


def test_rsa_identity_signs_too(tmp_path):
    from hivemind.p2p import P2P

    P2P.generate_identity(str(tmp_path / "rsa.id"))
    rsa = Identity.load(tmp_path / "rsa.id")
    assert verify_entry(rsa.peer_id, sign_record(rsa, record_of(rsa)), now=NOW).peer_id == rsa.peer_id


def test_tampered_record_is_rejected(alice):
    entry = sign_record(alice, record_of(alice))
    entry["record"] = record_of(alice, step=43).encode()
    with pytest.raises(PeerProtocolError, match="bad signature"):
        verify_entry(alice.peer_id, entry, now=NOW)


def test_record_forged_under_another_peers_subkey_is_rejected(alice, mallory):
    # mallory signs a record that names alice, with mallory's own key
    forged = record_of(alice)
    entry = {"record": forged.encode(), "public_key": mallory.public_key, "signature": mallory.sign(forged.encode())}
    with pytest.raises(PeerProtocolError, match="public key does not belong to the claimed peer ID"):
        verify_entry(alice.peer_id, entry, now=NOW)
    # mallory's own valid record, replayed under alice's subkey
    with pytest.raises(PeerProtocolError, match="public key does not belong"):
        verify_entry(alice.peer_id, sign_record(mallory, record_of(mallory)), now=NOW)
    # a peer cannot sign for another
    with pytest.raises(ValueError, match="cannot be signed by"):
        sign_record(mallory, record_of(alice))


def test_record_naming_another_peer_is_rejected(alice, mallory):
    record = record_of(mallory).model_copy(update={"peer_id": alice.peer_id})
    data = record.encode()
    entry = {"record": data, "public_key": mallory.public_key, "signature": mallory.sign(data)}
    with pytest.raises(PeerProtocolError, match="record names"):
        verify_entry(mallory.peer_id, entry, now=NOW)


@pytest.mark.parametrize(
    ("published_at", "accepted"),
    [(NOW, True), (NOW - MAX_AGE_S + 1, True), (NOW - MAX_AGE_S - 1, False), (NOW + 29, True), (NOW + 31, False)],
)
def test_freshness_bounds_replays(alice, published_at, accepted):
    entry = sign_record(alice, record_of(alice, published_at=published_at))
    if accepted:
        verify_entry(alice.peer_id, entry, now=NOW)
    else:
        with pytest.raises(PeerProtocolError, match="out of bounds"):
            verify_entry(alice.peer_id, entry, now=NOW)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss", float("nan"), "invalid HealthRecord.loss"),
        ("samples_per_s", -1.0, "invalid HealthRecord.samples_per_s"),
        ("accuracy", 1.5, "invalid HealthRecord.accuracy"),
        ("eval_loss", -1.0, "invalid HealthRecord.eval_loss"),
        ("metric", "f1", "invalid HealthRecord.metric"),
        ("bans", ["Qm" + "a" * 44] * 257, "invalid HealthRecord.bans"),
        ("state", "hacked", "invalid HealthRecord.state"),
        ("version", "x" * 33, "invalid HealthRecord.version"),
        ("step", "7", "invalid HealthRecord.step"),
        ("extra", 1, "invalid HealthRecord.extra"),
    ],
)
def test_every_field_is_checked_against_limits(alice, field, value, message):
    raw = record_of(alice).model_dump(mode="python") | {field: value}
    data = msgpack.packb(raw, use_bin_type=True)
    entry = {"record": data, "public_key": alice.public_key, "signature": alice.sign(data)}
    with pytest.raises(PeerProtocolError, match=message):
        verify_entry(alice.peer_id, entry, now=NOW)


def test_verdict_must_match_violations(alice):
    entry = sign_record(alice, record_of(alice, violations=["round member x has config hash y"], legal=True))
    with pytest.raises(PeerProtocolError, match="verdict contradicts"):
        verify_entry(alice.peer_id, entry, now=NOW)


@pytest.mark.parametrize("value", [None, b"raw", {"record": b""}, {"record": 1, "public_key": b"", "signature": b""}])
def test_malformed_entries_are_rejected(alice, value):
    with pytest.raises(PeerProtocolError):
        verify_entry(alice.peer_id, value, now=NOW)


def _dht_record(key: str, subkey: str, value, expiration: float) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )


def test_dht_validator_accepts_signed_records_and_refuses_forgeries(alice, mallory):
    validator = HealthRecordValidator("phalanx")
    key = health_key("phalanx")
    good = sign_record(alice, record_of(alice))
    assert validator.validate(_dht_record(key, alice.peer_id, good, NOW + 10))
    assert not validator.validate(_dht_record(key, alice.peer_id, sign_record(mallory, record_of(mallory)), NOW + 10))
    assert not validator.validate(
        _dht_record(key, alice.peer_id, good, NOW + MAX_TTL_S + 1)
    )  # expiry past the signed bound
    assert not validator.validate(_dht_record(key, alice.peer_id, {"record": b"junk"}, NOW + 10))
    # other keys, and other runs' health keys, are not this validator's business
    assert validator.validate(_dht_record("phalanx.other.peers", alice.peer_id, {"state": "online"}, NOW + 10))
    assert validator.validate(_dht_record(health_key("other-run"), alice.peer_id, b"anything", NOW + 10))
    assert validator.merge_with(HealthRecordValidator("phalanx")) and not validator.merge_with(
        HealthRecordValidator("x")
    )


@pytest.mark.parametrize("stored_back", [True, False])
def test_a_store_one_replica_refused_counts_when_the_dht_returns_the_record(alice, monkeypatch, stored_back):
    """hivemind reports the last replica's answer only: an outsider's node holding a plain value under the
    health key refuses the subkey and answers False. The record counts as published if a read returns it."""
    import asyncio
    from types import SimpleNamespace

    from phalanx.peer.health import service

    record = record_of(alice)
    peer = SimpleNamespace(
        dht=None, identity=alice, peer_id=alice.peer_id, published_at=None,
        settings=SimpleNamespace(run_id="r"), record=lambda: record,
    )  # fmt: skip
    peer._reads_back = lambda r: service.HealthService._reads_back(peer, r)

    async def refused(*_args, **_kwargs):
        return False

    async def fetched(_dht, _run_id):
        return ({alice.peer_id: (record, record.published_at + 30)} if stored_back else {}), 0

    monkeypatch.setattr(service, "dht_store", refused)
    monkeypatch.setattr(service, "fetch_records", fetched)
    asyncio.run(service.HealthService._publish(peer, 30.0))
    assert peer.published_at == (record.published_at if stored_back else None)
