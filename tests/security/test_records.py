"""Signed DHT records: a record opens only under its key, its signer's subkey and the expiration it was signed for."""

import pytest

from phalanx.errors import PeerProtocolError
from phalanx.security.identity import Identity
from phalanx.security.records import MAX_SKEW_S, open_record, sign_record
from phalanx.security.wire import WireModel

NOW = 1_700_000_000.0
KEY = "phalanx.run.0123456789abcdef.peers"


class Value(WireModel):
    step: int


@pytest.fixture(scope="module")
def alice(tmp_path_factory):
    return Identity.generate_ed25519(tmp_path_factory.mktemp("ids") / "alice.id")


@pytest.fixture(scope="module")
def mallory(tmp_path_factory):
    return Identity.generate_ed25519(tmp_path_factory.mktemp("ids") / "mallory.id")


def _open(raw, subkey, expiration, *, key=KEY, max_ttl_s=60.0, now=NOW):
    return open_record(raw, Value, key=key, subkey=subkey, expiration=expiration, max_ttl_s=max_ttl_s, now=now)


def test_a_record_opens_under_its_key_subkey_and_expiration(alice):
    raw, expiration = sign_record(alice, KEY, Value(step=7), signed_at=NOW, ttl_s=8.0)
    assert expiration == NOW + 8.0
    assert _open(raw, alice.peer_id, expiration) == Value(step=7)


@pytest.mark.parametrize(
    "change, error",
    [
        ({"key": KEY.replace("peers", "bans")}, "signed for key"),
        ({"expiration": NOW + 3600}, "expiration its signer did not sign"),
        ({"max_ttl_s": 5.0}, "over 5 s"),
        ({"now": NOW - MAX_SKEW_S - 1}, "in the future"),
    ],
)
def test_a_record_moved_kept_alive_or_from_the_future_is_refused(alice, change, error):
    raw, expiration = sign_record(alice, KEY, Value(step=7), signed_at=NOW, ttl_s=8.0)
    kwargs = {"expiration": expiration, **change}
    with pytest.raises(PeerProtocolError, match=error):
        _open(raw, alice.peer_id, kwargs.pop("expiration"), **kwargs)


def test_a_record_in_another_peers_subkey_is_refused(alice, mallory):
    raw, expiration = sign_record(mallory, KEY, Value(step=7), signed_at=NOW, ttl_s=8.0)
    with pytest.raises(PeerProtocolError, match="not by the sender"):
        _open(raw, alice.peer_id, expiration)


def test_a_changed_byte_breaks_the_signature(alice):
    raw, expiration = sign_record(alice, KEY, Value(step=7), signed_at=NOW, ttl_s=8.0)
    tampered = bytearray(raw)
    tampered[raw.index(b"\x07")] = 8  # the step, inside the signed statement
    with pytest.raises(PeerProtocolError, match="bad signature"):
        _open(bytes(tampered), alice.peer_id, expiration)


@pytest.mark.parametrize(
    "raw, subkey, error",
    [
        ({"state": "leaving"}, "alice", "not a signed statement"),  # what peers stored before records were signed
        ("split", "alice", "not a signed statement"),
        (b"\x00" * 30_000, "alice", "not a signed statement"),
        (b"\x81\xa1a\x01", "alice", "undecodable|Signed"),
        (b"", None, "not a peer ID"),  # a plain value (no subkey)
    ],
)
def test_what_is_not_a_record_is_refused(alice, raw, subkey, error):
    with pytest.raises(PeerProtocolError, match=error):
        _open(raw, alice.peer_id if subkey == "alice" else subkey, NOW + 8)
